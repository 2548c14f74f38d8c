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
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// writes counts the aggregator's requests that the totals add to: pod
// patches, status applies, lists and reads of pods, and every request but
// watches, with the bytes of their answers.
type writes struct {
	podPatches, statusApplies, podLists, podReads, requests, received atomic.Int64
}

func (w *writes) reset() {
	for _, n := range []*atomic.Int64{&w.podPatches, &w.statusApplies, &w.podLists, &w.podReads, &w.requests, &w.received} {
		n.Store(0)
	}
}

func writesConfig(base *rest.Config) (*rest.Config, *writes) {
	w := &writes{}
	cfg := rest.CopyConfig(base)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			path := req.URL.Path
			watching := req.URL.Query().Get("watch") != ""
			if !watching {
				w.requests.Add(1)
			}
			switch {
			case req.Method == http.MethodPatch && strings.HasSuffix(path, "/status") && strings.Contains(path, "/workerpools/"):
				w.statusApplies.Add(1)
			case req.Method == http.MethodPatch && strings.Contains(path, "/pods/"):
				w.podPatches.Add(1)
			case req.Method == http.MethodGet && strings.HasSuffix(path, "/pods") && req.URL.Query().Get("watch") == "" &&
				strings.Contains(req.URL.Query().Get("labelSelector"), keys.ParentUID+"="):
				w.podLists.Add(1)
			case req.Method == http.MethodGet && strings.Contains(path, "/pods/"):
				w.podReads.Add(1)
			}
			resp, err := rt.RoundTrip(req)
			if err == nil && !watching {
				resp.Body = &countingBody{ReadCloser: resp.Body, n: &w.received}
			}
			return resp, err
		})
	})
	return cfg, w
}

// runTotals measures what the cumulative totals cost in API requests: the
// same pods finish (half Failed, half deleted while running) under the
// aggregator with the four counts only (the baseline) and with both totals
// mapped: in bursts, one at a time, and one at a time in one parent of
// bigPod pods.
func runTotals(ctx context.Context, env *framework.Env, nParents, podsPer, burst, bigPods int) error {
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
	for _, wl := range []workload{
		{name: fmt.Sprintf("%d pods in bursts of %d", nParents*podsPer, burst), parents: nParents, podsPer: podsPer, finish: nParents * podsPer, burst: burst, pause: time.Second},
		{name: "100 pods one at a time, 100 ms apart", parents: 2, podsPer: podsPer, finish: 2 * podsPer, burst: 1, pause: 100 * time.Millisecond},
		{name: fmt.Sprintf("200 of a %d-pod parent one at a time, 100 ms apart", bigPods), parents: 1, podsPer: bigPods, finish: 200, burst: 1, pause: 100 * time.Millisecond},
	} {
		for _, mode := range []struct {
			name   string
			parent config.Parent
		}{
			{"counts only (baseline)", config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: counts}},
			{"counts and totals", config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: withTotals, Ledger: "status.tallyLedger"}},
		} {
			label := wl.name + ", " + mode.name
			w, took, err := finishAll(ctx, env, mode.parent, wl)
			if err != nil {
				return fmt.Errorf("%s: %w", label, err)
			}
			results = append(results, result{w: w, took: took, pods: wl.finish, label: label})
			fmt.Printf("%-72s settled in %s: requests %d (%.1f MiB received), pod patches %d, status applies %d, pod lists %d, pod reads %d\n",
				label, took.Round(time.Millisecond), w.requests.Load(), mib(w.received.Load()), w.podPatches.Load(), w.statusApplies.Load(), w.podLists.Load(), w.podReads.Load())
		}
		base, tot := results[len(results)-2], results[len(results)-1]
		per := func(f func(*writes) *atomic.Int64) float64 {
			return float64(f(tot.w).Load()-f(base.w).Load()) / float64(tot.pods)
		}
		fmt.Printf("%s: per finished pod, the totals add %.1f KiB received and %.3f requests: %.3f pod patches, %.3f status applies, %.3f pod lists, %.3f pod reads (targets: at most 1 pod patch, at most 0.05 pod lists)\n",
			wl.name,
			per(func(w *writes) *atomic.Int64 { return &w.received })/1024,
			per(func(w *writes) *atomic.Int64 { return &w.requests }),
			per(func(w *writes) *atomic.Int64 { return &w.podPatches }),
			per(func(w *writes) *atomic.Int64 { return &w.statusApplies }),
			per(func(w *writes) *atomic.Int64 { return &w.podLists }),
			per(func(w *writes) *atomic.Int64 { return &w.podReads }))
	}
	return nil
}

// workload is how the pods of a totals run finish: the first finish of
// parents × podsPer pods, burst at a time with pause between bursts.
type workload struct {
	name                            string
	parents, podsPer, finish, burst int
	pause                           time.Duration
}

// finishAll creates the workload's parents and running pods (carrying the
// finalizer when parent keeps totals, as the webhook gives it), starts the
// aggregator with parent and waits until it wrote every count, then
// finishes the workload's pods and waits until the status is settled: the
// counts (and totals) right, no ledger, no finalizer left on a finished pod.
// It returns the requests the aggregator sent from the first finished pod
// on.
func finishAll(ctx context.Context, env *framework.Env, parent config.Parent, wl workload) (*writes, time.Duration, error) {
	nParents, podsPer := wl.parents, wl.podsPer
	c := env.Client
	ns, err := env.Namespace(ctx, "totals")
	if err != nil {
		return nil, 0, err
	}
	var pods []*corev1.Pod
	var creates []func() error
	uids := map[string]types.UID{}
	poolOf := map[string]int{} // the index of each parent's first pod
	for i := range nParents {
		name := fmt.Sprintf("pool-%03d", i)
		poolOf[name] = len(pods)
		pool := operator.Pool(ns, name, int64(podsPer))
		if err := c.Create(ctx, pool); err != nil {
			return nil, 0, err
		}
		uids[name] = pool.GetUID()
		for j := range podsPer {
			b := builder.Pod(ns, fmt.Sprintf("%s-%04d", name, j)).ControlledBy(operator.GVK, name, pool.GetUID()).
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
		return nil, 0, err
	}

	cfg, w := writesConfig(env.Config)
	sweeps := counter("tally_aggregator_backfill_sweeps_total")
	aggCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- app.Run(aggCtx, &config.Config{Parents: []config.Parent{parent}}, cfg,
			app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Hour, QPS: 50, Burst: 100})
	}()
	defer func() {
		stop()
		<-done
		// The next run's aggregator would reconcile these parents too.
		for name := range uids {
			_ = c.Delete(ctx, operator.Pool(ns, name, 0))
		}
	}()
	settled := func(want func(u *unstructured.Unstructured) bool) error {
		deadline := time.Now().Add(5 * time.Minute)
		for name := range uids {
			for {
				u := operator.Pool(ns, name, 0)
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
		return nil, 0, err
	}
	// The start-up sweep (which completes the pods' tally metadata) is not
	// part of what is measured.
	for counter("tally_aggregator_backfill_sweeps_total") <= sweeps {
		time.Sleep(50 * time.Millisecond)
	}
	w.reset()

	start := time.Now()
	for i := 0; i < wl.finish; i += wl.burst {
		var jobs []func() error
		for k, pod := range pods[i:min(i+wl.burst, wl.finish)] {
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
			return nil, 0, err
		}
		time.Sleep(wl.pause)
	}
	// Of each parent's finished pods, those at even indexes were deleted,
	// the others failed.
	finished := func(name string) (deleted, failed int64) {
		for i := poolOf[name]; i < poolOf[name]+podsPer && i < wl.finish; i++ {
			if i%2 == 0 {
				deleted++
			} else {
				failed++
			}
		}
		return deleted, failed
	}
	err = settled(func(u *unstructured.Unstructured) bool {
		deleted, failed := finished(u.GetName())
		if field(u, "active") != int64(podsPer)-deleted-failed || field(u, "unexpected") != failed {
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
		return field(u, "unexpectedTotal") == deleted+failed
	})
	if err != nil {
		return nil, 0, err
	}
	if parent.Tracked() {
		var list corev1.PodList
		if err := c.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return nil, 0, err
		}
		for _, p := range list.Items {
			for _, f := range p.Finalizers {
				if f == keys.TrackingFinalizer && p.Status.Phase == corev1.PodFailed {
					return nil, 0, fmt.Errorf("pod %s kept the finalizer", p.Name)
				}
			}
		}
	}
	return w, time.Since(start), nil
}
