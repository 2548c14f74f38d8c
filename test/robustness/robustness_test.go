// Package robustness runs two aggregator processes (leader election, a
// kind with totals) under a seeded random schedule of faults over a seeded
// churn of pods, on a real API server, and checks the specification's
// invariants on what the API server recorded: every status the pools took
// and every change to the pods, as watched, and the pods and Events at the
// end. The faults:
//   - a replica cut off from the API server;
//   - its pod watch broken (up to 24 s: past the bound after which it
//     starts a new manager), and the relists that follow slowed;
//   - its pod watch ended, and the replay of the watch resumed after it
//     late (up to 4 s after its headers);
//   - the leader paused (SIGSTOP, 3 s) while a relist is under way;
//   - its relists trickling for 75 s (16 bytes every 0.5 s): a relist that
//     makes progress, however long, must not be cut;
//   - its pod lists and watches (for longer than the grace, when the seed
//     draws a short one), or its writes, answered 429;
//   - the API server's clock, as its answers' Date headers show it to a
//     replica, stepped by up to an hour either way;
//   - the leader killed (SIGKILL) or paused (SIGSTOP, up to 16 s: past its
//     lease) and let go on;
//   - a replica stopped (SIGTERM) and started again;
//   - every replica killed for a while (the leader lost with its node, no
//     standby: pods finish with none to record them);
//   - a rollout: each replica in turn stopped and started with the other
//     configuration and flags;
//   - a pool deleted with its live pods and created again under its name;
//   - kube-apiserver, or etcd, killed and started again.
//
// A seed runs with a --tracking-grace of 10 minutes, under which no pod may
// be released as lost, or of 6 s, under which the grace runs out under the
// faults (a view stale or writes throttled for longer): the totals must
// then equal the pods that finished tracked but for those the replicas
// released as lost.
//
// The replicas are built with the race detector when the test is, and a
// data race, a panic or a replica that exits by itself fails the seed. A
// failing seed prints its schedule; `make robustness SEED=n` runs it again,
// `make robustness DURATION=2h` runs seeds one after another for that long.
package robustness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/freshness"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	// bin holds the aggregator binary the replicas run.
	bin string
)

func TestMain(m *testing.M) {
	code := func() int {
		var err error
		if bin, err = os.MkdirTemp("", "tally-bin-"); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(bin)
		return framework.Main(m, controlplane.Options{}, &env, func(*framework.Env) error {
			return framework.BuildRaceBinaries(bin, "aggregator", "webhook")
		})
	}()
	os.Exit(code)
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
	// shortGrace is the short --tracking-grace a seed may draw.
	shortGrace = 6 * time.Second
)

// TestRobustness runs one seed ($TALLY_ROBUSTNESS_SEED), or random seeds
// one after another for $TALLY_ROBUSTNESS_DURATION (one seed when unset).
func TestRobustness(t *testing.T) {
	framework.Long(t)
	configs := rolloutConfigs(t)
	hook := startWebhook(t, configs[0])
	if s := os.Getenv("TALLY_ROBUSTNESS_SEED"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "TALLY_ROBUSTNESS_SEED")
		runSeed(t, hook, configs, seed)
		return
	}
	budget := time.Duration(0)
	if d := os.Getenv("TALLY_ROBUSTNESS_DURATION"); d != "" {
		var err error
		budget, err = time.ParseDuration(d)
		require.NoError(t, err, "TALLY_ROBUSTNESS_DURATION")
	}
	start := time.Now()
	for n := 0; n == 0 || time.Since(start) < budget; n++ {
		if !runSeed(t, hook, configs, rand.Uint64()) {
			return
		}
	}
}

// rolloutConfigs returns the two configuration files a rollout goes from
// one to the other: the example's, and a copy that changes what leaves
// the counts as they are (verifyOwner, which the start-up and periodic
// sweeps follow).
func rolloutConfigs(t *testing.T) [2]string {
	example := repo.Path("examples", "workerpool", "config.yaml")
	data, err := os.ReadFile(example)
	require.NoError(t, err)
	changed := strings.Replace(string(data), "verifyOwner: false", "verifyOwner: true", 1)
	require.NotEqual(t, string(data), changed, "the example's config no longer says verifyOwner: false")
	other := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(other, []byte(changed), 0o644))
	for _, path := range []string{example, other} {
		_, err := config.Load(path)
		require.NoError(t, err)
	}
	return [2]string{example, other}
}

// runSeed runs one seed as a subtest and reports whether it passed.
func runSeed(t *testing.T, hook *webhook, configs [2]string, seed uint64) bool {
	return t.Run(fmt.Sprintf("seed %d", seed), func(t *testing.T) {
		r := newRun(t, hook, configs, seed)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("seed %d failed; run it again with: make robustness SEED=%d\nschedule:\n%s", seed, seed, strings.Join(r.schedule(), "\n"))
				for _, rep := range r.replicas {
					t.Logf("%s's log (end):\n%s", rep.name, tail(rep.logPath(), 60))
				}
			}
		})
		r.churnAndFaults(t)
		r.check(t)
	})
}

// run is one seed's world: its pools, its two replicas, what was done.
type run struct {
	seed uint64
	// grace is the replicas' --tracking-grace.
	grace    time.Duration
	ns       string
	hook     *webhook
	uids     map[string]types.UID
	replicas [2]*replica
	counts   *countsHistory
	// recreate asks the churn to delete a pool, with its live pods as the
	// garbage collector would, and create it again under its name.
	recreate chan string

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
	// untracked counts the pods that finished without the tracking
	// finalizer (admitted while the webhook was down, and finished before
	// the aggregator gave it to them): in no total.
	untracked int
	// finished holds each pod counted in want: its pool and whether it
	// finished with an intent.
	finished map[string]finish
}

// finish is a tracked pod's finish, as want counts it.
type finish struct {
	pool   types.UID
	intent bool
}

func newRun(t *testing.T, hook *webhook, configs [2]string, seed uint64) *run {
	ctx := context.Background()
	ns := env.WebhookNamespace(t, "robustness")
	hook.register(t, ns)
	r := &run{seed: seed, ns: ns, hook: hook, uids: map[string]types.UID{}, live: map[string][]*corev1.Pod{}, want: map[types.UID][2]int64{}, finished: map[string]finish{},
		start: time.Now(), recreate: make(chan string, 1), grace: 10 * time.Minute}
	if rand.New(rand.NewPCG(seed, 3)).IntN(2) == 0 {
		r.grace = shortGrace
	}
	r.note("--tracking-grace %s", r.grace)
	for i := range pools {
		pool := operator.Pool(ns, fmt.Sprintf("pool-%d", i), 0)
		require.NoError(t, env.Client.Create(ctx, pool))
		r.uids[pool.GetName()] = pool.GetUID()
	}
	r.counts = watchCounts(t, ns, r.uids)
	dir := t.TempDir()
	for i := range r.replicas {
		r.replicas[i] = newReplica(t, fmt.Sprintf("aggregator-%d", i), dir, ns, configs, r.grace)
		r.replicas[i].start(t)
	}
	t.Cleanup(func() {
		for _, rep := range r.replicas {
			rep.stop(t)
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
			// The webhook stamps it and adds the tracking finalizer; while
			// it is down, the pod is admitted as it is.
			pod := builder.Pod(r.ns, fmt.Sprintf("%s-%d", pool, n)).ControlledBy(operator.GVK, pool, r.uids[pool]).Build()
			if r.retry(t, "create "+pod.Name, func(ctx context.Context) error { return r.create(ctx, pod) },
				func(ctx context.Context) (bool, error) { return r.read(ctx, pod) }) {
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

// finish ends pod: its intent first when it has one, then the ending. The
// pool's expected totals count it if it carried the tracking finalizer
// when it finished: the webhook adds it at CREATE, the aggregator to the
// live pods admitted without it (the webhook down), and a pod that
// finished without it is never given it.
func (r *run) finish(t *testing.T, pool string, pod *corev1.Pod, ending string, intent bool) {
	tracked := slices.Contains(pod.Finalizers, keys.TrackingFinalizer)
	if !tracked {
		var finished bool
		if finished, tracked = r.finishUntracked(t, pod, ending, intent); finished {
			r.count(pod, intent, tracked)
			return
		}
	}
	if intent {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent))
		r.retry(t, "mark "+pod.Name, func(ctx context.Context) error { return env.Client.Patch(ctx, pod.DeepCopy(), patch) }, nil)
	}
	r.count(pod, r.end(t, pod, ending), true)
}

// end finishes pod, and reports whether it carried an intent tally
// admitted when it finished: an intent set while the webhook was down,
// which tally stamps when it first sees it, counts only if tally saw it
// before the pod finished. Each ending is conditioned on the version read,
// so that the test knows what the pod carried then.
func (r *run) end(t *testing.T, pod *corev1.Pod, ending string) bool {
	admitted := false
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		done, err := func() (bool, error) {
			cur := &corev1.Pod{}
			switch err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), cur); {
			case apierrors.IsNotFound(err):
				// This function's delete took effect but its answer was
				// lost, and the pod is gone.
				return true, nil
			case err != nil:
				return false, err
			case cur.UID != pod.UID:
				return true, nil
			}
			_, marked := cur.Annotations[keys.CompletionIntent]
			_, stamped := cur.Annotations[keys.CompletionIntentAt]
			if cur.DeletionTimestamp != nil || cur.Status.Phase == corev1.PodSucceeded || cur.Status.Phase == corev1.PodFailed {
				// This function's ending took effect but its answer was
				// lost: no stamp comes after the end.
				admitted = marked && stamped
				return true, nil
			}
			admitted = marked && stamped
			return true, endFrom(ctx, cur, ending)
		}()
		cancel()
		switch {
		case done && err == nil:
			return admitted
		case apierrors.IsInvalid(err) || apierrors.IsForbidden(err) || apierrors.IsBadRequest(err):
			t.Errorf("%s %s refused: %v", ending, pod.Name, err)
			return admitted
		}
		// A conflict (tally stamped the pod in between), or no clear
		// answer: read it again.
		time.Sleep(200 * time.Millisecond)
	}
	t.Errorf("%s %s: not taken by the API server within a minute", ending, pod.Name)
	return admitted
}

// count records pod's finish in its pool's expected totals, if tracked.
func (r *run) count(pod *corev1.Pod, intent, tracked bool) {
	uid := metav1.GetControllerOf(pod).UID
	r.mu.Lock()
	defer r.mu.Unlock()
	if !tracked {
		r.untracked++
		return
	}
	w := r.want[uid]
	if intent {
		w[0]++
	} else {
		w[1]++
	}
	r.want[uid] = w
	r.finished[pod.Name] = finish{pool: uid, intent: intent}
}

// lost returns, by pool, the pods the replicas released as lost (their
// grace ran out before they were recorded), as their logs name them: with
// and without an intent.
func (r *run) lost() map[types.UID][2]int64 {
	out := map[types.UID][2]int64{}
	for _, rep := range r.replicas {
		data, err := os.ReadFile(rep.logPath())
		if err != nil {
			continue
		}
		for line := range bytes.Lines(data) {
			if !bytes.Contains(line, []byte(`"msg":"Released pods held by the tracking finalizer"`)) {
				continue
			}
			var entry struct {
				Reason string   `json:"reason"`
				Lost   []string `json:"lost"`
			}
			if json.Unmarshal(line, &entry) != nil || entry.Reason != "lost" {
				continue
			}
			r.mu.Lock()
			for _, name := range entry.Lost {
				if f, ok := r.finished[name]; ok {
					n := out[f.pool]
					if f.intent {
						n[0]++
					} else {
						n[1]++
					}
					out[f.pool] = n
				}
			}
			r.mu.Unlock()
		}
	}
	return out
}

// finishUntracked finishes pod, admitted without the tracking finalizer,
// as long as it is still without it: every write is conditioned on the
// resourceVersion last read, so the test knows whether the pod carried the
// finalizer when it finished. It reports whether it finished the pod, and
// whether the pod carried the finalizer then; when the pod gained the
// finalizer first, it returns (false, true) and finish goes on as for any
// tracked pod.
func (r *run) finishUntracked(t *testing.T, pod *corev1.Pod, ending string, intent bool) (finished, tracked bool) {
	deadline := time.Now().Add(time.Minute)
	var err error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		finished, tracked, err = r.finishFrom(ctx, pod, ending, intent)
		cancel()
		switch {
		case err == nil:
			return finished, tracked
		case apierrors.IsInvalid(err) || apierrors.IsForbidden(err) || apierrors.IsBadRequest(err):
			t.Errorf("finishing %s refused: %v", pod.Name, err)
			return true, false
		}
		// A conflict (the aggregator stamped the pod or gave it the
		// finalizer in between), or no clear answer: read it again.
		time.Sleep(200 * time.Millisecond)
	}
	t.Errorf("finishing %s: not taken by the API server within a minute; the last answer: %v", pod.Name, err)
	return true, false
}

// finishFrom reads pod and finishes it from what it read, unless it
// carries the tracking finalizer.
func (r *run) finishFrom(ctx context.Context, pod *corev1.Pod, ending string, intent bool) (finished, tracked bool, err error) {
	cur := &corev1.Pod{}
	switch err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), cur); {
	case apierrors.IsNotFound(err):
		// This function's delete, conditioned on a pod without the
		// finalizer, took effect but its answer was lost.
		return true, false, nil
	case err != nil:
		return false, false, err
	case cur.UID != pod.UID:
		return false, false, fmt.Errorf("%s is another pod now", pod.Name)
	}
	tracked = slices.Contains(cur.Finalizers, keys.TrackingFinalizer)
	if cur.DeletionTimestamp != nil || cur.Status.Phase == corev1.PodSucceeded || cur.Status.Phase == corev1.PodFailed {
		// This function's ending took effect but its answer was lost.
		return true, tracked, nil
	}
	if tracked {
		return false, true, nil
	}
	if _, marked := cur.Annotations[keys.CompletionIntent]; intent && !marked {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:"scale-down"}}}`,
			cur.ResourceVersion, keys.CompletionIntent))
		if err := env.Client.Patch(ctx, cur, patch); err != nil {
			return false, false, err
		}
	}
	err = endFrom(ctx, cur, ending)
	return err == nil, false, err
}

// endFrom ends cur ("delete", or a terminal phase), conditioned on the
// version read: it fails with a conflict if the pod changed since.
func endFrom(ctx context.Context, cur *corev1.Pod, ending string) error {
	if ending == "delete" {
		return env.Client.Delete(ctx, cur, client.Preconditions{UID: &cur.UID, ResourceVersion: &cur.ResourceVersion})
	}
	patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q},"status":{"phase":%q}}`, cur.ResourceVersion, ending))
	return env.Client.Status().Patch(ctx, cur, patch)
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

// create creates pod and fills it in as the API server took it (its UID,
// and the finalizer when the webhook added it), also when an earlier create
// was taken by an API server whose answer was lost: each pod name is
// created once.
func (r *run) create(ctx context.Context, pod *corev1.Pod) error {
	err := env.Client.Create(ctx, pod)
	if apierrors.IsAlreadyExists(err) {
		return env.Client.Get(ctx, client.ObjectKeyFromObject(pod), pod)
	}
	return err
}

// read fills pod in as the API server has it, and reports whether it
// exists.
func (r *run) read(ctx context.Context, pod *corev1.Pod) (bool, error) {
	err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), pod)
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
		switch rng.IntN(21) {
		case 0, 1:
			r.note("%s cut off from the API server for %s", rep.name, d)
			r.disrupt()
			rep.proxy.CutOff()
			time.Sleep(d)
			rep.proxy.Restore()
		case 2, 3:
			// Up to 24 s: past freshness.StallAfter, the replica starts a
			// new manager.
			d *= 3
			slow := time.Duration(rng.IntN(4)) * time.Second
			r.note("%s: pod watch broken for %s, then its relists %s slow for 5s", rep.name, d, slow)
			r.disrupt()
			rep.faults.Set(true)
			time.Sleep(d)
			rep.faults.SlowRelists(slow)
			rep.faults.Set(false)
			time.Sleep(5 * time.Second)
			rep.faults.SlowRelists(0)
		case 4:
			if r.grace == shortGrace {
				// The grace runs on while the view is stale.
				d += r.grace
			}
			r.note("%s: pod lists and watches answered 429 for %s", rep.name, d)
			rep.faults.Throttle(true)
			time.Sleep(d)
			rep.faults.Throttle(false)
		case 5:
			r.note("%s: writes (status applies, finalizer releases, Events) answered 429 for %s", rep.name, d)
			rep.api.ThrottleWrites(true)
			time.Sleep(d)
			rep.api.ThrottleWrites(false)
		case 6:
			rep = r.leader(rep)
			r.note("%s killed (SIGKILL), started again %s later", rep.name, d)
			r.disrupt()
			rep.kill(t)
			time.Sleep(d)
			rep.start(t)
		case 7:
			// Up to 16 s: past the lease, which a standby then takes; the
			// paused replica must not write once it goes on.
			d *= 2
			rep = r.leader(rep)
			r.note("%s paused (SIGSTOP) for %s", rep.name, d)
			r.disrupt()
			rep.signal(t, syscall.SIGSTOP)
			time.Sleep(d)
			rep.signal(t, syscall.SIGCONT)
		case 8:
			r.note("%s stopped (SIGTERM), started again %s later", rep.name, d)
			r.disrupt()
			rep.stop(t)
			time.Sleep(d)
			rep.start(t)
		case 9:
			// The leader lost with its node, and no standby running: pods
			// finish with no replica to record them.
			r.note("every replica killed (SIGKILL), started again %s later", d)
			r.disrupt()
			for _, rep := range r.replicas {
				rep.kill(t)
			}
			time.Sleep(d)
			for _, rep := range r.replicas {
				rep.start(t)
			}
		case 10:
			pool := fmt.Sprintf("pool-%d", rng.IntN(pools))
			r.note("%s deleted with its live pods, and created again", pool)
			select {
			case r.recreate <- pool:
			case <-done:
				return
			}
		case 11, 12:
			down := time.Duration(rng.IntN(3)) * time.Second
			r.note("kube-apiserver killed, started again %s later", down)
			r.disrupt()
			if err := env.RestartAPIServer(down); err != nil {
				t.Errorf("restarting kube-apiserver: %v", err)
				return
			}
			r.note("kube-apiserver answers again")
		case 13:
			down := time.Duration(rng.IntN(3)) * time.Second
			r.note("etcd killed, started again %s later", down)
			r.disrupt()
			if err := env.RestartEtcd(down); err != nil {
				t.Errorf("restarting etcd: %v", err)
				return
			}
			r.note("etcd answers again")
		case 14, 15:
			// As a Deployment rolls out a new ConfigMap: one replica at a
			// time, the next once the new one is ready.
			r.note("rollout: each replica in turn stopped and started with the other configuration")
			for _, rep := range r.replicas {
				r.disrupt()
				rep.stop(t)
				rep.variant = 1 - rep.variant
				rep.start(t)
				if err := rep.waitReady(); err != nil {
					r.note("rollout: %s not ready within a minute (%v); going on", rep.name, err)
				}
			}
			r.note("rollout over")
		case 17:
			// The API server ends a watch, and the replay of the watch
			// resumed after it comes late (a loaded API server, a large
			// replay, a starved replica).
			late := time.Duration(1+rng.IntN(4)) * time.Second
			r.note("%s: pod watch ended, the replays of resumed watches %s late for 5s", rep.name, late)
			r.disrupt()
			rep.faults.SlowResumes(late)
			rep.faults.EndWatches()
			time.Sleep(5 * time.Second)
			rep.faults.SlowResumes(0)
		case 18:
			// A pause of the process while a relist is under way: the
			// relist goes on.
			rep = r.leader(rep)
			r.note("%s: pod watch ended, its relist 5s slow, paused (SIGSTOP) for 3s during it", rep.name)
			r.disrupt()
			rep.faults.SlowRelists(5 * time.Second)
			rep.faults.EndWatches()
			time.Sleep(time.Second)
			rep.signal(t, syscall.SIGSTOP)
			time.Sleep(3 * time.Second)
			rep.signal(t, syscall.SIGCONT)
			time.Sleep(2 * time.Second)
			rep.faults.SlowRelists(0)
		case 19:
			// A relist of a very large list on a loaded API server: it
			// makes progress all along, and is not cut.
			const trickle = 75 * time.Second
			r.note("%s: pod watch ended, its relists trickling (16 bytes every 0.5 s) for %s", rep.name, trickle)
			r.disrupt()
			stalled := rep.stalls()
			rep.faults.TrickleRelists(true)
			rep.faults.EndWatches()
			time.Sleep(trickle)
			rep.faults.TrickleRelists(false)
			if n := rep.stalls() - stalled; n > 0 {
				t.Errorf("%s started a new manager %d times during a relist that made progress all along", rep.name, n)
			}
		case 20:
			step := time.Duration(1+rng.IntN(60)) * time.Minute
			if rng.IntN(2) == 0 {
				step = -step
			}
			r.note("the API server's clock, as %s sees it, stepped by %s for %s", rep.name, step, d)
			rep.api.StepClock(step)
			time.Sleep(d)
			rep.api.StepClock(0)
		case 16:
			r.note("webhook down for %s (failurePolicy Ignore: pods admitted unstamped, without the finalizer)", d)
			r.hook.stop(t)
			time.Sleep(d)
			r.hook.start(t)
		}
	}
}

// leader returns the replica that holds the lease, or rep when none does
// (or the test cannot tell which).
func (r *run) leader(rep *replica) *replica {
	var lease coordinationv1.Lease
	if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: r.ns, Name: leaseName}, &lease); err != nil {
		return rep
	}
	holder := ptr.Deref(lease.Spec.HolderIdentity, "")
	for _, other := range r.replicas {
		if holder != "" && other.identity() == holder {
			return other
		}
	}
	return rep
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
	r.mu.Lock()
	untracked := r.untracked
	r.mu.Unlock()
	t.Logf("%d pods finished tracked, %d untracked (admitted while the webhook was down, finished before they were given the finalizer); "+
		"every invariant held %s after the faults ended; schedule:\n%s",
		finished, untracked, settleBound-time.Until(deadline).Round(10*time.Millisecond), strings.Join(lines, "\n"))
	for uid, seen := range r.counts.totalsSeen() {
		w := r.want[uid]
		var last [2]int64
		for _, s := range seen {
			assert.True(t, s[0] >= last[0] && s[1] >= last[1], "pool %s: a total went down, from %v to %v", uid, last, s)
			assert.True(t, s[0] <= w[0] && s[1] <= w[1], "pool %s: totals %v past the %v that finished", uid, s, w)
			last = s
		}
	}
	var events corev1.EventList
	require.NoError(t, env.Client.List(ctx, &events, client.InNamespace(r.ns)))
	lost := 0
	for _, l := range r.lost() {
		lost += int(l[0] + l[1])
	}
	if r.grace == shortGrace {
		// The grace runs while the view is stale or writes are throttled:
		// a pod that finished just before may be released unrecorded.
		t.Logf("%d pods released as lost, their grace of %s run out before they were recorded (not in the totals checked)", lost, r.grace)
	} else {
		assert.Zero(t, lost, "pods released as lost, with a grace that outlasts the run")
		for _, e := range events.Items {
			assert.NotEqual(t, "TrackingLost", e.Reason, "a pod released as lost, with a grace that outlasts the run: %s", e.Message)
		}
	}
	for _, rep := range r.replicas {
		assert.Empty(t, rep.trouble(), "%s", rep.name)
	}
	var lease coordinationv1.Lease
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: r.ns, Name: leaseName}, &lease))
	r.mu.Lock()
	disruptive := r.disruptive
	r.mu.Unlock()
	transitions := int(ptr.Deref(lease.Spec.LeaseTransitions, 0))
	assert.LessOrEqual(t, transitions, disruptive, "the lease changed hands more often than a fault could make it: only a holder gone or stalled loses it")
	t.Logf("the lease changed hands %d times over %d faults that could move it", transitions, disruptive)
	require.NoError(t, r.counts.caughtUp(ctx, r.ns))
	violations, checked, unchecked, lag := r.counts.check()
	assert.Empty(t, violations, "counts written from a view that was not whole and recent")
	t.Logf("%d counts writes checked against the truth of the %s before each, %d not (a relist or an unstamped pod in their window); "+
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
	lost := r.lost()
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
		// A pod whose grace ran out unrecorded is in no total.
		l := lost[uid]
		w[0], w[1] = w[0]-l[0], w[1]-l[1]
		if c != w[0] || x != w[1] || ledger != 0 {
			out = append(out, fmt.Sprintf("%s: completedTotal %d, unexpectedTotal %d, ledger %d; %d and %d finished", pool, c, x, ledger, w[0], w[1]))
		}
	}
	return out
}

// replica is one aggregator process (built with the race detector when
// this test is). It reaches the API server through a Proxy that can cut it
// off, in front of an APIProxy whose WatchBreaker breaks and throttles its
// pod lists and watches, and which can throttle its writes.
type replica struct {
	name       string
	dir        string
	ns         string
	configs    [2]string
	kubeconfig string
	proxy      *framework.Proxy
	api        *framework.APIProxy
	faults     *framework.WatchBreaker
	grace      time.Duration

	mu   sync.Mutex
	proc *process.Process
	// probe is the process's /readyz address.
	probe string
	// variant is the configuration and flags the next start uses (a
	// rollout goes from one to the other).
	variant int
	// exits are the exits the test did not cause.
	exits []string
}

func newReplica(t *testing.T, name, dir, ns string, configs [2]string, grace time.Duration) *replica {
	rc := rest.CopyConfig(env.Config)
	// As the aggregator's service account: the webhook is not called for
	// its requests.
	rc.Impersonate = rest.ImpersonationConfig{UserName: helm.AggregatorUser, Groups: []string{"system:masters", "system:authenticated"}}
	f := &framework.WatchBreaker{}
	f.Wrap(rc)
	api, err := framework.NewAPIProxy(rc)
	require.NoError(t, err)
	t.Cleanup(api.Close)
	p, err := framework.NewProxy(api.Addr())
	require.NoError(t, err)
	t.Cleanup(p.Close)
	kubeconfig := filepath.Join(dir, name+".kubeconfig")
	require.NoError(t, framework.WriteKubeconfig(p.Addr(), kubeconfig))
	return &replica{name: name, dir: dir, ns: ns, configs: configs, kubeconfig: kubeconfig, proxy: p, api: api, faults: f, grace: grace}
}

// start starts the process, unless it runs.
func (rep *replica) start(t *testing.T) {
	rep.mu.Lock()
	defer rep.mu.Unlock()
	if rep.proc != nil {
		return
	}
	port, err := process.FreePort()
	if err != nil {
		t.Errorf("starting %s: %v", rep.name, err)
		return
	}
	rep.probe = fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"--config", rep.configs[rep.variant], "--kubeconfig", rep.kubeconfig,
		"--leader-elect", "--leader-election-namespace", rep.ns, "--leader-election-id", leaseName,
		"--metrics-bind-address", "0", "--health-probe-bind-address", rep.probe, "--tracking-grace", rep.grace.String(),
		// Each apply is logged, with the values and the resourceVersion it
		// made: a failing seed's log tells which replica wrote what.
		"--zap-log-level", "debug"}
	// Sweeps every few seconds: the pods admitted while the webhook was
	// down are stamped, and given the finalizer, within the run.
	if rep.variant == 0 {
		args = append(args, "--max-concurrent-reconciles", "2", "--backfill-interval", "5s")
	} else {
		args = append(args, "--max-concurrent-reconciles", "4", "--kube-api-qps", "20", "--backfill-interval", "8s")
	}
	p, err := process.Start(rep.name, filepath.Join(bin, "aggregator"), rep.dir, args...)
	if err != nil {
		t.Errorf("starting %s: %v", rep.name, err)
		return
	}
	rep.proc = p
}

// stop stops the process (SIGTERM, as a rollout or a drain does) and waits
// for it to exit.
func (rep *replica) stop(t *testing.T) { rep.end(t, syscall.SIGTERM) }

// kill kills the process (SIGKILL: a crash, an OOM kill, a lost node).
func (rep *replica) kill(t *testing.T) { rep.end(t, syscall.SIGKILL) }

func (rep *replica) end(t *testing.T, sig syscall.Signal) {
	rep.mu.Lock()
	defer rep.mu.Unlock()
	if rep.proc == nil {
		return
	}
	if rep.exited(); rep.proc == nil {
		return
	}
	_ = rep.proc.Signal(syscall.SIGCONT)
	if sig != syscall.SIGTERM {
		_ = rep.proc.Signal(sig)
	}
	// Stop sends SIGTERM (once: a second one makes the process exit 1 at
	// once, as controller-runtime's signal handler does) and reaps it.
	if err := rep.proc.Stop(); err != nil {
		t.Errorf("%s, sent %v: %v %v; its log (end):\n%s", rep.name, sig, err, scanLog(rep.logPath()), tail(rep.logPath(), 40))
	}
	rep.proc = nil
}

// signal sends sig to the process.
func (rep *replica) signal(t *testing.T, sig syscall.Signal) {
	rep.mu.Lock()
	defer rep.mu.Unlock()
	if rep.proc == nil {
		return
	}
	if err := rep.proc.Signal(sig); err != nil {
		t.Errorf("%s: %v: %v", rep.name, sig, err)
	}
}

// exited records an exit of the process's own. Called with rep.mu held.
func (rep *replica) exited() {
	if done, err := rep.proc.Exited(); done {
		rep.exits = append(rep.exits, fmt.Sprintf("exited by itself: %v", err))
		rep.proc = nil
	}
}

// waitReady waits until the process is ready: its caches synced.
func (rep *replica) waitReady() error {
	rep.mu.Lock()
	p, probe := rep.proc, rep.probe
	rep.mu.Unlock()
	if p == nil {
		return errors.New("not running")
	}
	return p.WaitReady(context.Background(), "http://"+probe+"/readyz")
}

func (rep *replica) logPath() string { return filepath.Join(rep.dir, rep.name+".log") }

// stalls returns how many times the process started a new manager because
// its pod view stalled (freshness.ErrStalled), as its log says.
func (rep *replica) stalls() int {
	log, err := os.ReadFile(rep.logPath())
	if err != nil {
		return 0
	}
	return bytes.Count(log, []byte(stalledLine))
}

// stalledLine is how freshness.ErrStalled begins.
var stalledLine = strings.SplitN(freshness.ErrStalled.Error(), ":", 2)[0]

// identityLine finds the identity each start of the process logs.
var identityLine = regexp.MustCompile(`"identity":"([^"]+)"`)

// identity returns the identity the process holds the lease as: the one
// its latest start logged.
func (rep *replica) identity() string {
	log, err := os.ReadFile(rep.logPath())
	if err != nil {
		return ""
	}
	all := identityLine.FindAllSubmatch(log, -1)
	if len(all) == 0 {
		return ""
	}
	return string(all[len(all)-1][1])
}

// trouble returns what went wrong in the process, whatever the faults: an
// exit of its own, a data race, a panic.
func (rep *replica) trouble() []string {
	rep.mu.Lock()
	if rep.proc != nil {
		rep.exited()
	}
	out := slices.Clone(rep.exits)
	rep.mu.Unlock()
	return append(out, scanLog(rep.logPath())...)
}

// scanLog returns what the log at path says went wrong: a data race, a
// panic.
func scanLog(path string) []string {
	log, err := os.ReadFile(path)
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
		if n := bytes.Count(log, []byte(bad)); n > 0 {
			out = append(out, fmt.Sprintf("%q %d times in its log", bad, n))
		}
	}
	return out
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// webhook is tally's webhook process, registered with failurePolicy
// Ignore for each seed's namespace: while it is down, pods are admitted
// without tally's keys or the tracking finalizer, and the replicas' sweeps
// stamp them.
type webhook struct {
	dir, config, kubeconfig, certDir string
	ca                               []byte
	port                             int

	mu   sync.Mutex
	proc *process.Process
}

func startWebhook(t *testing.T, config string) *webhook {
	ca, err := devcert.NewCA("tally robustness CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	w := &webhook{dir: t.TempDir(), config: config, ca: ca.CertPEM}
	w.certDir = filepath.Join(w.dir, "certs")
	require.NoError(t, pair.WriteDir(w.certDir))
	api, err := framework.NewAPIProxy(env.Config)
	require.NoError(t, err)
	t.Cleanup(api.Close)
	w.kubeconfig = filepath.Join(w.dir, "webhook.kubeconfig")
	require.NoError(t, framework.WriteKubeconfig(api.Addr(), w.kubeconfig))
	w.port, err = process.FreePort()
	require.NoError(t, err)
	w.start(t)
	t.Cleanup(func() { w.stop(t) })
	return w
}

// register registers the webhook for ns's pods, as the chart does but with
// failurePolicy Ignore, until the test ends.
func (w *webhook) register(t *testing.T, ns string) {
	cfg, err := config.Load(w.config)
	require.NoError(t, err)
	env.RegisterWebhook(t, cfg, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", w.port, mutate.Path)), CABundle: w.ca,
	}, ns, admissionregistrationv1.Ignore)
	// The API server picks the registration up asynchronously; pods
	// admitted before are unstamped, as in an outage.
	time.Sleep(time.Second)
}

// start starts the process and waits until it serves.
func (w *webhook) start(t *testing.T) {
	w.mu.Lock()
	defer w.mu.Unlock()
	probe, err := process.FreePort()
	require.NoError(t, err)
	p, err := process.Start("webhook", filepath.Join(bin, "webhook"), w.dir,
		"--config", w.config, "--kubeconfig", w.kubeconfig, "--cert-dir", w.certDir,
		"--host", "127.0.0.1", "--port", strconv.Itoa(w.port), "--shutdown-delay", "0s",
		"--metrics-bind-address", "0", "--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", probe))
	if err != nil {
		t.Errorf("starting the webhook: %v", err)
		return
	}
	w.proc = p
	if err := p.WaitReady(context.Background(), fmt.Sprintf("http://127.0.0.1:%d/readyz", probe)); err != nil {
		t.Errorf("the webhook never became ready: %v; its log (end):\n%s", err, tail(p.LogPath(), 40))
	}
}

// stop stops the process (SIGTERM).
func (w *webhook) stop(t *testing.T) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.proc == nil {
		return
	}
	if err := w.proc.Stop(); err != nil {
		t.Errorf("the webhook: %v; its log (end):\n%s", err, tail(w.proc.LogPath(), 40))
	}
	w.proc = nil
}
