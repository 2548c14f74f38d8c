// Package outage cuts the aggregator off the API server (through a TCP proxy
// the test controls) and checks that the stale window is visible: the
// gauge tally_aggregator_pod_watch_stale_seconds grows while the pod watch
// is not delivering, a log line says so when it breaks and when it recovers,
// and the counts converge once the connection is back.
package outage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env  *framework.Env
	logs syncBuffer
)

func TestMain(m *testing.M) {
	ctrl.SetLogger(zap.New(zap.WriteTo(io.MultiWriter(os.Stderr, &logs))))
	os.Exit(framework.Main(m, controlplane.Options{}, &env))
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func staleSeconds(t *testing.T) float64 { return gauge(t, "tally_aggregator_pod_watch_stale_seconds") }

// waiting reads tally_aggregator_oldest_unprocessed_change_seconds.
func waiting(t *testing.T) float64 {
	return gauge(t, "tally_aggregator_oldest_unprocessed_change_seconds")
}

// gauge reads the process's gauge name (one series).
func gauge(t *testing.T, name string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no " + name)
	return 0
}

func completing(t *testing.T, ns string) int64 {
	t.Helper()
	v, err := env.StatusCount(context.Background(), operator.GVK, ns, "pool", "status", "completing")
	require.NoError(t, err)
	return v
}

func TestStaleWindowIsVisible(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "outage")
	require.NoError(t, err)
	pool := operator.Pool(ns, "pool", 6)
	require.NoError(t, env.Client.Create(ctx, pool))
	var pods []*builder.PodBuilder
	for i := range 6 {
		pods = append(pods, builder.Pod(ns, fmt.Sprintf("pool-%d", i)).ControlledBy(operator.GVK, "pool", pool.GetUID()).
			Label(keys.ParentUID, string(pool.GetUID())))
	}
	for _, b := range pods {
		require.NoError(t, env.Client.Create(ctx, b.Build()))
	}

	p, cfg := proxied(t)
	run(t, cfg, app.Options{MaxConcurrentReconciles: 2})
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 30*time.Second, 50*time.Millisecond)
	require.Zero(t, staleSeconds(t))

	p.CutOff()
	cut := time.Now()
	for _, b := range pods[:3] {
		pod := b.Build()
		require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pod), pod))
		pod.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
		require.NoError(t, env.Client.Update(ctx, pod))
	}
	require.Eventually(t, func() bool { return staleSeconds(t) >= 3 }, 20*time.Second, 100*time.Millisecond,
		"the gauge does not show the pod watch as stale")
	assert.Equal(t, int64(0), completing(t, ns), "the status cannot have followed the pods while cut off")
	time.Sleep(5 * time.Second)
	outage := time.Since(cut)

	p.Restore()
	restored := time.Now()
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 60*time.Second, 50*time.Millisecond)
	converged := time.Since(restored)
	require.Eventually(t, func() bool { return staleSeconds(t) == 0 }, 30*time.Second, 50*time.Millisecond)
	t.Logf("cut off for %.1fs; counts right %.2fs after the connection came back", outage.Seconds(), converged.Seconds())
	assert.Contains(t, logs.String(), "Pod watch interrupted")
	assert.Contains(t, logs.String(), "Pod watch delivering again")
}

// proxied returns a proxy to the API server and a config that reaches the
// API server through it.
func proxied(t *testing.T) (*framework.Proxy, *rest.Config) {
	t.Helper()
	host, err := url.Parse(env.Config.Host)
	require.NoError(t, err)
	p, err := framework.NewProxy(host.Host)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	cfg := rest.CopyConfig(env.Config)
	cfg.Host = "https://" + p.Addr()
	cfg.ServerName = host.Hostname()
	return p, cfg
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// watchCompleting records every value of a pool's status.completing, as
// watched.
func watchCompleting(t *testing.T, ns string) func() []int64 {
	t.Helper()
	dyn, err := dynamic.NewForConfig(env.Config)
	require.NoError(t, err)
	w, err := dyn.Resource(operator.GVK.GroupVersion().WithResource("workerpools")).Namespace(ns).Watch(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	var mu sync.Mutex
	var seen []int64
	go func() {
		for ev := range w.ResultChan() {
			if u, ok := ev.Object.(*unstructured.Unstructured); ok {
				v, found, _ := unstructured.NestedInt64(u.Object, "status", "completing")
				if found {
					mu.Lock()
					seen = append(seen, v)
					mu.Unlock()
				}
			}
		}
	}()
	return func() []int64 {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

// createPool creates a pool of n stamped pods in a new namespace.
func createPool(t *testing.T, n int) (string, []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "outage")
	require.NoError(t, err)
	pool := operator.Pool(ns, "pool", int64(n))
	require.NoError(t, env.Client.Create(ctx, pool))
	var pods []*corev1.Pod
	for i := range n {
		pod := builder.Pod(ns, fmt.Sprintf("pool-%d", i)).ControlledBy(operator.GVK, "pool", pool.GetUID()).
			Label(keys.ParentUID, string(pool.GetUID())).Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		pods = append(pods, pod)
	}
	return ns, pods
}

func markIntent(t *testing.T, pods []*corev1.Pod) {
	t.Helper()
	patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"`+keys.CompletionIntent+`":"scale-down"}}}`))
	for _, p := range pods {
		require.NoError(t, env.Client.Patch(context.Background(), p.DeepCopy(), patch))
	}
}

var workerPools = &config.Config{Parents: []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: config.DefaultCounts}}}

// runBehindABreaker creates a pool of 6 pods and runs the aggregator with
// its requests through a WatchBreaker, until its counts are written; it
// returns the pool's namespace, its pods, the breaker, and the values its
// status.completing took from then on.
func runBehindABreaker(t *testing.T) (string, []*corev1.Pod, *framework.WatchBreaker, func() []int64) {
	t.Helper()
	ns, pods := createPool(t, 6)
	cfg := rest.CopyConfig(env.Config)
	breaker := &framework.WatchBreaker{}
	breaker.Wrap(cfg)
	run(t, cfg, app.Options{MaxConcurrentReconciles: 2})
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 30*time.Second, 50*time.Millisecond)
	return ns, pods, breaker, watchCompleting(t, ns)
}

// TestNoWriteFromAStaleView: while the pod watch is broken and the API
// server answers everything else, a parent event (someone overwrites the
// status) is not answered with counts from the stale pods; once the watch
// delivers again, the counts are written right, by themselves.
func TestNoWriteFromAStaleView(t *testing.T) {
	ns, pods, breaker, seen := runBehindABreaker(t)

	cost := barrierCost(t)
	breaker.Set(true)
	require.Eventually(t, func() bool { return staleSeconds(t) > 0 }, 10*time.Second, 50*time.Millisecond, "the broken pod watch is not noticed")
	markIntent(t, pods[:3])
	// From the stale pods the aggregator would write completing: 0 over it.
	overwrite(t, ns)
	time.Sleep(4 * time.Second)
	assert.Equal(t, int64(99), completing(t, ns), "written from a pod view known to be stale")

	breaker.Set(false)
	restored := time.Now()
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 30*time.Second, 50*time.Millisecond)
	t.Logf("pod watch broken %s; counts right %s after it could deliver again; %s", 4*time.Second, time.Since(restored).Round(10*time.Millisecond), barrierCost(t).since(cost))
	noStaleWriteAfterOverwrite(t, seen(), 0, "a stale count")
}

// TestNoWriteUntilTheRelistIsDelivered: after a cut long enough that the
// pod watch cannot resume (410 Gone), the relist is answered at once but
// its events come 8 s later (client-go gives a watch-list stream 10 s to
// send its first event). A parent event meanwhile is not answered with
// counts from the pods as they were before the cut: the view is fresh only
// once the relist is in the cache, not on its response's headers.
func TestNoWriteUntilTheRelistIsDelivered(t *testing.T) {
	ns, pods, breaker, seen := runBehindABreaker(t)

	breaker.Set(true)
	require.Eventually(t, func() bool { return staleSeconds(t) > 0 }, 10*time.Second, 50*time.Millisecond, "the broken pod watch is not noticed")
	markIntent(t, pods[:3])
	const delay = 8 * time.Second
	breaker.SlowRelists(delay)
	breaker.Set(false)
	reconnected := time.Now()
	time.Sleep(2 * time.Second)
	// A parent event while the relist's events are on their way.
	overwrite(t, ns)
	time.Sleep(4 * time.Second)
	assert.Equal(t, int64(99), completing(t, ns), "written from the pods as they were before the cut, before the relist was delivered")
	assert.Positive(t, staleSeconds(t), "the view counts as fresh before the relist was delivered")

	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, delay+30*time.Second, 50*time.Millisecond)
	t.Logf("relist answered at once, its events %s later: counts right %s after the reconnection", delay, time.Since(reconnected).Round(10*time.Millisecond))
	noStaleWriteAfterOverwrite(t, seen(), 0, "a count from before the cut")
}

// TestNoWriteBeforeAResumedWatchIsDelivered: the pod watch ends as the
// API server ends a watch, so client-go resumes it from its last
// resourceVersion; the resumed watch is answered at once but its replay
// comes 3 s later. Three intents are set, and 1.2 s later the watch ends
// and resumes again, its replay (which holds them) 3 s late again. A parent event 1.5 s
// after the reconnection is not answered with counts from the view of
// before: the view is fresh only once the cache holds a version read after
// the break, not after the watch stayed open a while.
func TestNoWriteBeforeAResumedWatchIsDelivered(t *testing.T) {
	ns, pods, breaker, seen := runBehindABreaker(t)

	const delay = 3 * time.Second
	breaker.SlowResumes(delay)
	breaker.EndWatches()
	markIntent(t, pods[:3])
	// client-go relists after a watch that ended within a second with
	// nothing delivered.
	time.Sleep(1200 * time.Millisecond)
	breaker.EndWatches()
	reconnected := time.Now()
	time.Sleep(time.Until(reconnected.Add(delay / 2)))
	// A parent event while the replay is on its way.
	overwrite(t, ns)
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 30*time.Second, 50*time.Millisecond)
	t.Logf("resumed watch answered at once, its replay %s later: counts right %s after the reconnection", delay, time.Since(reconnected).Round(10*time.Millisecond))
	noStaleWriteAfterOverwrite(t, seen(), 0, "a count from before the break")
}

// TestRecoversInSeconds: the API server unreachable (a cut proxy: every
// connection closed, new ones refused) for 5 s and for 40 s, with leader
// election (the 40 s outage costs the lease): the aggregator never exits,
// and its counts are right within seconds of the API server's return.
// Under -short (make test) only the 5 s outage.
func TestRecoversInSeconds(t *testing.T) {
	ctx := context.Background()
	p, cfg := proxied(t)
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	exited := runElected(t, cfg, leaseNS)

	outages := []time.Duration{5 * time.Second, 40 * time.Second}
	if testing.Short() {
		outages = outages[:1]
	}
	for _, outage := range outages {
		ns, pods := createPool(t, 6)
		require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 60*time.Second, 50*time.Millisecond)
		p.CutOff()
		markIntent(t, pods[:4])
		time.Sleep(outage)
		require.False(t, exited(), "the aggregator exited during a %s outage", outage)
		p.Restore()
		restored := time.Now()
		require.Eventually(t, func() bool { return completing(t, ns) == 4 }, 15*time.Second, 50*time.Millisecond,
			"counts not right 15 s after a %s outage", outage)
		t.Logf("API server away %s: counts right %s after it answered again", outage, time.Since(restored).Round(10*time.Millisecond))
	}
}

// runElected starts app.Run with leader election on cfg and returns a func
// that reports whether it returned.
func runElected(t *testing.T, cfg *rest.Config, leaseNS string) func() bool {
	t.Helper()
	return run(t, cfg, app.Options{MaxConcurrentReconciles: 2, LeaderElect: true, LeaderElectionNamespace: leaseNS, LeaderElectionID: "outage"})
}

// run starts app.Run on cfg for the WorkerPool kind with opts (no metrics
// or probe endpoint), stopped when the test ends, and returns a func that
// reports whether it returned.
func run(t *testing.T, cfg *rest.Config, opts app.Options) func() bool {
	t.Helper()
	opts.MetricsAddr, opts.ProbeAddr = "0", "0"
	ctx, stop := context.WithCancel(context.Background())
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_ = app.Run(ctx, workerPools, cfg, opts)
	}()
	t.Cleanup(func() {
		stop()
		<-finished
	})
	return func() bool {
		select {
		case <-finished:
			return true
		default:
			return false
		}
	}
}

// overwrite is a parent event: someone sets the pool's status.completing
// to 99, which a count from a stale view would overwrite.
func overwrite(t *testing.T, ns string) {
	t.Helper()
	ctx := context.Background()
	pool := operator.Pool(ns, "pool", 6)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pool), pool))
	require.NoError(t, unstructured.SetNestedField(pool.Object, int64(99), "status", "completing"))
	require.NoError(t, env.Client.Status().Update(ctx, pool))
}

// noStaleWriteAfterOverwrite asserts that, of the values the pool's
// status.completing took, none after overwrite's 99 is stale's.
func noStaleWriteAfterOverwrite(t *testing.T, values []int64, stale int64, what string) {
	t.Helper()
	i := slices.Index(values, 99)
	require.GreaterOrEqual(t, i, 0, "%v", values)
	assert.NotContains(t, values[i:], stale, "%s was written after the parent event: %v", what, values)
}

// TestTwoReplicasRecoverInSeconds: two replicas, the API server unreachable
// for 30 s: neither exits, and the counts are right within seconds of its
// return (client-go's leader election lets a replica take a lease whose
// record did not change during the outage at once, and the leader keeps
// its identity across its in-process restarts).
func TestTwoReplicasRecoverInSeconds(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	p, cfg := proxied(t)
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	exitedA := runElected(t, cfg, leaseNS)
	exitedB := runElected(t, cfg, leaseNS)

	ns, pods := createPool(t, 6)
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 60*time.Second, 50*time.Millisecond)
	p.CutOff()
	markIntent(t, pods[:2])
	time.Sleep(30 * time.Second)
	require.False(t, exitedA() || exitedB(), "a replica exited during the outage")
	p.Restore()
	restored := time.Now()
	require.Eventually(t, func() bool { return completing(t, ns) == 2 }, 15*time.Second, 50*time.Millisecond,
		"counts not right 15 s after a 30 s outage with two replicas")
	t.Logf("two replicas, API server away 30s: counts right %s after it answered again", time.Since(restored).Round(10*time.Millisecond))
}

// TestLeaderWithAStaleViewGivesWay: the leader's pod watch breaks while the
// API server answers: it writes nothing from its stale view, gives the lease
// up after 10 s, and the standby, whose view is fresh, writes the counts.
func TestLeaderWithAStaleViewGivesWay(t *testing.T) {
	ctx := context.Background()
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	ns, pods := createPool(t, 6)
	leaderCfg := rest.CopyConfig(env.Config)
	var breaker framework.WatchBreaker
	breaker.Wrap(leaderCfg)
	runElected(t, leaderCfg, leaseNS)
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 60*time.Second, 50*time.Millisecond, "the first replica never led")
	runElected(t, rest.CopyConfig(env.Config), leaseNS)
	time.Sleep(3 * time.Second) // the standby's caches sync

	breaker.Set(true)
	broken := time.Now()
	markIntent(t, pods[:3])
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 60*time.Second, 100*time.Millisecond,
		"the standby never took over from a leader with a stale view")
	t.Logf("leader's pod watch broken: counts right %s later, written by the standby", time.Since(broken).Round(100*time.Millisecond))
	assert.Contains(t, logs.String(), "giving up the lease")
	breaker.Set(false)
}

// TestThrottlingIsNotAnOutage: with two replicas, the API server throttles
// every pod list and watch (429 with Retry-After) for 60 s while it answers
// everything else: the lease holder does not change (every replica is
// throttled alike, so none could do better), nothing is written from the
// view of before, and once the throttling ends the counts are right within
// seconds of the first pod list or watch answered.
func TestThrottlingIsNotAnOutage(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	ns, pods := createPool(t, 6)
	var throttler framework.WatchBreaker
	cfgA, cfgB := rest.CopyConfig(env.Config), rest.CopyConfig(env.Config)
	throttler.Wrap(cfgA)
	throttler.Wrap(cfgB)
	runElected(t, cfgA, leaseNS)
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 60*time.Second, 50*time.Millisecond, "the first replica never led")
	runElected(t, cfgB, leaseNS)
	time.Sleep(3 * time.Second) // the standby's caches sync
	holder := func() string {
		var lease coordinationv1.Lease
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: leaseNS, Name: "outage"}, &lease))
		return ptr.Deref(lease.Spec.HolderIdentity, "")
	}
	leader := holder()
	require.NotEmpty(t, leader)
	seen := watchCompleting(t, ns)

	throttler.Throttle(true)
	markIntent(t, pods[:3])
	overwrite(t, ns)
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
		require.Equal(t, leader, holder(), "the lease changed hands while every replica was throttled alike")
	}
	assert.Equal(t, int64(99), completing(t, ns), "written from the pods as they were before the throttling")

	throttler.Throttle(false)
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 30*time.Second, 50*time.Millisecond)
	right := time.Now()
	first := throttler.FirstAnswer()
	require.False(t, first.IsZero())
	t.Logf("pod list and watch throttled 60s, two replicas: the lease stayed with %s; counts right %s after the first pod list or watch answered", leader, right.Sub(first).Round(10*time.Millisecond))
	assert.Less(t, right.Sub(first), 15*time.Second, "a generous bound: the issue's target is 5 s")
	assert.Equal(t, leader, holder())
	noStaleWriteAfterOverwrite(t, seen(), 0, "a count from before the throttling")
}

// TestADeposedLeadersChangesAreNotWaiting: the leader, its one worker held
// by a status write that does not return, sees a change to a second parent
// that it cannot pick up; then it loses the lease to another holder and
// starts again as a standby. The change went with the manager that saw
// it: tally_aggregator_oldest_unprocessed_change_seconds reads 0, as it
// would on any standby, instead of growing for good.
func TestADeposedLeadersChangesAreNotWaiting(t *testing.T) {
	ctx := context.Background()
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	nsA, podsA := createPool(t, 3)
	nsB, podsB := createPool(t, 3)
	cfg := rest.CopyConfig(env.Config)
	var holdStatus, failLeases atomic.Bool
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			switch {
			case failLeases.Load() && strings.Contains(req.URL.Path, "/leases"):
				return nil, errors.New("leases unreachable (the test)")
			case holdStatus.Load() && req.Method == http.MethodPatch && strings.HasSuffix(req.URL.Path, "/status"):
				<-req.Context().Done() // a write that does not return
				return nil, req.Context().Err()
			}
			return rt.RoundTrip(req)
		})
	})
	run(t, cfg, app.Options{MaxConcurrentReconciles: 1, LeaderElect: true, LeaderElectionNamespace: leaseNS, LeaderElectionID: "deposed"})
	require.Eventually(t, func() bool { return completing(t, nsA) == 0 && completing(t, nsB) == 0 }, 60*time.Second, 50*time.Millisecond)

	holdStatus.Store(true)
	markIntent(t, podsA[:1]) // its reconcile's write holds the one worker
	time.Sleep(time.Second)
	markIntent(t, podsB[:1]) // seen, not picked up
	require.Eventually(t, func() bool { return waiting(t) >= 2 }, 20*time.Second, 100*time.Millisecond, "the second change is not waiting")

	// Deposed: its renewals fail, and another holder takes the lease and
	// keeps it.
	mark := len(logs.String())
	failLeases.Store(true)
	intruder := func() {
		var lease coordinationv1.Lease
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: leaseNS, Name: "deposed"}, &lease); err != nil {
			return
		}
		lease.Spec.HolderIdentity = ptr.To("another-replica")
		lease.Spec.LeaseDurationSeconds = ptr.To(int32(60))
		lease.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
		_ = env.Client.Update(ctx, &lease)
	}
	intruder()
	keep, stopKeeping := context.WithCancel(ctx)
	defer stopKeeping()
	go func() {
		for keep.Err() == nil {
			time.Sleep(2 * time.Second)
			intruder()
		}
	}()
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String()[mark:], "Aggregator stopped; starting again in this process")
	},
		60*time.Second, 200*time.Millisecond, "the leader was not deposed")
	failLeases.Store(false)
	holdStatus.Store(false)
	require.Eventually(t, func() bool { return waiting(t) == 0 }, 60*time.Second, 200*time.Millisecond,
		"a change the deposed leader saw is reported as waiting on the standby it became: %.0f s", waiting(t))
	time.Sleep(3 * time.Second)
	assert.Zero(t, waiting(t), "the standby reports a change waiting")
}

// counter reads the process's counter name, summed over its series that
// carry every one of values.
// barriers is what the pod view's barriers did and cost: by result, the
// requests they sent, and the seconds from their doubts to their proofs.
type barriers struct{ proved, superseded, failed, requests, seconds float64 }

func barrierCost(t *testing.T) barriers {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	var b barriers
	for _, f := range families {
		if f.GetName() == "tally_aggregator_pod_view_barrier_seconds" {
			b.seconds = f.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	b.proved = counter(t, "tally_aggregator_pod_view_barriers_total", "proved")
	b.superseded = counter(t, "tally_aggregator_pod_view_barriers_total", "superseded")
	b.failed = counter(t, "tally_aggregator_pod_view_barriers_total", "error")
	b.requests = counter(t, "tally_aggregator_pod_view_barrier_requests_total")
	return b
}

// since says what the barriers did since before.
func (b barriers) since(before barriers) string {
	proved := b.proved - before.proved
	mean := 0.0
	if proved > 0 {
		mean = (b.seconds - before.seconds) / proved
	}
	return fmt.Sprintf("barriers: %.0f proved (%.2f s each), %.0f superseded, %.0f failed, %.0f requests",
		proved, mean, b.superseded-before.superseded, b.failed-before.failed, b.requests-before.requests)
}

func counter(t *testing.T, name string, values ...string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for _, v := range values {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetValue() == v }) {
					continue series
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestRecoversFromAnAPIServerRestart: kube-apiserver restarted (killed,
// started again 2 s later) under an aggregator without leader election, five
// times, each time under a newly started aggregator; right after its
// return, two pods of each of three pools are marked, a moment apart. Every
// pool's counts are exact within 5 s of the API server's return, every
// time, with few 409 answers: each parent view comes back as fast as the
// pod view, and an apply that meets a version its cache does not show yet
// is retried at once on the parent read from the API server.
//
// One aggregator per restart: after a restart each informer's resumed
// watch is answered "too old resource version", and client-go's reflector
// relists only after its back-off, which doubles with each such answer
// until two quiet minutes pass (0.8 s, then up to 30 s); restarts a few
// seconds apart under one aggregator measure that, not tally.
func TestRecoversFromAnAPIServerRestart(t *testing.T) {
	const pools, runs, perRun = 3, 5, 2
	nss := make([]string, pools)
	podsOf := make([][]*corev1.Pod, pools)
	for i := range pools {
		nss[i], podsOf[i] = createPool(t, runs*perRun)
	}
	exact := func(want int64) func() bool {
		return func() bool {
			for _, ns := range nss {
				if completing(t, ns) != want {
					return false
				}
			}
			return true
		}
	}
	for r := range runs {
		t.Run(fmt.Sprintf("restart %d", r+1), func(t *testing.T) {
			sweeps := counter(t, "tally_aggregator_backfill_sweeps_total", "complete")
			exited := run(t, env.Config, app.Options{MaxConcurrentReconciles: 2})
			// Running: its start-up sweep has read every pod (the counts
			// shown are the previous aggregator's).
			require.Eventually(t, func() bool { return counter(t, "tally_aggregator_backfill_sweeps_total", "complete") > sweeps },
				60*time.Second, 50*time.Millisecond)
			require.Eventually(t, exact(int64(r*perRun)), 60*time.Second, 50*time.Millisecond)
			conflicts := counter(t, "tally_aggregator_apply_conflicts_total")
			cost := barrierCost(t)
			require.NoError(t, env.RestartAPIServer(2*time.Second))
			returned := time.Now()
			for k := range perRun {
				for i := range pools {
					markIntent(t, podsOf[i][r*perRun+k:r*perRun+k+1])
				}
				time.Sleep(300 * time.Millisecond)
			}
			want := int64((r + 1) * perRun)
			if !assert.Eventually(t, exact(want), 5*time.Second, 20*time.Millisecond) {
				require.Eventually(t, exact(want), time.Minute, 20*time.Millisecond)
				t.Fatalf("not every pool showed completing %d within 5 s of the API server's return, but %s after it, with %v conflicts",
					want, time.Since(returned).Round(10*time.Millisecond), counter(t, "tally_aggregator_apply_conflicts_total")-conflicts)
			}
			took := time.Since(returned)
			conflicted := counter(t, "tally_aggregator_apply_conflicts_total") - conflicts
			t.Logf("every pool exact %s after the API server returned; %v conflicts; %s", took.Round(10*time.Millisecond), conflicted, barrierCost(t).since(cost))
			assert.LessOrEqual(t, conflicted, float64(pools*perRun), "409 answers: at most one for each pod marked")
			require.False(t, exited(), "the aggregator exited")
		})
	}
}

// runBehindAParentBreaker creates a pool of n pods and runs the aggregator
// with the pools' list and watch through a WatchBreaker, until its counts
// are written; it returns the pool's namespace, its pods and the breaker.
func runBehindAParentBreaker(t *testing.T, n int) (string, []*corev1.Pod, *framework.WatchBreaker) {
	t.Helper()
	ns, pods := createPool(t, n)
	cfg := rest.CopyConfig(env.Config)
	breaker := &framework.WatchBreaker{Path: "/apis/example.tally.dev/v1/workerpools"}
	breaker.Wrap(cfg)
	run(t, cfg, app.Options{MaxConcurrentReconciles: 2})
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 60*time.Second, 50*time.Millisecond)
	return ns, pods, breaker
}

// TestAParentCacheBehindIsReadLive: the parents' watch broken while
// everything else answers, so the parent cache keeps the version it had;
// pods change one after another, and each change is written at once: the
// cache showing a version older than the aggregator's last write, the
// parent is read from the API server, with no conflict and no wait for
// the cache.
func TestAParentCacheBehindIsReadLive(t *testing.T) {
	ns, pods, breaker := runBehindAParentBreaker(t, 6)
	breaker.Set(true)
	var conflicts, liveReads float64
	for i, p := range pods[:4] {
		markIntent(t, []*corev1.Pod{p})
		require.Eventually(t, func() bool { return completing(t, ns) == int64(i+1) }, 5*time.Second, 20*time.Millisecond,
			"pod %d's intent not counted while the parent cache lags", i+1)
		if i == 0 {
			// From here the cache is behind the pool's last write.
			conflicts = counter(t, "tally_aggregator_apply_conflicts_total")
			liveReads = counter(t, "tally_aggregator_parent_live_reads_total")
		}
	}
	conflicted := counter(t, "tally_aggregator_apply_conflicts_total") - conflicts
	readLive := counter(t, "tally_aggregator_parent_live_reads_total") - liveReads
	t.Logf("3 pods marked while the parent cache lagged behind the last write: %v conflicts, %v live reads", conflicted, readLive)
	assert.Zero(t, conflicted, "409 answers: the cache shows a version older than the aggregator's last write, so the parent is read live")
	assert.GreaterOrEqual(t, readLive, 3.0, "the parent read from the API server for each write")
	breaker.Set(false)
}

// TestAStaleParentViewIsReadLive: the parents' views follow the pod view's
// rule. While the pool's watch is broken, another writer sets
// status.completing to 99, which the cache cannot show; a pod change that
// moves no count has the pool reconciled. The pool is read from the API
// server, since its view is not known fresh, and the count written again
// at once, not when the watch comes back. Once it is repaired, the pool is
// read from its cache again.
func TestAStaleParentViewIsReadLive(t *testing.T) {
	ns, pods, breaker := runBehindAParentBreaker(t, 3)
	breaker.Set(true)
	t.Cleanup(func() { breaker.Set(false) })
	overwrite(t, ns)
	// A change of a pod that moves no count: its parent is reconciled.
	patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"touched":"yes"}}}`))
	require.NoError(t, env.Client.Patch(context.Background(), pods[0].DeepCopy(), patch))
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 10*time.Second, 50*time.Millisecond,
		"the other writer's 99 stands while the pool's watch is broken: the pool was read from its stale cache, which shows the 0 already written")
	breaker.Set(false)
	// Fresh again: a reconcile reads the pool from its cache.
	touches := 0
	require.Eventually(t, func() bool {
		reconciled, readLive := counter(t, "tally_aggregator_reconciles_total"), counter(t, "tally_aggregator_parent_live_reads_total")
		touches++
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"labels":{"touched":"%d"}}}`, touches))
		require.NoError(t, env.Client.Patch(context.Background(), pods[1].DeepCopy(), patch))
		for deadline := time.Now().Add(5 * time.Second); counter(t, "tally_aggregator_reconciles_total") <= reconciled; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				return false
			}
		}
		return counter(t, "tally_aggregator_parent_live_reads_total") == readLive
	}, 30*time.Second, 200*time.Millisecond, "the pool still read from the API server once its watch was repaired")
}
