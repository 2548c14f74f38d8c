package aggregator

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/test/builder"
)

// customPools is the WorkerPool kind with its four counts and two custom
// ones: ready guards the field a new pod lacks, restarted does not (an
// evaluation error, which counts as no match).
var customPools = config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: allCounts,
	CustomCounts: []config.CustomCount{
		{Name: "ready", Path: "status.ready", Expression: `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`},
		{Name: "restarted", Path: "status.restarted", Expression: `pod.status.containerStatuses.exists(s, s.restartCount > 0)`},
	}}

// customFields are the fields a write of customPools holds, and the truth
// of them.
type customFields struct{ ready, restarted, active int64 }

// customTruth counts pods as the expressions define, written here in Go:
// the pods of uid whose Ready condition is True, and those with a
// container that restarted; and the active ones, for the built-in counts.
func customTruth(pods []corev1.Pod, uid string) customFields {
	var f customFields
	for _, p := range pods {
		if ref := metav1.GetControllerOf(&p); ref == nil || string(ref.UID) != uid {
			continue
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				f.ready++
			}
		}
		for _, s := range p.Status.ContainerStatuses {
			if s.RestartCount > 0 {
				f.restarted++
				break
			}
		}
		if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed && p.DeletionTimestamp == nil {
			f.active++
		}
	}
	return f
}

func writtenFields(u *unstructured.Unstructured) (customFields, bool) {
	var f customFields
	var found [3]bool
	f.ready, found[0], _ = unstructured.NestedInt64(u.Object, "status", "ready")
	f.restarted, found[1], _ = unstructured.NestedInt64(u.Object, "status", "restarted")
	f.active, found[2], _ = unstructured.NestedInt64(u.Object, "status", "active")
	return f, found[0] && found[1] && found[2]
}

// setStatus gives pod a Ready condition and one container with restarts,
// as the kubelet would.
func setStatus(ctx context.Context, pod *corev1.Pod, ready bool, restarts int32) error {
	patch := client.MergeFrom(pod.DeepCopy())
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}
	pod.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "worker", Image: "worker", RestartCount: restarts}}
	return env.Client.Status().Patch(ctx, pod, patch)
}

// TestCustomCountsEqualTheTruth: a kind with two custom counts. Started on
// existing pods, the aggregator's every write equals a fresh List counted
// by the expressions' definitions; then, under a churn of conditions,
// restart counts, new pods (without statuses) and deletions, each write
// equals the truth at some point of the 5 s before it was seen (the churn
// is sequential: the test knows every state the API server went through,
// each as soon as the API server answered it),
// and the counts end equal to a fresh List.
func TestCustomCountsEqualTheTruth(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	rng := rand.New(rand.NewPCG(61, 1))
	var pods []*corev1.Pod
	for i := range 120 {
		pods = append(pods, member(operator.GVK, ns, "pool", uid, fmt.Sprintf("w-%03d", i)).Build())
	}
	createAll(t, pods)
	for _, p := range pods[:100] {
		require.NoError(t, setStatus(ctx, p, rng.IntN(2) == 0, int32(rng.IntN(3))))
	}

	// Every write, as a watch of the pool sees it.
	w := watchPools(t, ns)
	type seen struct {
		at     time.Time
		fields customFields
	}
	var mu sync.Mutex
	var writes []seen
	go func() {
		for ev := range w.ResultChan() {
			if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Deleted {
				if f, ok := writtenFields(u); ok {
					mu.Lock()
					if len(writes) == 0 || writes[len(writes)-1].fields != f {
						writes = append(writes, seen{time.Now(), f})
					}
					mu.Unlock()
				}
			}
		}
	}()
	truthNow := func() customFields {
		var list corev1.PodList
		require.NoError(t, env.Client.List(ctx, &list, client.InNamespace(ns)))
		return customTruth(list.Items, string(uid))
	}
	settled := func() customFields {
		want := truthNow()
		var got customFields
		ok := waitFor(60*time.Second, func() bool {
			u := &unstructured.Unstructured{}
			u.SetGroupVersionKind(operator.GVK)
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pool"}, u))
			got, _ = writtenFields(u)
			return got == want
		})
		require.True(t, ok, "pool shows %+v, a fresh List says %+v", got, want)
		return want
	}

	startAggregator(t, []config.Parent{customPools}, nil)
	before := settled()
	assert.Positive(t, before.ready)
	assert.Positive(t, before.restarted)
	// The watch delivers the write a moment after a Get shows it.
	require.True(t, waitFor(10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(writes) > 0 && writes[len(writes)-1].fields == before
	}), "the pool watch never saw the settled write")
	mu.Lock()
	for i, s := range writes {
		assert.Equal(t, before, s.fields, "write %d, before any pod changed: only the truth may be written", i)
	}
	mu.Unlock()

	// The churn, one change at a time; truths holds the state after each.
	type truthAt struct {
		at     time.Time
		fields customFields
	}
	truths := []truthAt{{time.Now(), before}}
	live := map[string]*corev1.Pod{}
	for _, p := range pods {
		live[p.Name] = p
	}
	state := map[string]*corev1.Pod{}
	var list corev1.PodList
	require.NoError(t, env.Client.List(ctx, &list, client.InNamespace(ns)))
	for i := range list.Items {
		state[list.Items[i].Name] = &list.Items[i]
	}
	next := 120
	for range 400 {
		names := make([]string, 0, len(live))
		for name := range live {
			names = append(names, name)
		}
		name := names[rng.IntN(len(names))]
		pod := state[name]
		switch op := rng.IntN(10); {
		case op < 6:
			require.NoError(t, setStatus(ctx, pod, rng.IntN(2) == 0, int32(rng.IntN(3))))
		case op < 8:
			p := member(operator.GVK, ns, "pool", uid, fmt.Sprintf("w-%03d", next)).Build()
			next++
			require.NoError(t, env.Client.Create(ctx, p))
			live[p.Name], state[p.Name] = p, p
		default:
			require.NoError(t, env.Client.Delete(ctx, pod))
			delete(live, name)
			// The API server marks the pod terminating, then (for a pod no
			// kubelet runs) removes it: two states.
			terminating := pod.DeepCopy()
			terminating.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			state[name] = terminating
			truths = append(truths, truthAt{time.Now(), customTruth(podsOf(state), string(uid))})
			gone := &corev1.Pod{}
			if err := env.Client.Get(ctx, client.ObjectKeyFromObject(pod), gone); apierrors.IsNotFound(err) {
				delete(state, name)
			} else {
				require.NoError(t, err)
				state[name] = gone
			}
		}
		truths = append(truths, truthAt{time.Now(), customTruth(podsOf(state), string(uid))})
		time.Sleep(time.Duration(rng.IntN(10)) * time.Millisecond)
	}
	after := settled()
	mu.Lock()
	defer mu.Unlock()
	checked := 0
	for _, s := range writes {
		if s.at.Before(truths[0].at) {
			continue
		}
		checked++
		// The test records a state once the API server answered the
		// change, and the aggregator may have seen it and written before
		// that answer came back: a state recorded up to a second after the
		// write is in its window too.
		matched := false
		for _, tr := range truths {
			if tr.at.After(s.at.Add(time.Second)) {
				break
			}
			if !tr.at.Before(s.at.Add(-5*time.Second)) && tr.fields == s.fields {
				matched = true
			}
		}
		// The state in force 5 s before the write is a truth of its window
		// too.
		for i := len(truths) - 1; i >= 0 && !matched; i-- {
			if truths[i].at.Before(s.at.Add(-5 * time.Second)) {
				matched = truths[i].fields == s.fields
				break
			}
		}
		assert.True(t, matched, "written %+v at %s: never the truth in the 5 s before", s.fields, s.at.Format(time.StampMilli))
	}
	assert.Positive(t, checked)
	t.Logf("%d writes during and after the churn, each the truth of the 5 s before it; settled at %+v", checked, after)
	assert.Positive(t, counter(t, "tally_aggregator_custom_count_errors_total", "restarted", "WorkerPool.example.tally.dev"),
		"restarted fails on pods without container statuses: counted")
}

// TestCustomCountKeptWhilePartial: a pod of the parent known only from a
// sweep (admitted without tally's labels) leaves the custom counts
// unknown: the value the parent shows stays (an apply without the field
// would remove it), the built-in counts are written without waiting, and
// once the pod is stamped the custom counts count it.
func TestCustomCountKeptWhilePartial(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	pods := []*corev1.Pod{member(operator.GVK, ns, "pool", uid, "a").Build(), member(operator.GVK, ns, "pool", uid, "b").Build()}
	createAll(t, pods)
	for _, p := range pods {
		require.NoError(t, setStatus(ctx, p, true, 0))
	}
	hourly := func(o *app.Options) { o.BackfillInterval = time.Hour }
	a := startAggregator(t, []config.Parent{customPools}, nil, hourly)
	get := func() customFields {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(operator.GVK)
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pool"}, u))
		f, _ := writtenFields(u)
		return f
	}
	require.True(t, waitFor(30*time.Second, func() bool { return get() == customFields{ready: 2, active: 2} }), "%+v", get())
	a.stop()

	w := watchPools(t, ns)
	var mu sync.Mutex
	var missing []string
	go func() {
		for ev := range w.ResultChan() {
			if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Deleted {
				if _, found, _ := unstructured.NestedInt64(u.Object, "status", "ready"); !found {
					mu.Lock()
					missing = append(missing, u.GetResourceVersion())
					mu.Unlock()
				}
			}
		}
	}()
	// A third pod, unlabelled (the webhook was away), ready: the sweep at
	// start-up reads its metadata only.
	unlabelled := builder.Pod(ns, "c").ControlledBy(operator.GVK, "pool", uid).Build()
	require.NoError(t, env.Client.Create(ctx, unlabelled))
	require.NoError(t, setStatus(ctx, unlabelled, true, 0))
	startAggregator(t, []config.Parent{customPools}, nil, hourly)
	require.True(t, waitFor(30*time.Second, func() bool { return get() == customFields{ready: 3, active: 3} }), "%+v", get())
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, missing, "status.ready removed while a pod of the pool could not be evaluated")
}

func podsOf(state map[string]*corev1.Pod) []corev1.Pod {
	out := make([]corev1.Pod, 0, len(state))
	for _, p := range state {
		out = append(out, *p)
	}
	return out
}
