package totals

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// ending is how a pod finishes.
type ending int

const (
	succeeded      ending = iota // phase Succeeded
	failed                       // phase Failed
	deletedRunning               // deleted while Running
	deletedPending               // deleted before it ever ran
	endings
)

func (e ending) String() string {
	return [...]string{"succeeded", "failed", "deleted while running", "deleted while pending"}[e]
}

// mark sets the pod's completion intent, as an operator does: one merge
// patch of that annotation.
func mark(ctx context.Context, pod *corev1.Pod) error {
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent)
	return env.Client.Patch(ctx, pod.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(patch)))
}

// markTooLate marks a pod that has finished, as an operator working from a
// list taken before the pod's end does: the webhook must refuse it (or the
// pod is gone already), so that the pod's end stays unexpected.
func markTooLate(ctx context.Context, pod *corev1.Pod) error {
	err := mark(ctx, pod)
	switch {
	case err == nil:
		return fmt.Errorf("an intent set on %s after it finished was admitted", pod.Name)
	case apierrors.IsNotFound(err):
		return nil
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "cannot be set on a pod that has finished"):
		return nil
	}
	return fmt.Errorf("marking %s after it finished: %w", pod.Name, err)
}

// finish ends a pod as the kubelet and its operator would: the intent first
// when it has one, then the ending; without one, the operator then tries to
// mark the pod it had picked before it ended.
func finish(ctx context.Context, pod *corev1.Pod, e ending, intent bool) error {
	c := env.Client
	if intent {
		if err := mark(ctx, pod); err != nil {
			return fmt.Errorf("marking %s: %w", pod.Name, err)
		}
	}
	phase := func(p corev1.PodPhase) error {
		patch := fmt.Sprintf(`{"status":{"phase":%q}}`, p)
		return c.Status().Patch(ctx, pod.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(patch)))
	}
	var err error
	switch e {
	case succeeded:
		err = phase(corev1.PodSucceeded)
	case failed:
		err = phase(corev1.PodFailed)
	case deletedRunning:
		if err = phase(corev1.PodRunning); err == nil {
			err = c.Delete(ctx, pod.DeepCopy())
		}
	case deletedPending:
		err = c.Delete(ctx, pod.DeepCopy())
	}
	if err != nil {
		return fmt.Errorf("ending %s (%s): %w", pod.Name, e, err)
	}
	if !intent {
		return markTooLate(ctx, pod)
	}
	return nil
}

// want is the totals a pool must end with.
type want struct{ completed, unexpected int64 }

// finishInBursts ends every pod, in bursts of 10 to 40 pods finished four
// at a time with pauses of up to 0.8 s between bursts, each pod with an
// ending and an intent spread evenly over the pods. It returns the totals
// each pool must show, and sends its first error to errs.
func finishInBursts(pods map[string][]*corev1.Pod, rng *rand.Rand, errs chan<- error) map[string]want {
	type job struct {
		pod    *corev1.Pod
		ending ending
		intent bool
	}
	var jobs []job
	wants := map[string]want{}
	for pool, list := range pods {
		w := wants[pool]
		for i, p := range list {
			j := job{pod: p, ending: ending(i % int(endings)), intent: (i/int(endings))%2 == 0}
			if j.intent {
				w.completed++
			} else {
				w.unexpected++
			}
			jobs = append(jobs, j)
		}
		wants[pool] = w
	}
	rng.Shuffle(len(jobs), func(i, j int) { jobs[i], jobs[j] = jobs[j], jobs[i] })

	go func() {
		defer close(errs)
		ctx := context.Background()
		for len(jobs) > 0 {
			n := min(len(jobs), 10+rng.IntN(31))
			burst := jobs[:n]
			jobs = jobs[n:]
			work := make(chan job)
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					for j := range work {
						if err := finish(ctx, j.pod, j.ending, j.intent); err != nil {
							errs <- err
						}
					}
				})
			}
			for _, j := range burst {
				work <- j
			}
			close(work)
			wg.Wait()
			time.Sleep(time.Duration(rng.IntN(800)) * time.Millisecond)
		}
	}()
	return wants
}

// settles waits until every pool shows its totals with an empty ledger and
// no pod of ns carries the finalizer, then checks that no total ever went
// down or past its final value.
func settles(t *testing.T, ns string, wants map[string]want, seen *framework.TotalsHistory, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for pool, w := range wants {
		for {
			c, u, ledger := totals(t, ns, pool)
			if c == w.completed && u == w.unexpected && ledger == 0 {
				break
			}
			require.True(t, time.Now().Before(deadline), "%s: completedTotal %d (want %d), unexpectedTotal %d (want %d), ledger %d",
				pool, c, w.completed, u, w.unexpected, ledger)
			time.Sleep(100 * time.Millisecond)
		}
	}
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, time.Until(deadline)+time.Second, 100*time.Millisecond,
		"pods still carrying %s: %v", keys.TrackingFinalizer, withFinalizer(t, ns))
	for pool, w := range wants {
		var last [2]int64
		for _, s := range seen.Of(pool) {
			assert.True(t, s[0] >= last[0] && s[1] >= last[1], "%s: totals went down from %v to %v", pool, last, s)
			assert.True(t, s[0] <= w.completed && s[1] <= w.unexpected, "%s: totals %v past the final %v", pool, s, w)
			last = s
		}
	}
}

// scenario creates 3 pools of 100 pods through the webhook and finishes
// them all in bursts while disrupt runs (until it returns and the bursts
// are done); it returns the totals each pool must end with.
func scenario(t *testing.T, ns string, seed uint64, disrupt func(done <-chan struct{})) map[string]want {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed))
	t.Logf("seed %d", seed)
	pods := map[string][]*corev1.Pod{}
	for i := range 3 {
		name := fmt.Sprintf("pool-%d", i)
		_, pods[name] = createPool(t, ns, name, 100)
	}
	errs := make(chan error, 300)
	wants := finishInBursts(pods, rng, errs)
	done := make(chan struct{})
	go func() {
		for err := range errs {
			t.Error(err)
		}
		close(done)
	}()
	disrupt(done)
	<-done
	return wants
}

// TestTotalsSurviveKills: 300 pods finish in bursts (Succeeded, Failed,
// deleted while running, deleted while pending; with and without an
// intent) while the aggregator is killed with SIGKILL at random points and
// started again, at least 10 times: each total ends equal to the number of
// pods that finished in its class, and no pod keeps the finalizer.
func TestTotalsSurviveKills(t *testing.T) {
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	seen := framework.WatchTotals(t, env.Config, ns)
	a := startAggregator(t, "aggregator", withTotals, "")
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	kills := 0
	wants := scenario(t, ns, seed, func(done <-chan struct{}) {
		for {
			select {
			case <-done:
				if kills >= 10 {
					return
				}
			default:
			}
			time.Sleep(time.Duration(rng.IntN(1500)) * time.Millisecond)
			a.kill()
			kills++
			a.start()
		}
	})
	t.Logf("%d kills", kills)
	settles(t, ns, wants, seen, 90*time.Second)
}

// TestTotalsSurviveLeaderKill: two aggregators with leader election; the
// leader is killed mid-run (and again once the other leads): the totals
// are exact.
func TestTotalsSurviveLeaderKill(t *testing.T) {
	framework.Long(t)
	ns := namespace(t)
	leaseNS, err := env.Namespace(context.Background(), "lease")
	require.NoError(t, err)
	startWebhook(t, ns, withTotals)
	seen := framework.WatchTotals(t, env.Config, ns)
	replicas := []*aggregator{
		startAggregator(t, "a", withTotals, leaseNS),
		startAggregator(t, "b", withTotals, leaseNS),
	}
	leader := func() *aggregator {
		for _, r := range replicas {
			if r.leads() {
				return r
			}
		}
		return nil
	}
	require.Eventually(t, func() bool { return leader() != nil }, 30*time.Second, 50*time.Millisecond)
	seed := uint64(time.Now().UnixNano())
	kills := 0
	wants := scenario(t, ns, seed, func(<-chan struct{}) {
		for range 2 {
			time.Sleep(2 * time.Second)
			l := leader()
			require.NotNil(t, l)
			l.kill()
			kills++
			l.start() // as a standby: its new log shows no lease yet
			require.Eventually(t, func() bool { return leader() != nil }, 60*time.Second, 100*time.Millisecond, "no replica took the lease over")
		}
	})
	t.Logf("%d leaders killed", kills)
	settles(t, ns, wants, seen, 90*time.Second)
}

// TestIntentAfterTheEndIsRefused: an intent set on a pod that has already
// failed, succeeded or is being deleted is refused by the webhook through
// the real API server, so the pod's total is unexpectedTotal whenever the
// aggregator records it; an intent set before the end counts.
func TestIntentAfterTheEndIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	_, pods := createPool(t, ns, "pool", 4)
	const hold = "test.tally.dev/hold"
	deleting := pods[2]
	require.NoError(t, env.Client.Patch(ctx, deleting.DeepCopy(), client.RawPatch(types.MergePatchType,
		fmt.Appendf(nil, `{"metadata":{"finalizers":[%q,%q]}}`, keys.TrackingFinalizer, hold))))
	t.Cleanup(func() {
		_ = retry.RetryOnConflict(retry.DefaultRetry, func() error {
			p := &corev1.Pod{}
			if err := env.Client.Get(context.Background(), client.ObjectKeyFromObject(deleting), p); err != nil {
				return client.IgnoreNotFound(err)
			}
			p.Finalizers = slices.DeleteFunc(p.Finalizers, func(f string) bool { return f == hold })
			return env.Client.Update(context.Background(), p)
		})
	})

	require.NoError(t, finish(ctx, pods[0], failed, false))
	require.NoError(t, finish(ctx, pods[1], succeeded, false))
	require.NoError(t, finish(ctx, deleting, deletedRunning, false))
	require.NoError(t, finish(ctx, pods[3], failed, true))
	// Refused, not merely gone: the held pod is still there, being deleted.
	err := mark(ctx, deleting)
	require.Error(t, err)
	assert.True(t, apierrors.IsForbidden(err), "%v", err)
	assert.ErrorContains(t, err, "its deletion was requested")

	for _, p := range pods[:3] {
		got := &corev1.Pod{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(p), got))
		assert.NotContains(t, got.Annotations, keys.CompletionIntent, "pod %s", p.Name)
	}
	// Recorded only now, after the marks: the classes were decided when
	// the pods finished.
	startAggregator(t, "aggregator", withTotals, "")
	require.Eventually(t, func() bool {
		c, u, ledger := totals(t, ns, "pool")
		return c == 1 && u == 3 && ledger == 0
	}, 30*time.Second, 50*time.Millisecond, "totals of the pool")
}

// blockStatusWrites makes the API server refuse every write to the status
// of the WorkerPools of ns, as a policy or an outage of the path would, until
// the returned function is called.
func blockStatusWrites(t *testing.T, ns string) (unblock func()) {
	t.Helper()
	ctx := context.Background()
	name := "block-status-" + ns
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{operator.GVK.Group}, APIVersions: []string{"*"},
						Resources: []string{"workerpools/status"}},
				},
			}}},
			Validations: []admissionregistrationv1.Validation{{Expression: "false", Message: "status writes blocked by the test"}},
		},
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny},
			MatchResources: &admissionregistrationv1.MatchResources{NamespaceSelector: &metav1.LabelSelector{
				MatchLabels: map[string]string{corev1.LabelMetadataName: ns},
			}},
		},
	}
	require.NoError(t, env.Client.Create(ctx, policy))
	require.NoError(t, env.Client.Create(ctx, binding))
	// The API server picks policies up asynchronously.
	require.Eventually(t, func() bool {
		pool := operator.Pool(ns, "probe-"+ns, 0)
		if err := env.Client.Create(ctx, pool); err != nil && !apierrors.IsAlreadyExists(err) {
			return false
		}
		patch := client.RawPatch(types.MergePatchType, []byte(`{"status":{"active":0}}`))
		err := env.Client.Status().Patch(ctx, pool, patch)
		return err != nil && strings.Contains(err.Error(), "status writes blocked by the test")
	}, 30*time.Second, 100*time.Millisecond, "the policy never took effect")
	unblock = func() {
		_ = env.Client.Delete(context.Background(), binding)
		_ = env.Client.Delete(context.Background(), policy)
	}
	t.Cleanup(unblock)
	return unblock
}

// TestAwayLongerThanTheGrace: the aggregator is away for three times
// --tracking-grace while 50 tracked pods are deleted; when it comes back,
// its status writes are refused for a few seconds more. Every pod is
// counted: the grace runs only while the aggregator could record the pods.
func TestAwayLongerThanTheGrace(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	const grace = 8 * time.Second
	_, pods := createPool(t, ns, "pool", 50)
	for _, p := range pods {
		require.NoError(t, env.Client.Delete(ctx, p.DeepCopy()))
	}
	time.Sleep(3 * grace)
	unblock := blockStatusWrites(t, ns)
	startAggregator(t, "aggregator", withTotals, "", "--tracking-grace", grace.String())
	time.Sleep(3 * time.Second)
	unblock()
	require.Eventually(t, func() bool {
		c, u, ledger := totals(t, ns, "pool")
		return c == 0 && u == 50 && ledger == 0 && len(withFinalizer(t, ns)) == 0
	}, 60*time.Second, 100*time.Millisecond, "every pod deleted while the aggregator was away is counted")
}

// TestAwayOnABusyCluster: the aggregator is away for 4 graces (of 5 s)
// while the pods of 30 pools, 2 each, are deleted, and comes back on a busy
// cluster's budget (3 requests a second, one parent at a time), so that the
// last parents' records wait a while in its client's rate limiter. Every
// pod is recorded: a pod past the hold limit is released uncounted only
// once its parent's reconcile tried to record it and could not, not after a
// time spent waiting in the rate limiter.
func TestAwayOnABusyCluster(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	const grace, pools = 5 * time.Second, 30
	var pods []*corev1.Pod
	for i := range pools {
		_, p := createPool(t, ns, fmt.Sprintf("pool-%02d", i), 2)
		pods = append(pods, p...)
	}
	for _, p := range pods {
		require.NoError(t, env.Client.Delete(ctx, p.DeepCopy()))
	}
	time.Sleep(4 * grace)
	startAggregator(t, "aggregator", withTotals, "", "--tracking-grace", grace.String(),
		"--kube-api-qps", "3", "--kube-api-burst", "3", "--max-concurrent-reconciles", "1")
	var wrong []string
	counted := func() bool {
		wrong = nil
		for i := range pools {
			name := fmt.Sprintf("pool-%02d", i)
			if c, u, ledger := totals(t, ns, name); c != 0 || u != 2 || ledger != 0 {
				wrong = append(wrong, fmt.Sprintf("%s: completed %d, unexpected %d, ledger %d", name, c, u, ledger))
			}
		}
		return len(wrong) == 0 && len(withFinalizer(t, ns)) == 0
	}
	assert.Eventually(t, counted, 3*time.Minute, time.Second,
		"pods deleted while the aggregator was away, not all counted, or still held")
	assert.Empty(t, wrong)
	assert.Empty(t, withFinalizer(t, ns))
}

// TestGraceRunsWhileTheViewIsStale: a finished pod that cannot be recorded
// (the pool's status writes refused) is held; then the aggregator's pod
// lists and watches are answered 429 for 40 s, so its pod view is stale.
// The grace (4 s) keeps running: the pod is released, as lost, within
// seconds of its grace, while the view is still stale, after live reads of
// the pod and of the ledger.
func TestGraceRunsWhileTheViewIsStale(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	_, pods := createPool(t, ns, "pool", 1)
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "aggregator.kubeconfig"))
	require.NoError(t, err)
	var breaker framework.WatchBreaker
	breaker.Wrap(cfg)
	const grace, throttled = 4 * time.Second, 40 * time.Second
	startAggregator(t, "aggregator", withTotals, "", "--tracking-grace", grace.String(), "--kubeconfig", framework.ProxiedKubeconfig(t, cfg))
	require.Eventually(t, func() bool {
		v, err := env.StatusCount(ctx, operator.GVK, ns, "pool", "status", "completing")
		return err == nil && v == 0
	}, 30*time.Second, 100*time.Millisecond, "the pool was never reconciled")

	unblock := blockStatusWrites(t, ns)
	defer unblock()
	require.NoError(t, env.Client.Delete(ctx, pods[0].DeepCopy()))
	deleted := time.Now()
	time.Sleep(time.Second) // the aggregator sees the pod held
	breaker.Throttle(true)
	defer breaker.Throttle(false)
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, throttled-2*time.Second, 200*time.Millisecond,
		"the pod was held while the pod view was stale, past its grace of %s", grace)
	t.Logf("pod released %s after it was deleted, the pod view stale (grace %s)", time.Since(deleted).Round(100*time.Millisecond), grace)
}

// TestHeldAtMostAcrossRestarts: the pool's status writes are refused, so
// no pod can be recorded, and the aggregator is killed and started again
// every 8 s, so that no process lives long enough to use a whole grace (8
// s). The pods are released all the same, as lost, within the hold limit
// (5 graces after their finish, as the pods show it) and a quarter of a
// grace run in one process; before, each process started the grace anew
// and they were held forever.
func TestHeldAtMostAcrossRestarts(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	const grace = 8 * time.Second
	_, pods := createPool(t, ns, "pool", 10)
	unblock := blockStatusWrites(t, ns)
	defer unblock()
	for _, p := range pods {
		require.NoError(t, env.Client.Delete(ctx, p.DeepCopy()))
	}
	deleted := time.Now()
	a := startAggregator(t, "aggregator", withTotals, "", "--tracking-grace", grace.String())
	for time.Since(deleted) < 5*grace+20*time.Second && len(withFinalizer(t, ns)) > 0 {
		time.Sleep(8 * time.Second)
		a.kill()
		a.start()
	}
	require.Empty(t, withFinalizer(t, ns), "pods held %s after they were deleted, under an aggregator restarted every 8 s", time.Since(deleted).Round(time.Second))
	t.Logf("every pod released %s after it was deleted (hold limit %s)", time.Since(deleted).Round(time.Second), 5*grace)
	c, u, ledger := totals(t, ns, "pool")
	assert.Equal(t, [3]int64{0, 0, 0}, [3]int64{c, u, int64(ledger)}, "nothing could be recorded: the pods are lost, not counted")
}

// TestTrackingFinalizerCannotComeBack: a pod recorded and released cannot
// be given the tracking finalizer back by an ordinary UPDATE (it would be
// recorded a second time): the chart's policy refuses it.
func TestTrackingFinalizerCannotComeBack(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	startAggregator(t, "aggregator", withTotals, "")
	_, pods := createPool(t, ns, "pool", 1)
	require.NoError(t, finish(ctx, pods[0], failed, false))
	released := &corev1.Pod{}
	require.Eventually(t, func() bool {
		_, u, ledger := totals(t, ns, "pool")
		require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pods[0]), released))
		return u == 1 && ledger == 0 && !slices.Contains(released.Finalizers, keys.TrackingFinalizer)
	}, 30*time.Second, 50*time.Millisecond, "the pod is recorded and released")

	released.Finalizers = append(released.Finalizers, keys.TrackingFinalizer)
	err := env.Client.Update(ctx, released)
	require.Error(t, err, "the finalizer was put back on a pod already recorded")
	assert.ErrorContains(t, err, "the finalizer tally.dev/tracking is added only by tally")
	time.Sleep(2 * time.Second)
	_, u, _ := totals(t, ns, "pool")
	assert.Equal(t, int64(1), u)
}

// TestParentDeletedWithTrackedPods: a pool is deleted while its pods (some
// running, some finished and recorded) carry the finalizer. The garbage
// collector does not run here, so the test deletes the pods as it would:
// none is stranded.
func TestParentDeletedWithTrackedPods(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	startAggregator(t, "aggregator", withTotals, "")
	uid, pods := createPool(t, ns, "pool", 20)
	for _, p := range pods[:5] {
		require.NoError(t, finish(ctx, p, failed, false))
	}
	require.Eventually(t, func() bool { _, u, _ := totals(t, ns, "pool"); return u == 5 }, 30*time.Second, 50*time.Millisecond)

	require.NoError(t, env.Client.Delete(ctx, operator.Pool(ns, "pool", 0)))
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, 30*time.Second, 50*time.Millisecond,
		"pods of a deleted parent keep %s: %v", keys.TrackingFinalizer, withFinalizer(t, ns))
	require.Eventually(t, func() bool { return warned(t, ns, "TrackingReleasedOrphan", "Pod") }, 10*time.Second, 100*time.Millisecond,
		"no Warning Event on the pods released")
	// The garbage collector's part.
	for _, p := range pods {
		require.NoError(t, client.IgnoreNotFound(env.Client.Delete(ctx, p.DeepCopy())))
	}
	require.Eventually(t, func() bool {
		var list corev1.PodList
		require.NoError(t, env.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{keys.ParentUID: string(uid)}))
		return len(list.Items) == 0
	}, 30*time.Second, 50*time.Millisecond, "a pod of the deleted parent could not be deleted")
}

// TestKindOptedOut: once a kind stops keeping totals (its totals unmapped,
// or the kind removed from the configuration), the finalizers its pods
// carry disappear when the aggregator starts with the new configuration.
func TestKindOptedOut(t *testing.T) {
	for name, cfg := range map[string]string{"totals unmapped": withoutTotals, "kind removed": kindRemoved} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t)
			startWebhook(t, ns, withTotals)
			_, pods := createPool(t, ns, "pool", 10)
			require.NoError(t, finish(ctx, pods[0], deletedRunning, false))
			require.Len(t, withFinalizer(t, ns), 10, "nothing removes the finalizer before the aggregator runs")

			startAggregator(t, "aggregator", cfg, "")
			require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, 30*time.Second, 50*time.Millisecond,
				"pods of an opted-out kind keep %s: %v", keys.TrackingFinalizer, withFinalizer(t, ns))
			err := env.Client.Get(ctx, client.ObjectKeyFromObject(pods[0]), &corev1.Pod{})
			assert.True(t, apierrors.IsNotFound(err), "the pod deleted while it carried the finalizer is gone: %v", err)
			require.Eventually(t, func() bool { return warned(t, ns, "TrackingReleasedOptedOut", "WorkerPool") }, 10*time.Second, 100*time.Millisecond,
				"no Warning Event on the parent whose pods were released")
		})
	}
}

// warned reports whether a Warning Event of reason about an object of kind
// was recorded in ns.
func warned(t *testing.T, ns, reason, kind string) bool {
	t.Helper()
	var events corev1.EventList
	require.NoError(t, env.Client.List(context.Background(), &events, client.InNamespace(ns)))
	for _, e := range events.Items {
		if e.Reason == reason && e.InvolvedObject.Kind == kind && e.Type == corev1.EventTypeWarning {
			return true
		}
	}
	return false
}
