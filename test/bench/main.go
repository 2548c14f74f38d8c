// Command bench measures the aggregator against a real API server (envtest).
//
// The default scenario, counts: 200 parents with 50 pods each, a burst of
// 5,000 pod changes (time to convergence, applies sent per change), then a
// steady 200 changes/s (p50 and p99 latency from a pod change to the
// parent's status showing it). The baseline, measured in the same run, is
// the latency with which the API server delivers the pod change itself to a
// watcher.
//
// The scenario sweep: the backfill sweep's time and bytes over 10,000
// cluster pods, against a plain paginated List of the same pods.
//
// Both are run by `make bench`, as are webhook and totals.
//
// The scenario webhook: admissions over TLS by bin/webhook and by the
// conventional controller-runtime webhook, each on one core, at rising
// concurrency; then pod creates and label-only updates through the API
// server, alternating: no webhook, tally's registration before and after its
// would-change-or-refuse condition, for pods stamped by their operator and
// not.
//
// The scenario totals: the API requests the cumulative totals add per
// finished pod (pod patches, status applies, lists of a parent's pods),
// against the same pods finishing under the four counts only, in bursts of
// 100 and one at a time.
//
// The scenario uninstall: what the chart's uninstall hook does once tally
// is stopped, `kubectl tally finalizers remove -A` over 10,000 pods
// carrying the tracking finalizer, against 500 released at the previous
// settings (5 requests a second, one pod at a time).
//
// The scenario install: a fresh install into a cluster of unstamped pods
// (namespaces × parents-per-namespace × pods; 30,000 in `make bench`,
// 150,000 in `make bench-scale`): time until every parent shows its true
// counts, against the time until every pod is stamped (when the counts
// waited for the stamps), and the API requests spent.
//
// The scenario scale (`make bench-scale`, not part of `make bench`): 150,000
// pods at Kubernetes' limits (50 namespaces × 30 parents × 100 pods), counted
// by tally's aggregator (with protobuf, then JSON) and by the conventional
// controller of test/bench/conventional, each as its own process: time to
// every parent right, RSS, CPU, and a burst of changes to 10% of the pods.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"syscall"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

const ns = "bench"

func main() {
	parents := flag.Int("parents", 200, "parents")
	podsPer := flag.Int("pods", 50, "pods per parent (scale: 100)")
	burst := flag.Int("burst", 5000, "pod changes in the burst")
	rate := flag.Int("rate", 200, "pod changes per second in the steady phase")
	steady := flag.Duration("steady", 20*time.Second, "length of the steady phase")
	scenario := flag.String("scenario", "counts", "counts, sweep, scale, install, totals, uninstall, or webhook")
	step := flag.Duration("step", 3*time.Second, "webhook: length of each load step over TLS")
	var api apiRounds
	flag.DurationVar(&api.round, "api-round", 10*time.Second, "webhook: length of each round of pod creates through the API server")
	flag.IntVar(&api.rounds, "api-rounds", 4, "webhook: rounds of each case through the API server")
	flag.StringVar(&api.workloads, "api-workloads", "", "webhook: run only the workloads through the API server whose name contains this (e.g. \"creates\")")
	flag.StringVar(&api.clients, "api-clients", "10,50", "webhook: the numbers of clients through the API server, comma-separated")
	flag.StringVar(&api.cases, "api-cases", "", "webhook: run, beside the case without a webhook, only the cases whose name contains this (e.g. \"stamped by their operator\")")
	tlsSteps := flag.Bool("tls-steps", true, "webhook: measure the admissions over TLS before the rounds through the API server")
	namespaces := flag.Int("namespaces", 50, "scale: namespaces")
	parentsPerNS := flag.Int("parents-per-namespace", 30, "scale: parents per namespace")
	total := flag.Int("total", 10_000, "sweep: pods in the cluster; uninstall: pods carrying the tracking finalizer")
	tracked := flag.Int("tracked", 1_000, "sweep: pods of a tracked kind among them, unlabelled")
	bigParent := flag.Int("big-parent", 5_000, "totals: pods of the big parent")
	only := flag.String("only", "", "scale: run only the contenders whose name contains this (e.g. \"custom counts\")")
	tallyOnly := flag.Bool("tally-only", false, "scale: leave out the conventional controller (at 150,000 pods its cache of whole pods takes the API server down on a 24 GiB machine)")
	countsOnly := flag.Bool("counts-only", false, "install: stop once every parent is right, without waiting for the stamps")
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(zapcore.ErrorLevel)))
	ctx, interrupted := process.Interruptible()
	err := withControlPlane(ctx, func(ctx context.Context, env *framework.Env) error {
		switch *scenario {
		case "counts":
			return run(ctx, env, *parents, *podsPer, *burst, *rate, *steady)
		case "sweep":
			return runSweep(ctx, env, *total, *tracked)
		case "webhook":
			return runWebhook(ctx, env, *step, *tlsSteps, api)
		case "scale":
			return runScale(ctx, env, *namespaces, *parentsPerNS, *podsPer, *tallyOnly, *only)
		case "install":
			return runInstall(ctx, env, *namespaces, *parentsPerNS, *podsPer, *countsOnly)
		case "totals":
			return runTotals(ctx, env, 20, 50, 100, *bigParent)
		case "uninstall":
			return runUninstall(ctx, env, *total, 500)
		}
		return fmt.Errorf("unknown scenario %q", *scenario)
	})
	if sig := interrupted(); sig != nil {
		// As `make demo` does: what the bench started is stopped by now,
		// and the exit status is the shell's for a command ended by sig.
		fmt.Fprintf(os.Stderr, "bench: %s: the scenario was interrupted; everything the bench started has been stopped\n", sig)
		os.Exit(128 + int(sig.(syscall.Signal)))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// scenarioGrace is how long withControlPlane waits, once ctx ends, for the
// scenario to stop what it started (its processes get 15 s each to exit on
// SIGTERM) before it stops the control plane all the same.
const scenarioGrace = 40 * time.Second

// withControlPlane runs f on a new control plane with the bench namespace,
// then stops the control plane, also when ctx ends first: f is given
// scenarioGrace to return, and whatever it still runs then (its child
// processes die with the bench, their parent) is left to the exit that
// follows. kube-apiserver and etcd run in process groups of their own, so
// an interrupt reaches them only this way; each gets 10 s to exit on
// SIGTERM, then SIGKILL, and dies with the bench if it ends first
// (internal/controlplane).
func withControlPlane(ctx context.Context, f func(context.Context, *framework.Env) error) error {
	env, err := framework.Start(controlplane.Options{EtcdQuotaBytes: 8 << 30})
	if err != nil {
		return err
	}
	defer func() {
		if err := env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "bench: stopping the control plane:", err)
		}
	}()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- f(ctx, env) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	fmt.Fprintln(os.Stderr, "bench: interrupted: stopping the scenario's processes, then the control plane")
	select {
	case <-done:
	case <-time.After(scenarioGrace):
		fmt.Fprintf(os.Stderr, "bench: the scenario did not return within %s of the interrupt; stopping the control plane\n", scenarioGrace)
	}
	return ctx.Err()
}

type parent struct {
	name string
	uid  types.UID
	pods []*corev1.Pod
}

func run(ctx context.Context, env *framework.Env, nParents, podsPer, burst, rate int, steady time.Duration) error {
	c := env.Client

	start := time.Now()
	parents := make([]*parent, nParents)
	var creates []func() error
	for i := range parents {
		p := &parent{name: fmt.Sprintf("pool-%03d", i)}
		pool := operator.Pool(ns, p.name, int64(podsPer))
		if err := c.Create(ctx, pool); err != nil {
			return err
		}
		p.uid = pool.GetUID()
		for j := range podsPer {
			pod := builder.Pod(ns, fmt.Sprintf("%s-%02d", p.name, j)).ControlledBy(operator.GVK, p.name, p.uid).Label(keys.ParentUID, string(p.uid)).Build()
			p.pods = append(p.pods, pod)
			creates = append(creates, func() error { return c.Create(ctx, pod) })
		}
		parents[i] = p
	}
	if err := parallel(16, creates); err != nil {
		return err
	}
	fmt.Printf("created %d parents with %d pods each in %s\n", nParents, podsPer, time.Since(start).Round(time.Millisecond))

	aggCtx, stopAgg := context.WithCancel(ctx)
	aggDone := make(chan error, 1)
	go func() {
		aggDone <- app.Run(aggCtx, &config.Config{Parents: []config.Parent{{
			Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool",
			Counts: map[config.Count]string{config.Completing: "status.completing", config.Active: "status.active", config.Completed: "status.completed"},
		}}}, env.Config, app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4})
	}()
	defer func() { stopAgg(); <-aggDone }()

	start = time.Now()
	if err := waitAll(ctx, c, parents, func(u *unstructured.Unstructured) bool { return field(u, "active") == int64(podsPer) }); err != nil {
		return err
	}
	fmt.Printf("initial convergence of %d parents: %s\n", nParents, time.Since(start).Round(time.Millisecond))

	// Burst: mark burst/nParents pods of every parent.
	perParent := burst / nParents
	var marks []func() error
	for k := range perParent {
		for _, p := range parents {
			pod := p.pods[k]
			marks = append(marks, func() error { return mark(ctx, c, pod) })
		}
	}
	applied0 := applies()
	start = time.Now()
	if err := parallel(16, marks); err != nil {
		return err
	}
	sent := time.Since(start)
	if err := waitAll(ctx, c, parents, func(u *unstructured.Unstructured) bool { return field(u, "completing") == int64(perParent) }); err != nil {
		return err
	}
	converged := time.Since(start)
	appliesSent := applies() - applied0
	fmt.Printf("burst of %d pod changes: sent in %s, converged %s after the first change (%s after the last)\n",
		len(marks), sent.Round(time.Millisecond), converged.Round(time.Millisecond), (converged - sent).Round(time.Millisecond))
	fmt.Printf("applies sent: %.0f, %.3f per pod change (baseline, a counter written per change: 1.000)\n",
		appliesSent, appliesSent/float64(len(marks)))

	// Steady: rate changes/s round-robin over the parents; each change moves
	// one marked pod to Succeeded, so status.completed grows by one.
	lat, base, err := steadyPhase(ctx, env, parents, perParent, rate, steady)
	if err != nil {
		return err
	}
	fmt.Printf("steady %d changes/s for %s: %d changes\n", rate, steady, len(lat))
	fmt.Printf("  change -> parent status shows it (tally): p50 %s  p99 %s\n", pct(lat, 50), pct(lat, 99))
	fmt.Printf("  change -> pod watch delivers it (baseline): p50 %s  p99 %s\n", pct(base, 50), pct(base, 99))
	fmt.Printf("  ratio tally/baseline: p50 %.1fx  p99 %.1fx\n",
		float64(pct(lat, 50))/float64(pct(base, 50)), float64(pct(lat, 99))/float64(pct(base, 99)))
	return nil
}
