package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// runInstall measures a fresh install into a busy cluster: nNamespaces ×
// parentsPer parents of podsPer pods each, none stamped, then the aggregator
// started with its default client limits. It reports when every parent
// first shows its true counts, when every pod is stamped (when the counts
// were first right before the sweep counted what it read: the baseline,
// in the same run), and the API requests spent by then.
//
// With countsOnly it stops once the counts are right (the stamps of 150,000
// pods take about 50 minutes at the default rate).
func runInstall(ctx context.Context, env *framework.Env, nNamespaces, parentsPer, podsPer int, countsOnly bool) error {
	c := env.Client
	start := time.Now()
	want := map[string]map[string]int64{} // "<ns>/<name>" → status field → count
	var creates []func() error
	for n := range nNamespaces {
		ns, err := env.Namespace(ctx, fmt.Sprintf("install-%02d", n))
		if err != nil {
			return err
		}
		for p := range parentsPer {
			name := fmt.Sprintf("pool-%02d", p)
			pool := operator.Pool(ns, name, int64(podsPer))
			if err := c.Create(ctx, pool); err != nil {
				return err
			}
			counts := map[string]int64{"completing": 0, "completed": 0, "active": 0, "unexpected": 0}
			want[ns+"/"+name] = counts
			for i := range podsPer {
				pod := builder.Pod(ns, fmt.Sprintf("%s-%03d", name, i)).ControlledBy(operator.GVK, name, pool.GetUID()).Mixed(i).Build()
				_, intent := pod.Annotations[keys.CompletionIntent]
				terminal := pod.Status.Phase == corev1.PodSucceeded
				switch {
				case intent && terminal:
					counts["completed"]++
				case intent:
					counts["completing"]++
				case terminal:
					counts["unexpected"]++
				default:
					counts["active"]++
				}
				creates = append(creates, func() error {
					phase := pod.Status.Phase
					p := pod.DeepCopy()
					if err := c.Create(ctx, p); err != nil {
						return err
					}
					if phase == "" {
						return nil
					}
					p.Status.Phase = phase
					return c.Status().Update(ctx, p)
				})
			}
		}
	}
	if err := parallel(16, creates); err != nil {
		return err
	}
	total := nNamespaces * parentsPer * podsPer
	fmt.Printf("created %d unstamped pods of %d parents in %s\n", total, len(want), time.Since(start).Round(time.Second))

	cfg, w := writesConfig(env.Config)
	aggCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	parent := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: map[config.Count]string{
		config.Completing: "status.completing", config.Completed: "status.completed", config.Active: "status.active", config.Unexpected: "status.unexpected",
	}}
	start = time.Now()
	go func() {
		done <- app.Run(aggCtx, &config.Config{Parents: []config.Parent{parent}}, cfg,
			app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 1, BackfillInterval: time.Hour, QPS: 50, Burst: 100})
	}()
	defer func() { stop(); <-done }()

	var countsRight time.Duration
	var countsRequests int64
	for {
		if time.Since(start) > 2*time.Hour {
			return fmt.Errorf("not settled after %s", time.Since(start))
		}
		if countsRight == 0 {
			ok, err := allRight(ctx, c, want)
			if err != nil {
				return err
			}
			if ok {
				countsRight, countsRequests = time.Since(start), w.requests.Load()
				fmt.Printf("every parent right after %s, %d API requests, %.0f pods stamped so far\n",
					countsRight.Round(100*time.Millisecond), countsRequests, stampedPods())
				if countsOnly {
					return nil
				}
			}
		}
		if stampedPods() >= float64(total) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	stamped, stampRequests := time.Since(start), w.requests.Load()
	fmt.Printf("every pod stamped after %s, %d API requests (%.2f per pod)\n", stamped.Round(100*time.Millisecond), stampRequests, float64(stampRequests)/float64(total))
	fmt.Printf("install of %d pods: counts right after %s, %.3fx the time to stamp every pod (%s, when the counts waited for the stamps)\n",
		total, countsRight.Round(100*time.Millisecond), countsRight.Seconds()/stamped.Seconds(), stamped.Round(time.Second))
	return nil
}

// allRight reports whether every parent in want shows its counts.
func allRight(ctx context.Context, c client.Client, want map[string]map[string]int64) (bool, error) {
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(operator.GVK.GroupVersion().WithKind("WorkerPoolList"))
	if err := c.List(ctx, list); err != nil {
		return false, err
	}
	right := 0
	for i := range list.Items {
		u := &list.Items[i]
		counts, ok := want[u.GetNamespace()+"/"+u.GetName()]
		if !ok {
			continue
		}
		for name, n := range counts {
			if v, found, _ := unstructured.NestedInt64(u.Object, "status", name); !found || v != n {
				return false, nil
			}
		}
		right++
	}
	return right == len(want), nil
}

// stampedPods reads tally_aggregator_backfill_stamped_pods_total from the
// in-process aggregator's registry.
func stampedPods() float64 { return counter("tally_aggregator_backfill_stamped_pods_total") }

// counter returns the sum of the in-process registry's counter name.
func counter(name string) float64 {
	families, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, f := range families {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}
