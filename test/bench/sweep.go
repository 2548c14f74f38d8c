package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// runSweep measures the backfill sweep over a cluster of total realistic
// pods, tracked of which belong to WorkerPools and carry no tally label
// (the rest are a ReplicaSet's, which tally does not track): the first
// sweep at install (which stamps the tracked pods), then a steady-state
// sweep (nothing left to stamp). The baseline is a plain paginated List of
// the same pods, as any controller's informer does at start-up.
func runSweep(ctx context.Context, env *framework.Env, total, tracked int) error {
	c := env.Client
	pool := operator.Pool(ns, "pool-a", int64(tracked))
	if err := c.Create(ctx, pool); err != nil {
		return err
	}
	rsGVK := appsv1.SchemeGroupVersion.WithKind("ReplicaSet")
	start := time.Now()
	var creates []func() error
	for i := range total {
		b := builder.Pod(ns, fmt.Sprintf("pod-%05d", i))
		if i < tracked {
			b = b.ControlledBy(operator.GVK, "pool-a", pool.GetUID())
		} else {
			b = b.ControlledBy(rsGVK, "web-7d9f8", "3f0c2a8e-0000-4000-8000-000000000001")
		}
		pod := builder.RealisticPod(b)
		pod.GenerateName = ""
		creates = append(creates, func() error { return c.Create(ctx, pod) })
	}
	if err := parallel(16, creates); err != nil {
		return err
	}
	fmt.Printf("created %d pods (%d tracked, unlabelled) in %s\n", total, tracked, time.Since(start).Round(time.Millisecond))

	cfg, counted := countingConfig(env.Config)
	cfg.QPS, cfg.Burst = 50, 100 // the aggregator's defaults
	cl, err := client.New(cfg, client.Options{})
	if err != nil {
		return err
	}

	counted.reset()
	start = time.Now()
	list := &corev1.PodList{}
	n := 0
	for opts := []client.ListOption{client.Limit(aggregate.BackfillPageSize)}; ; {
		if err := cl.List(ctx, list, opts...); err != nil {
			return err
		}
		n += len(list.Items)
		if list.Continue == "" {
			break
		}
		opts = []client.ListOption{client.Limit(aggregate.BackfillPageSize), client.Continue(list.Continue)}
	}
	baseTime, baseBytes := time.Since(start), counted.received.Load()
	fmt.Printf("baseline: paginated List of %d whole pods: %s, %.1f MiB received\n", n, baseTime.Round(time.Millisecond), mib(baseBytes))

	parents := []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}}
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	b := aggregate.NewBackfill(mutate.NewMutator(parents, nil), cl, cl, indexer,
		func(context.Context) bool { return true }, time.Hour, ctrl.Log.WithName("backfill"))
	for _, phase := range []string{"first sweep (stamps the tracked pods)", "steady-state sweep (nothing to stamp)"} {
		counted.reset()
		start = time.Now()
		stamped, err := b.Sweep(ctx)
		if err != nil {
			return err
		}
		took := time.Since(start)
		fmt.Printf("%s: %s (%.2fx the List), %d pods stamped, %.1f MiB received (%.3fx), %.1f MiB sent, %d requests\n",
			phase, took.Round(time.Millisecond), took.Seconds()/baseTime.Seconds(), stamped,
			mib(counted.received.Load()), float64(counted.received.Load())/float64(baseBytes), mib(counted.sent.Load()), counted.requests.Load())
	}
	return nil
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

// byteCounter counts requests and the bytes of their bodies both ways.
type byteCounter struct {
	requests, sent, received atomic.Int64
}

func (b *byteCounter) reset() {
	b.requests.Store(0)
	b.sent.Store(0)
	b.received.Store(0)
}

func countingConfig(base *rest.Config) (*rest.Config, *byteCounter) {
	bc := &byteCounter{}
	cfg := rest.CopyConfig(base)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			bc.requests.Add(1)
			if req.ContentLength > 0 {
				bc.sent.Add(req.ContentLength)
			}
			resp, err := rt.RoundTrip(req)
			if err == nil {
				resp.Body = &countingBody{ReadCloser: resp.Body, n: &bc.received}
			}
			return resp, err
		})
	})
	return cfg, bc
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
}
