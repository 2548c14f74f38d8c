// Package robustness runs two aggregator replicas (leader election, a kind
// with totals) under a seeded random schedule of faults over a seeded
// churn of pods, on a real API server, and checks the specification's
// invariants on what the API server recorded: every status the pools took
// and every change to the pods, as watched, and the pods at the end. The faults: a replica cut off from
// the API server, its pod watch broken (up to 16 s: past the bound after
// which it starts a new manager), its pod lists and watches throttled
// (429), the replica stopped and started again, every replica stopped for
// a while (no leader while pods finish), a pool deleted and created again
// under its name, kube-apiserver killed and started again. A failing seed prints its schedule; `make
// robustness SEED=n` runs it again, `make robustness DURATION=2h` runs
// seeds one after another for that long.
package robustness

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/internal/truth"
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
	ctrl.SetLogger(zap.New(zap.WriteTo(&logs)))
	os.Exit(framework.Main(m, controlplane.Options{}, &env))
}

// leaseName names the replicas' Lease, in the run's namespace.
const leaseName = "robustness"

// The run's shape: how long faults and churn last, how many pools, and the
// bound within which, once both stop, every invariant must hold.
const (
	runFor = 40 * time.Second
	pools  = 3
	// settleBound is the stated bound: after the last fault, every pool's
	// counts equal a fresh List, its totals the pods that finished, its
	// ledger is empty and no pod keeps the tracking finalizer.
	settleBound = 60 * time.Second
)

// TestRobustness runs one seed ($TALLY_ROBUSTNESS_SEED), or random seeds
// one after another for $TALLY_ROBUSTNESS_DURATION (one seed when unset).
func TestRobustness(t *testing.T) {
	framework.Long(t)
	cfg, err := config.Load(repo.Path("examples", "workerpool", "config.yaml"))
	require.NoError(t, err)
	if s := os.Getenv("TALLY_ROBUSTNESS_SEED"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "TALLY_ROBUSTNESS_SEED")
		runSeed(t, cfg, seed)
		return
	}
	budget := time.Duration(0)
	if d := os.Getenv("TALLY_ROBUSTNESS_DURATION"); d != "" {
		budget, err = time.ParseDuration(d)
		require.NoError(t, err, "TALLY_ROBUSTNESS_DURATION")
	}
	start := time.Now()
	for n := 0; n == 0 || time.Since(start) < budget; n++ {
		if !runSeed(t, cfg, rand.Uint64()) {
			return
		}
	}
}

// runSeed runs one seed as a subtest and reports whether it passed.
func runSeed(t *testing.T, cfg *config.Config, seed uint64) bool {
	return t.Run(fmt.Sprintf("seed %d", seed), func(t *testing.T) {
		logs.Reset()
		r := newRun(t, cfg, seed)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("seed %d failed; run it again with: make robustness SEED=%d\nschedule:\n%s\naggregator log (end):\n%s",
					seed, seed, strings.Join(r.schedule(), "\n"), logs.Tail(60))
			}
		})
		r.churnAndFaults(t)
		r.check(t)
	})
}

// run is one seed's world: its pools, its two replicas, what was done.
type run struct {
	seed     uint64
	ns       string
	uids     map[string]types.UID
	replicas [2]*replica
	counts   *countsHistory
	// recreate asks the churn to delete a pool, with its live pods as the
	// garbage collector would, and create it again under its name.
	recreate chan string
	lost     float64

	mu    sync.Mutex
	lines []string
	// disruptive counts the faults that may move the lease: its holder
	// stopped, cut off, its view stale past the bound, the API server
	// restarted. Throttling is not one.
	disruptive int
	start      time.Time
	// live holds the pods not yet finished, by pool; want the totals each
	// pool (by UID: a pool created again starts from none) must end with.
	live map[string][]*corev1.Pod
	want map[types.UID][2]int64
}

func newRun(t *testing.T, cfg *config.Config, seed uint64) *run {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "robustness")
	require.NoError(t, err)
	r := &run{seed: seed, ns: ns, uids: map[string]types.UID{}, live: map[string][]*corev1.Pod{}, want: map[types.UID][2]int64{},
		start: time.Now(), recreate: make(chan string, 1)}
	for i := range pools {
		pool := operator.Pool(ns, fmt.Sprintf("pool-%d", i), 0)
		require.NoError(t, env.Client.Create(ctx, pool))
		r.uids[pool.GetName()] = pool.GetUID()
	}
	r.counts = watchCounts(t, ns, r.uids)
	r.lost = counter(t, "tally_aggregator_tracking_lost_pods_total")
	for i := range r.replicas {
		r.replicas[i] = newReplica(t, cfg, ns)
		r.replicas[i].start()
	}
	t.Cleanup(func() {
		for _, rep := range r.replicas {
			rep.stop()
		}
	})
	return r
}

// note adds a line to the schedule.
func (r *run) note(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, fmt.Sprintf("%6.1fs ", time.Since(r.start).Seconds())+fmt.Sprintf(format, args...))
}

// disrupt counts a fault that may move the lease.
func (r *run) disrupt() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.disruptive++
}

func (r *run) schedule() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}

// churnAndFaults runs the churn and the faults, each from its own stream of
// the seed, for runFor, then ends every pod still live.
func (r *run) churnAndFaults(t *testing.T) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { r.churn(t, rand.New(rand.NewPCG(r.seed, 1)), done) })
	wg.Go(func() { r.faults(t, rand.New(rand.NewPCG(r.seed, 2)), done) })
	time.Sleep(runFor)
	close(done)
	wg.Wait()
	r.note("faults and churn over; every live pod deleted")
	for pool, pods := range r.live {
		for _, p := range pods {
			r.finish(t, pool, p, "delete", false)
		}
	}
}

// churn creates pods in the pools, marks some for completion and finishes
// them (Succeeded, Failed, deleted) until done.
func (r *run) churn(t *testing.T, rng *rand.Rand, done <-chan struct{}) {
	n := 0
	for {
		select {
		case <-done:
			return
		case pool := <-r.recreate:
			r.recreatePool(t, pool)
			continue
		case <-time.After(time.Duration(20+rng.IntN(60)) * time.Millisecond):
		}
		pool := fmt.Sprintf("pool-%d", rng.IntN(pools))
		live := r.live[pool]
		switch op := rng.IntN(10); {
		case op < 4 || len(live) == 0:
			n++
			pod := builder.Pod(r.ns, fmt.Sprintf("%s-%d", pool, n)).ControlledBy(operator.GVK, pool, r.uids[pool]).
				Label(keys.ParentUID, string(r.uids[pool])).Label(keys.ParentName, pool).
				Annotation(keys.Parent, operator.GVK.Kind+"."+operator.GVK.Group+"/"+pool).
				Finalizer(keys.TrackingFinalizer).Build() // as the webhook stamps it
			if r.retry(t, "create "+pod.Name, func(ctx context.Context) error { return env.Client.Create(ctx, pod) },
				func(ctx context.Context) (bool, error) { return r.exists(ctx, pod) }) {
				r.live[pool] = append(live, pod)
			}
		default:
			i := rng.IntN(len(live))
			pod := live[i]
			intent := rng.IntN(2) == 0
			ending := []string{"Succeeded", "Failed", "delete"}[rng.IntN(3)]
			r.live[pool] = append(live[:i], live[i+1:]...)
			r.finish(t, pool, pod, ending, intent)
		}
	}
}

// finish ends pod: its intent first when it has one, then the ending; the
// pool's expected totals count it.
func (r *run) finish(t *testing.T, pool string, pod *corev1.Pod, ending string, intent bool) {
	if intent {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent))
		r.retry(t, "mark "+pod.Name, func(ctx context.Context) error { return env.Client.Patch(ctx, pod.DeepCopy(), patch) }, nil)
	}
	if ending == "delete" {
		r.retry(t, "delete "+pod.Name, func(ctx context.Context) error { return client.IgnoreNotFound(env.Client.Delete(ctx, pod.DeepCopy())) }, nil)
	} else {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"status":{"phase":%q}}`, ending))
		r.retry(t, ending+" "+pod.Name, func(ctx context.Context) error { return env.Client.Status().Patch(ctx, pod.DeepCopy(), patch) }, nil)
	}
	uid := metav1.GetControllerOf(pod).UID
	r.mu.Lock()
	w := r.want[uid]
	if intent {
		w[0]++
	} else {
		w[1]++
	}
	r.want[uid] = w
	r.mu.Unlock()
}

// recreatePool deletes pool and its live pods, as the garbage collector
// would (their finish is counted nowhere: tally releases them uncounted),
// and creates a pool under the same name, which must start from no counts
// and no totals.
func (r *run) recreatePool(t *testing.T, pool string) {
	old := &unstructured.Unstructured{}
	old.SetGroupVersionKind(operator.GVK)
	old.SetNamespace(r.ns)
	old.SetName(pool)
	r.retry(t, "delete "+pool, func(ctx context.Context) error { return client.IgnoreNotFound(env.Client.Delete(ctx, old.DeepCopy())) }, nil)
	for _, pod := range r.live[pool] {
		r.retry(t, "delete "+pod.Name, func(ctx context.Context) error { return client.IgnoreNotFound(env.Client.Delete(ctx, pod.DeepCopy())) }, nil)
	}
	r.live[pool] = nil
	created := operator.Pool(r.ns, pool, 0)
	if r.retry(t, "create "+pool, func(ctx context.Context) error {
		err := env.Client.Create(ctx, created)
		if !apierrors.IsAlreadyExists(err) {
			return err
		}
		// The old pool still being deleted, or this create taken by an API
		// server whose answer was lost.
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: r.ns, Name: pool}, created); err != nil {
			return err
		}
		if created.GetUID() == r.uids[pool] {
			return fmt.Errorf("%s still exists", pool)
		}
		return nil
	}, nil) {
		r.uids[pool] = created.GetUID()
		r.counts.addPool(pool, created)
		r.note("%s created again, UID %s", pool, created.GetUID())
	}
}

// retry sends op until the API server takes it (an API server restart
// refuses or cuts requests for seconds). When op fails without a clear
// answer, applied tells whether it took effect; nil: op is idempotent.
// It reports whether op took effect.
func (r *run) retry(t *testing.T, what string, op func(context.Context) error, applied func(context.Context) (bool, error)) bool {
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := op(ctx)
		cancel()
		switch {
		case err == nil:
			return true
		case apierrors.IsAlreadyExists(err):
			return true
		case apierrors.IsInvalid(err) || apierrors.IsForbidden(err) || apierrors.IsBadRequest(err):
			t.Errorf("%s refused: %v", what, err)
			return false
		}
		if applied != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			ok, err := applied(ctx)
			cancel()
			if err == nil && ok {
				return true
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Errorf("%s not taken by the API server within a minute", what)
	return false
}

func (r *run) exists(ctx context.Context, pod *corev1.Pod) (bool, error) {
	err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), &corev1.Pod{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// faults draws one fault at a time, with pauses between them, until done.
func (r *run) faults(t *testing.T, rng *rand.Rand, done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case <-time.After(time.Duration(1000+rng.IntN(3000)) * time.Millisecond):
		}
		i := rng.IntN(len(r.replicas))
		rep := r.replicas[i]
		d := time.Duration(1+rng.IntN(8)) * time.Second
		switch rng.IntN(12) {
		case 0, 1:
			r.note("replica %d cut off from the API server for %s", i, d)
			r.disrupt()
			rep.proxy.CutOff()
			time.Sleep(d)
			rep.proxy.Restore()
		case 2, 3:
			// Up to 16 s: past staleViewAfter, the replica starts a new
			// manager.
			d *= 2
			r.note("replica %d: pod watch broken for %s", i, d)
			r.disrupt()
			rep.faults.Set(true)
			time.Sleep(d)
			rep.faults.Set(false)
		case 4:
			r.note("replica %d: pod lists and watches answered 429 for %s", i, d)
			rep.faults.Throttle(true)
			time.Sleep(d)
			rep.faults.Throttle(false)
		case 5, 6:
			r.note("replica %d stopped, started again %s later", i, d)
			r.disrupt()
			rep.stop()
			time.Sleep(d)
			rep.start()
		case 9, 10:
			// The leader lost with its node, and no standby running: pods
			// finish with no replica to record them.
			r.note("every replica stopped, started again %s later", d)
			r.disrupt()
			for _, rep := range r.replicas {
				rep.stop()
			}
			time.Sleep(d)
			for _, rep := range r.replicas {
				rep.start()
			}
		case 11:
			pool := fmt.Sprintf("pool-%d", rng.IntN(pools))
			r.note("%s deleted with its live pods, and created again", pool)
			select {
			case r.recreate <- pool:
			case <-done:
				return
			}
		case 7, 8:
			down := time.Duration(rng.IntN(3)) * time.Second
			r.note("kube-apiserver killed, started again %s later", down)
			r.disrupt()
			if err := env.RestartAPIServer(down); err != nil {
				t.Errorf("restarting kube-apiserver: %v", err)
				return
			}
			r.note("kube-apiserver answers again")
		}
	}
}

// check waits, within settleBound of the last fault, for every invariant to
// hold, then checks the history.
func (r *run) check(t *testing.T) {
	ctx := context.Background()
	r.note("checking")
	deadline := time.Now().Add(settleBound)
	var problems []string
	for {
		problems = r.problems(ctx)
		if len(problems) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	require.Empty(t, problems, "%s after the faults ended", settleBound)
	r.note("settled")
	finished := 0
	for _, w := range r.want {
		finished += int(w[0] + w[1])
	}
	lines := r.schedule()
	t.Logf("%d pods finished; every invariant held %s after the faults ended; schedule:\n%s",
		finished, settleBound-time.Until(deadline).Round(10*time.Millisecond), strings.Join(lines, "\n"))
	for uid, seen := range r.counts.totalsSeen() {
		w := r.want[uid]
		var last [2]int64
		for _, s := range seen {
			assert.True(t, s[0] >= last[0] && s[1] >= last[1], "pool %s: a total went down, from %v to %v", uid, last, s)
			assert.True(t, s[0] <= w[0] && s[1] <= w[1], "pool %s: totals %v past the %v that finished", uid, s, w)
			last = s
		}
	}
	assert.Equal(t, r.lost, counter(t, "tally_aggregator_tracking_lost_pods_total"), "pods released as lost: none may be, the grace outlasting the run")
	var lease coordinationv1.Lease
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: r.ns, Name: leaseName}, &lease))
	r.mu.Lock()
	disruptive := r.disruptive
	r.mu.Unlock()
	transitions := int(ptr.Deref(lease.Spec.LeaseTransitions, 0))
	assert.LessOrEqual(t, transitions, disruptive, "the lease changed hands more often than a fault could make it: only a holder gone or stalled loses it")
	t.Logf("the lease changed hands %d times over %d faults that could move it", transitions, disruptive)
	violations, checked, unchecked, lag := r.counts.check()
	assert.Empty(t, violations, "counts written from a view that was not whole and recent")
	t.Logf("%d counts writes checked against the truth of the %s before each, %d not (a relist in their window); "+
		"the oldest value written had not been the truth for %s", checked, viewBound, unchecked, lag.Round(time.Millisecond))
}

// problems returns what does not hold yet: a pool whose counts differ
// from a fresh List, whose totals differ from the pods that finished, or
// whose ledger is not empty; a pod that keeps the tracking finalizer.
func (r *run) problems(ctx context.Context) []string {
	var pods corev1.PodList
	if err := env.Client.List(ctx, &pods, client.InNamespace(r.ns)); err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, p := range pods.Items {
		if len(p.Finalizers) > 0 {
			out = append(out, fmt.Sprintf("pod %s keeps %v", p.Name, p.Finalizers))
		}
	}
	for pool, uid := range r.uids {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(operator.GVK)
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: r.ns, Name: pool}, u); err != nil {
			return []string{err.Error()}
		}
		for count, v := range truth.Counts(pods.Items, r.ns, uid) {
			got, _, _ := unstructured.NestedInt64(u.Object, "status", string(count))
			if got != v {
				out = append(out, fmt.Sprintf("%s: %s %d, a fresh List says %d", pool, count, got, v))
			}
		}
		c, x, ledger := framework.Totals(u)
		r.mu.Lock()
		w := r.want[uid]
		r.mu.Unlock()
		if c != w[0] || x != w[1] || ledger != 0 {
			out = append(out, fmt.Sprintf("%s: completedTotal %d, unexpectedTotal %d, ledger %d; %d and %d finished", pool, c, x, ledger, w[0], w[1]))
		}
	}
	return out
}

// replica is one aggregator, run in this process, reaching the API server
// through its own proxy and fault injector.
type replica struct {
	cfg    *config.Config
	rest   *rest.Config
	proxy  *framework.Proxy
	faults *framework.WatchBreaker
	leases string

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

func newReplica(t *testing.T, cfg *config.Config, ns string) *replica {
	host, err := url.Parse(env.Config.Host)
	require.NoError(t, err)
	p, err := framework.NewProxy(host.Host)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	rc := rest.CopyConfig(env.Config)
	rc.Host = "https://" + p.Addr()
	rc.ServerName = host.Hostname()
	f := &framework.WatchBreaker{}
	f.Wrap(rc)
	return &replica{cfg: cfg, rest: rc, proxy: p, faults: f, leases: ns}
}

// start runs the replica until stop.
func (rep *replica) start() {
	rep.mu.Lock()
	defer rep.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	rep.cancel, rep.done = cancel, make(chan struct{})
	done := rep.done
	go func() {
		defer close(done)
		_ = app.Run(ctx, rep.cfg, rep.rest, app.Options{
			MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 2,
			LeaderElect: true, LeaderElectionNamespace: rep.leases, LeaderElectionID: leaseName,
			TrackingGrace: 10 * time.Minute,
		})
	}()
}

// stop stops the replica and waits for it to return.
func (rep *replica) stop() {
	rep.mu.Lock()
	cancel, done := rep.cancel, rep.done
	rep.cancel = nil
	rep.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// counter reads the process's counter name, summed over its series.
func counter(t *testing.T, name string) float64 {
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, f := range families {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// syncBuffer is the aggregators' log of the current seed.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}

// Tail returns the last n lines.
func (b *syncBuffer) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	lines := strings.Split(strings.TrimRight(b.buf.String(), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
