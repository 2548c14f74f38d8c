package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// writes counts the aggregator's requests that the totals add to: pod
// patches, status applies, and lists of a parent's pods.
type writes struct {
	podPatches, statusApplies, podLists atomic.Int64
}

func writesConfig(base *rest.Config) (*rest.Config, *writes) {
	w := &writes{}
	cfg := rest.CopyConfig(base)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			path := req.URL.Path
			switch {
			case req.Method == http.MethodPatch && strings.HasSuffix(path, "/status") && strings.Contains(path, "/workerpools/"):
				w.statusApplies.Add(1)
			case req.Method == http.MethodPatch && strings.Contains(path, "/pods/"):
				w.podPatches.Add(1)
			case req.Method == http.MethodGet && strings.HasSuffix(path, "/pods") && req.URL.Query().Get("watch") == "" &&
				strings.Contains(req.URL.Query().Get("labelSelector"), keys.ParentUID+"="):
				w.podLists.Add(1)
			}
			return rt.RoundTrip(req)
		})
	})
	return cfg, w
}

// runTotals measures what the cumulative totals cost in API requests: the
// same pods finish (half Failed, half deleted while running) under the
// aggregator with the four counts only (the baseline) and with both totals
// mapped, first in bursts, then one at a time.
func runTotals(env *framework.Env, nParents, podsPer, burst int) error {
	counts := map[config.Count]string{
		config.Completing: "status.completing", config.Completed: "status.completed",
		config.Active: "status.active", config.Unexpected: "status.unexpected",
	}
	withTotals := map[config.Count]string{config.CompletedTotal: "status.completedTotal", config.UnexpectedTotal: "status.unexpectedTotal"}
	for c, p := range counts {
		withTotals[c] = p
	}
	type result struct {
		w     *writes
		took  time.Duration
		pods  int
		label string
	}
	var results []result
	for _, workload := range []struct {
		name           string
		parents, burst int
		pause          time.Duration
	}{
		{fmt.Sprintf("bursts of %d", burst), nParents, burst, time.Second},
		{"one at a time, 100 ms apart", 2, 1, 100 * time.Millisecond},
	} {
		for _, mode := range []struct {
			name   string
			parent config.Parent
		}{
			{"counts only (baseline)", config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: counts}},
			{"counts and totals", config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: withTotals, Ledger: "status.tallyLedger"}},
		} {
			label := workload.name + ", " + mode.name
			w, took, n, err := finishAll(env, mode.parent, workload.parents, podsPer, workload.burst, workload.pause)
			if err != nil {
				return fmt.Errorf("%s: %w", label, err)
			}
			results = append(results, result{w: w, took: took, pods: n, label: label})
			fmt.Printf("%-48s %d pods finished, settled in %s: pod patches %d, status applies %d, pod lists %d\n",
				label, n, took.Round(time.Millisecond), w.podPatches.Load(), w.statusApplies.Load(), w.podLists.Load())
		}
		base, tot := results[len(results)-2], results[len(results)-1]
		per := func(f func(*writes) int64) float64 {
			return float64(f(tot.w)-f(base.w)) / float64(tot.pods)
		}
		fmt.Printf("%s: per finished pod, the totals add %.3f pod patches, %.3f status applies, %.3f pod lists (target: at most 1 pod patch, status applies well under 1 in bursts)\n",
			workload.name,
			per(func(w *writes) int64 { return w.podPatches.Load() }),
			per(func(w *writes) int64 { return w.statusApplies.Load() }),
			per(func(w *writes) int64 { return w.podLists.Load() }))
	}
	return nil
}

// finishAll creates nParents parents of podsPer running pods (carrying the
// finalizer when parent keeps totals, as the webhook gives it), starts the
// aggregator with parent and waits until it wrote every count, then
// finishes every pod, burst at a time with pause between bursts, and waits
// until the status is settled: the counts (and totals) right, no ledger, no
// finalizer left. It returns the requests the aggregator sent from the
// first finished pod on.
func finishAll(env *framework.Env, parent config.Parent, nParents, podsPer, burst int, pause time.Duration) (*writes, time.Duration, int, error) {
	ctx := context.Background()
	c := env.Client
	ns, err := env.Namespace(ctx, "totals")
	if err != nil {
		return nil, 0, 0, err
	}
	var pods []*corev1.Pod
	var creates []func() error
	uids := map[string]types.UID{}
	for i := range nParents {
		name := fmt.Sprintf("pool-%03d", i)
		pool := builder.WorkerPool(ns, name, int64(podsPer))
		if err := c.Create(ctx, pool); err != nil {
			return nil, 0, 0, err
		}
		uids[name] = pool.GetUID()
		for j := range podsPer {
			b := builder.Pod(ns, fmt.Sprintf("%s-%03d", name, j)).ControlledBy(builder.WorkerPoolGVK, name, pool.GetUID()).
				Label(keys.ParentUID, string(pool.GetUID())).Phase(corev1.PodRunning)
			if parent.Tracked() {
				b = b.Finalizer(keys.TrackingFinalizer)
			}
			pod := b.Build()
			pods = append(pods, pod)
			creates = append(creates, func() error {
				p := pod.DeepCopy()
				if err := c.Create(ctx, p); err != nil {
					return err
				}
				p.Status.Phase = corev1.PodRunning
				return c.Status().Update(ctx, p)
			})
		}
	}
	if err := parallel(16, creates); err != nil {
		return nil, 0, 0, err
	}

	cfg, w := writesConfig(env.Config)
	aggCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- app.Run(aggCtx, &config.Config{Parents: []config.Parent{parent}}, cfg,
			app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Hour, QPS: 50, Burst: 100})
	}()
	defer func() { stop(); <-done }()
	settled := func(want func(u *unstructured.Unstructured) bool) error {
		deadline := time.Now().Add(5 * time.Minute)
		for name := range uids {
			for {
				u := builder.WorkerPool(ns, name, 0)
				if err := c.Get(ctx, client.ObjectKeyFromObject(u), u); err != nil {
					return err
				}
				if want(u) {
					break
				}
				if time.Now().After(deadline) {
					return fmt.Errorf("%s never settled: status %v", name, u.Object["status"])
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
		return nil
	}
	if err := settled(func(u *unstructured.Unstructured) bool { return field(u, "active") == int64(podsPer) }); err != nil {
		return nil, 0, 0, err
	}
	w.podPatches.Store(0)
	w.statusApplies.Store(0)
	w.podLists.Store(0)

	start := time.Now()
	for i := 0; i < len(pods); i += burst {
		var jobs []func() error
		for k, pod := range pods[i:min(i+burst, len(pods))] {
			jobs = append(jobs, func() error {
				if (i+k)%2 == 0 {
					return c.Delete(ctx, pod.DeepCopy())
				}
				p := pod.DeepCopy()
				p.Status.Phase = corev1.PodFailed
				return c.Status().Update(ctx, p)
			})
		}
		if err := parallel(16, jobs); err != nil {
			return nil, 0, 0, err
		}
		time.Sleep(pause)
	}
	half := int64(podsPer / 2)
	err = settled(func(u *unstructured.Unstructured) bool {
		if field(u, "active") != 0 || field(u, "unexpected") != int64(podsPer)-half {
			return false
		}
		if !parent.Tracked() {
			return true
		}
		ledger, _, _ := unstructured.NestedMap(u.Object, "status", "tallyLedger")
		for _, l := range ledger {
			if list, _ := l.([]any); len(list) > 0 {
				return false
			}
		}
		return field(u, "unexpectedTotal") == int64(podsPer)
	})
	if err != nil {
		return nil, 0, 0, err
	}
	if parent.Tracked() {
		var list corev1.PodList
		if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return nil, 0, 0, err
		}
		for _, p := range list.Items {
			for _, f := range p.Finalizers {
				if f == keys.TrackingFinalizer {
					return nil, 0, 0, fmt.Errorf("pod %s kept the finalizer", p.Name)
				}
			}
		}
	}
	return w, time.Since(start), len(pods), nil
}
