package completeness

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	aggregatorapp "tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
)

// TestInstallIntoRunningCluster: 3 parents with 200 pods each exist before
// tally (no webhook registered, no aggregator), 5 of p0's pods with a label
// a client forged for p1. Once both are installed, every value the
// aggregator ever writes equals the truth, the first included, and every
// pod ends up stamped with its own controller.
func TestInstallIntoRunningCluster(t *testing.T) {
	ns := namespace(t)
	names := []string{"p0", "p1", "p2"}
	uids := map[string]types.UID{}
	var pods []*corev1.Pod
	for _, name := range names {
		uids[name] = createPool(t, ns, name)
		pods = append(pods, podsOf(ns, name, uids[name], 0, 200)...)
	}
	for _, p := range pods[:5] {
		p.Labels = map[string]string{keys.ParentUID: string(uids["p1"])}
	}
	createAll(t, env.Client, pods)
	require.Len(t, unstamped(t, ns), 600)

	w := newWebhook(t)
	w.start(t)
	w.register(t, ns, admissionregistrationv1.Fail)
	written := record(t, ns)
	startAggregator(t, ns, time.Hour, false)

	for _, name := range names {
		converges(t, ns, name, uids[name], 60*time.Second)
	}
	stamps(t, ns)
	written.allTrue(t, ns, uids)
}

// TestCountsBeforeStamps: 2 parents with 300 unstamped pods each (running,
// with an intent, succeeded, failed, being deleted), and an aggregator whose
// client may send 5 requests a second, so that its stamps take two minutes:
// each parent's counts are right while most pods are still unstamped, every
// value written is the truth, and the stamps follow.
func TestCountsBeforeStamps(t *testing.T) {
	ns := namespace(t)
	names := []string{"p0", "p1"}
	uids := map[string]types.UID{}
	var pods []*corev1.Pod
	for _, name := range names {
		uids[name] = createPool(t, ns, name)
		for i := range 300 {
			b := builder.Pod(ns, fmt.Sprintf("%s-%03d", name, i)).ControlledBy(operator.GVK, name, uids[name]).Mixed(i)
			switch i % 5 {
			case 1:
				b = b.Phase(corev1.PodFailed)
			case 2:
				b = b.Finalizer("example.tally.dev/hold") // deleted below, kept by it
			}
			pods = append(pods, b.Build())
		}
	}
	createAll(t, env.Client, pods)
	for _, p := range pods {
		if slices.Contains(p.Finalizers, "example.tally.dev/hold") {
			require.NoError(t, env.Client.Delete(context.Background(), p.DeepCopy()))
			t.Cleanup(func() { releaseHold(t, p) })
		}
	}

	written := record(t, ns)
	runAggregator(t, &config.Config{Parents: workerPools}, aggregatorapp.Options{
		MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Hour, QPS: 5, Burst: 5,
	})
	for _, name := range names {
		converges(t, ns, name, uids[name], 60*time.Second)
	}
	assert.Greater(t, len(unstamped(t, ns)), 300, "the counts are right before most stamps are written")
	written.allTrue(t, ns, uids)
	// The stamps keep coming, and the counts stay right as they land.
	before := len(unstamped(t, ns))
	require.Eventually(t, func() bool { return len(unstamped(t, ns)) < before-20 }, 30*time.Second, 500*time.Millisecond)
	for _, name := range names {
		converges(t, ns, name, uids[name], 10*time.Second)
	}
	written.allTrue(t, ns, uids)
}

// TestSweepFollowsTheNamespaceSelector: the sweep stamps the pods of the
// namespaces the configured namespaceSelector selects, and never those of
// the others.
func TestSweepFollowsTheNamespaceSelector(t *testing.T) {
	in, out := namespace(t), namespace(t)
	ctx := context.Background()
	nsObj := &corev1.Namespace{}
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: out}, nsObj))
	nsObj.Labels["tally.example/excluded"] = "true"
	require.NoError(t, env.Client.Update(ctx, nsObj))

	inUID, outUID := createPool(t, in, "pool"), createPool(t, out, "pool")
	createAll(t, env.Client, append(podsOf(in, "pool", inUID, 0, 20), podsOf(out, "pool", outUID, 0, 20)...))
	selector := config.DefaultNamespaceSelector()
	selector.MatchExpressions = append(selector.MatchExpressions,
		metav1.LabelSelectorRequirement{Key: "tally.example/excluded", Operator: metav1.LabelSelectorOpDoesNotExist})
	runAggregator(t, &config.Config{Parents: workerPools, NamespaceSelector: selector}, aggregatorapp.Options{
		MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Second, QPS: 50, Burst: 100,
	})
	converges(t, in, "pool", inUID, 30*time.Second)
	require.Eventually(t, func() bool { return len(unstamped(t, in)) == 0 }, 30*time.Second, 200*time.Millisecond)
	time.Sleep(3 * time.Second) // more sweeps
	assert.Len(t, unstamped(t, out), 20, "no pod of the excluded namespace is stamped")
	var pods corev1.PodList
	require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(out)))
	for _, p := range pods.Items {
		assert.Empty(t, p.Finalizers, "pod %s", p.Name)
	}
	assert.Equal(t, int64(0), shown(t, out, "pool")[config.Active], "the excluded namespace's pods are not counted")
}

// TestTrackingFollowsTheNamespaceSelector: in a namespace the
// namespaceSelector leaves out, a parent's pods stamped by their operator
// are counted but never given the tracking finalizer, and a pod carrying it
// is released with a Warning Event on the parent; once the namespace's
// labels bring it into the selector, its running pods are tracked.
func TestTrackingFollowsTheNamespaceSelector(t *testing.T) {
	ctx := context.Background()
	out := namespace(t)
	exclude := func(excluded bool) {
		nsObj := &corev1.Namespace{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: out}, nsObj))
		if excluded {
			nsObj.Labels["tally.example/excluded"] = "true"
		} else {
			delete(nsObj.Labels, "tally.example/excluded")
		}
		require.NoError(t, env.Client.Update(ctx, nsObj))
	}
	exclude(true)
	uid := createPool(t, out, "pool")
	stamped := func(name string) *builder.PodBuilder {
		// As the webhook stamps: the aggregator tracks only such pods.
		return builder.Pod(out, name).ControlledBy(operator.GVK, "pool", uid).
			Label(keys.ParentUID, string(uid)).Label(keys.ParentName, "pool").
			Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool")
	}
	names := []string{"run-0", "run-1", "held"}
	createAll(t, env.Client, []*corev1.Pod{stamped(names[0]).Build(), stamped(names[1]).Build(),
		stamped(names[2]).Finalizer(keys.TrackingFinalizer).Build()})
	tracked := func() []string {
		var pods corev1.PodList
		require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(out)))
		var names []string
		for _, p := range pods.Items {
			if slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
				names = append(names, p.Name)
			}
		}
		return names
	}

	selector := only(out)
	selector.MatchExpressions = append(selector.MatchExpressions,
		metav1.LabelSelectorRequirement{Key: "tally.example/excluded", Operator: metav1.LabelSelectorOpDoesNotExist})
	pools := []config.Parent{helm.WorkerPool(append(config.Counts, config.Totals...)...)}
	runAggregator(t, &config.Config{Parents: pools, NamespaceSelector: selector}, aggregatorapp.Options{
		MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Minute, QPS: 50, Burst: 100,
	})
	require.Eventually(t, func() bool { return shown(t, out, "pool")[config.Active] == 3 }, 30*time.Second, 200*time.Millisecond,
		"the pods their operator stamped are counted, whatever the namespace")
	require.Eventually(t, func() bool { return len(tracked()) == 0 }, 30*time.Second, 200*time.Millisecond,
		"the pod carrying the finalizer is released: %v", tracked())
	// Events are sent asynchronously, after the release.
	assert.Eventually(t, func() bool {
		var events eventsv1.EventList
		require.NoError(t, env.Client.List(ctx, &events, client.InNamespace(out)))
		return slices.ContainsFunc(events.Items, func(e eventsv1.Event) bool {
			return e.Reason == "TrackingReleasedOutOfScope" && e.Regarding.UID == uid && strings.Contains(e.Note, "held")
		})
	}, 10*time.Second, 100*time.Millisecond, "a Warning Event on the parent names the released pod")
	assert.Empty(t, tracked(), "no pod of a namespace out of scope gets the finalizer")

	exclude(false)
	require.Eventually(t, func() bool { return len(tracked()) == len(names) }, 30*time.Second, 200*time.Millisecond,
		"once in scope, its running pods are tracked: %v", tracked())
}

// releaseHold removes the test's finalizer from pod, so that its deletion
// completes.
func releaseHold(t *testing.T, pod *corev1.Pod) {
	patch := []byte(`{"metadata":{"$deleteFromPrimitiveList/finalizers":["example.tally.dev/hold"]}}`)
	err := env.Client.Patch(context.Background(), pod.DeepCopy(), client.RawPatch(types.StrategicMergePatchType, patch))
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("releasing %s: %v", pod.Name, err)
	}
}

// TestOutageUnderIgnore: pods admitted unstamped while the webhook is down
// under failurePolicy Ignore are counted within one backfill interval.
func TestOutageUnderIgnore(t *testing.T) {
	ns := namespace(t)
	w := newWebhook(t)
	w.start(t)
	w.register(t, ns, admissionregistrationv1.Ignore)
	startAggregator(t, ns, 3*time.Second, false)

	uid := createPool(t, ns, "pool")
	createAll(t, env.Client, podsOf(ns, "pool", uid, 0, 10))
	converges(t, ns, "pool", uid, 30*time.Second)

	w.stop()
	createAll(t, env.Client, podsOf(ns, "pool", uid, 10, 50))
	require.Len(t, unstamped(t, ns), 50, "pods admitted while the webhook is down are not stamped")
	w.start(t)

	converges(t, ns, "pool", uid, 15*time.Second)
	stamps(t, ns)
	assert.Equal(t, int64(60), sum(listTruth(t, ns, uid)))
	// Intents set while the webhook was down are recorded as first seen by
	// the sweep, by no one observed, on the pods running then; on a pod
	// that had finished, the intent is not admitted.
	got := &corev1.Pod{}
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "pool-013"}, got))
	assert.Equal(t, mutate.UnobservedRequester, got.Annotations[keys.CompletionIntentBy])
	assert.NotEmpty(t, got.Annotations[keys.CompletionIntentAt])
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "pool-010"}, got))
	assert.Equal(t, corev1.PodSucceeded, got.Status.Phase)
	assert.NotContains(t, got.Annotations, keys.CompletionIntent, "an intent first seen on a finished pod")
}

// TestOutageUnderFailAtStart: with failurePolicy Fail and the webhook down,
// the aggregator still stamps the pods that predate the registration: its
// own requests do not go through the webhook.
func TestOutageUnderFailAtStart(t *testing.T) {
	ns := namespace(t)
	uid := createPool(t, ns, "pool")
	createAll(t, env.Client, podsOf(ns, "pool", uid, 0, 20))

	w := newWebhook(t) // registered, never started
	w.register(t, ns, admissionregistrationv1.Fail)
	err := env.Client.Create(context.Background(), podsOf(ns, "pool", uid, 20, 1)[0])
	require.Error(t, err, "the webhook is down under Fail: a tracked pod is refused")

	startAggregator(t, ns, time.Hour, false)
	converges(t, ns, "pool", uid, 60*time.Second)
	stamps(t, ns)
}

// TestSweepVerifiesOwners: with verifyOwner the sweep stamps only pods
// whose owner exists with that UID, and reports the others.
func TestSweepVerifiesOwners(t *testing.T) {
	ns := namespace(t)
	uid := createPool(t, ns, "pool")
	createAll(t, env.Client, podsOf(ns, "pool", uid, 0, 5))
	createAll(t, env.Client, podsOf(ns, "ghost", "6d1e5b3c-0000-4000-8000-000000000000", 0, 3))

	startAggregator(t, ns, time.Hour, true)
	converges(t, ns, "pool", uid, 60*time.Second)
	require.Eventually(t, func() bool { return len(unstamped(t, ns)) == 3 }, 30*time.Second, 100*time.Millisecond)
	assert.ElementsMatch(t, []string{"ghost-000", "ghost-001", "ghost-002"}, unstamped(t, ns))
	require.Eventually(t, func() bool { return gauge(t, "tally_aggregator_unstamped_pods") == 3 }, 10*time.Second, 100*time.Millisecond)
}

// TestPolicyFencesTheAggregator: the webhook is not called for the
// aggregator's requests; the chart's policy lets it change nothing but
// tally's identity keys, only to the pod's controller, and the tracking
// finalizer.
func TestPolicyFencesTheAggregator(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	uid := createPool(t, ns, "pool")
	pod := podsOf(ns, "pool", uid, 1, 1)[0]
	require.NoError(t, env.Client.Create(ctx, pod))
	aggregator, err := client.New(aggregatorConfig, client.Options{})
	require.NoError(t, err)

	tests := []struct {
		name   string
		patch  string
		denied string
	}{
		{"another label", `{"metadata":{"labels":{"app":"x"}}}`, "may change only tally.dev/ labels and annotations"},
		{"a foreign parent", `{"metadata":{"labels":{"tally.dev/parent-uid":"not-the-controller"}}}`, "only to the pod's controller ownerReference"},
		{"the intent", `{"metadata":{"annotations":{"tally.dev/completion-intent":null}}}`, "may not set or change a completion intent"},
		{"the spec", `{"spec":{"activeDeadlineSeconds":5}}`, "may not change a pod's owners, spec, or finalizers other than tally.dev/tracking"},
		{"another finalizer", `{"metadata":{"finalizers":["example.com/keep"]}}`, "finalizers other than tally.dev/tracking"},
		{"the tracking finalizer, on a pod not stamped", `{"metadata":{"finalizers":["tally.dev/tracking"]}}`, "may add tally.dev/tracking only to a pod stamped with its controller's UID"},
		{"a requester it did not see", `{"metadata":{"annotations":{"tally.dev/completion-intent-by":"alice"}}}`, "may not set or change a completion intent"},
		{"its identity", fmt.Sprintf(`{"metadata":{"labels":{"tally.dev/parent-uid":%q,"tally.dev/parent-name":"pool"},"annotations":{"tally.dev/parent":"WorkerPool.example.tally.dev/pool"}}}`, uid), ""},
		{"the tracking finalizer, added", `{"metadata":{"finalizers":["tally.dev/tracking"]}}`, ""},
		{"the tracking finalizer, removed", `{"metadata":{"finalizers":null}}`, ""},
		{"the intent it first sees on a running pod, stamped", `{"metadata":{"annotations":{"tally.dev/completion-intent-at":"2026-12-06T10:00:00Z","tally.dev/completion-intent-by":"system:tally:unobserved"}}}`, ""},
		{"an admitted intent's stamps", `{"metadata":{"annotations":{"tally.dev/completion-intent-at":"2026-12-06T11:00:00Z"}}}`, "never changing an admitted intent's stamps"},
		{"an admitted intent, on a pod that has finished", `{"metadata":{"annotations":{"tally.dev/completion-intent":null}}}`, "may remove one only when tally did not admit it"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if strings.Contains(tc.name, "has finished") {
				require.NoError(t, env.Client.Status().Patch(ctx, pod.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(`{"status":{"phase":"Failed"}}`))))
			}
			err := aggregator.Patch(ctx, pod.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(tc.patch)))
			if tc.denied == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.denied)
		})
	}
	got := &corev1.Pod{}
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pod), got))
	assert.Equal(t, string(uid), got.Labels[keys.ParentUID])
	assert.NotContains(t, got.Labels, "app")
}

func sum(counts map[config.Count]int64) int64 {
	var n int64
	for _, v := range counts {
		n += v
	}
	return n
}

func gauge(t *testing.T, name string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}

// TestSubresourcesCannotChangeTallyKeys: pods/status and pods/binding,
// which the mutating webhook does not see, cannot change tally's keys, and
// a finished pod stays finished; an ordinary status update of a tracked pod
// passes.
func TestSubresourcesCannotChangeTallyKeys(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	w := newWebhook(t)
	w.start(t)
	w.register(t, ns, admissionregistrationv1.Fail)
	uid := createPool(t, ns, "pool")
	pod := podsOf(ns, "pool", uid, 0, 1)[0] // carries an intent
	require.NoError(t, env.Client.Create(ctx, pod))
	require.NotEmpty(t, pod.Annotations[keys.CompletionIntentAt])

	status := func(patch string) error {
		return env.Client.Status().Patch(ctx, pod.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(patch)))
	}
	tests := []struct {
		name, patch, denied string
	}{
		{"remove the intent", `{"metadata":{"annotations":{"tally.dev/completion-intent":null}}}`, "annotations (identity, completion intent and its stamps) cannot be changed through pods/status"},
		{"forge -by", `{"metadata":{"annotations":{"tally.dev/completion-intent-by":"someone"}}}`, "cannot be changed through pods/status"},
		{"forge the parent", `{"metadata":{"labels":{"tally.dev/parent-uid":"forged"}}}`, "tally.dev/ labels cannot be changed through pods/status"},
		{"add the tracking finalizer", `{"metadata":{"finalizers":["tally.dev/tracking"]}}`, "finalizer tally.dev/tracking cannot be added or removed through pods/status"},
		{"an ordinary status update", `{"status":{"phase":"Running"}}`, ""},
		{"another annotation", `{"metadata":{"annotations":{"example.com/note":"x"}}}`, ""},
		{"the pod fails", `{"status":{"phase":"Failed"}}`, ""},
		{"a failed pod runs again", `{"status":{"phase":"Running"}}`, "a pod that has finished (phase Failed) cannot return to another phase"},
		{"a failed pod succeeds", `{"status":{"phase":"Succeeded"}}`, "cannot return to another phase"},
		{"a failed pod's status is updated", `{"status":{"message":"evicted"}}`, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := status(tc.patch)
			if tc.denied == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.denied)
		})
	}

	unbound := podsOf(ns, "pool", uid, 1, 1)[0]
	require.NoError(t, env.Client.Create(ctx, unbound))
	binding := &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: unbound.Name, Namespace: ns, Annotations: map[string]string{keys.CompletionIntentBy: "scheduler"}},
		Target:     corev1.ObjectReference{Kind: "Node", Name: "node-1"},
	}
	err := env.Client.SubResource("binding").Create(ctx, unbound, binding)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot be changed through pods/binding")
	binding.Annotations = nil
	require.NoError(t, env.Client.SubResource("binding").Create(ctx, unbound, binding), "a binding without tally's keys")
}
