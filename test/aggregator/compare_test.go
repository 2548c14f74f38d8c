package aggregator

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/explain"
	"tally.dev/tally/pkg/keys"
)

// legacyField is the field a counter kept the old way writes.
const legacyField = "status.legacyCompleting"

// TestShadowModeFindsTheDrift runs a counter kept the old way beside tally
// in shadow mode (the kind's compare). On one pool its two handlers race
// as they do in an operator: a scale-down timer that increments
// status.legacyCompleting when it marks a pod, and a pod handler that
// decrements it when a marked pod finishes, each by a read and a merge
// patch, which no server-side apply conflict stops. On the other pool the
// same events are written one after the other (a correct writer). The
// metrics, an Event and explain report the first pool's drift, and no
// drift on the second; tally's own field is right on both.
func TestShadowModeFindsTheDrift(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	shadow := workerPools
	shadow.Compare = map[config.Count]string{config.Completing: legacyField}
	uids := map[string]types.UID{}
	var pods []*corev1.Pod
	for _, pool := range []string{"naive", "correct"} {
		uids[pool] = createParent(t, operator.GVK, ns, pool)
		for i := range 4 {
			pods = append(pods, member(operator.GVK, ns, pool, uids[pool], fmt.Sprintf("%s-%d", pool, i)).Build())
		}
	}
	createAll(t, pods)
	startAggregator(t, []config.Parent{shadow}, nil, func(o *app.Options) { o.DriftAfter = 2 * time.Second })
	// Once the sweep has stamped the pods, an intent is admitted as the
	// webhook would admit it (a pod it first sees marked and finished keeps
	// no intent).
	require.True(t, waitFor(60*time.Second, func() bool {
		var pods corev1.PodList
		require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(ns)))
		for _, p := range pods.Items {
			if p.Annotations[keys.Parent] == "" {
				return false
			}
		}
		return len(pods.Items) == 8
	}), "the sweep did not stamp the pods")

	pool := func(name string) *unstructured.Unstructured {
		u := operator.Pool(ns, name, 0)
		require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(u), u))
		return u
	}
	// The old way's two steps: a read of the counter, and a merge patch
	// of the value computed from it.
	read := func(name string) int64 {
		v, _, err := unstructured.NestedInt64(pool(name).Object, strings.Split(legacyField, ".")...)
		require.NoError(t, err)
		return v
	}
	write := func(name string, v int64) {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"status":{"legacyCompleting":%d}}`, v))
		require.NoError(t, env.Client.Status().Patch(ctx, operator.Pool(ns, name, 0), patch))
	}
	mark := func(name string) {
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent))
		require.NoError(t, env.Client.Patch(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}, patch))
	}
	finish := func(name string) {
		pod := &corev1.Pod{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pod))
		require.NoError(t, setPhase(ctx, env.Client, pod, corev1.PodSucceeded))
	}
	for _, name := range []string{"naive", "correct"} {
		for i := range 3 {
			v := read(name)
			mark(fmt.Sprintf("%s-%d", name, i))
			write(name, v+1)
		}
	}
	// At once: the timer marks pod 3 while the pod handler sees pod 0
	// finish. Both read 3; the timer writes 4, the pod handler 2.
	timer, podHandler := read("naive"), read("naive")
	mark("naive-3")
	finish("naive-0")
	write("naive", timer+1)
	write("naive", podHandler-1)
	// The same events, each write after the other's.
	mark("correct-3")
	write("correct", read("correct")+1)
	finish("correct-0")
	write("correct", read("correct")-1)
	require.Equal(t, int64(2), read("naive"), "an increment lost")
	require.Equal(t, int64(3), read("correct"))

	for _, name := range []string{"naive", "correct"} {
		converges(t, ns, name, uids[name])
		assert.Equal(t, int64(3), shown(t, operator.GVK, ns, name, allCounts)[config.Completing], name)
	}
	// The gauges sum every WorkerPool of the cluster, the other tests'
	// included: what each pool's field is from the truth.
	kind := operator.GVK.GroupKind().String()
	type sums struct{ compared, differing, difference float64 }
	var want, got sums
	require.True(t, waitFor(30*time.Second, func() bool {
		want = sums{}
		pools := &unstructured.UnstructuredList{}
		pools.SetGroupVersionKind(operator.GVK.GroupVersion().WithKind("WorkerPoolList"))
		require.NoError(t, env.Client.List(ctx, pools))
		for i := range pools.Items {
			p := &pools.Items[i]
			legacy, _, err := unstructured.NestedInt64(p.Object, strings.Split(legacyField, ".")...)
			require.NoError(t, err)
			diff := legacy - listTruth(t, p.GetNamespace(), p.GetUID())[config.Completing]
			want.compared++
			if diff != 0 {
				want.differing++
				want.difference += float64(max(diff, -diff))
			}
		}
		// (Label values in the order of their names: count, kind.)
		got = sums{gauge(t, "tally_aggregator_compared_parents", "completing", kind),
			gauge(t, "tally_aggregator_compare_differing_parents", "completing", kind), gauge(t, "tally_aggregator_compare_difference", "completing", kind)}
		return got == want
	}), "compared, differing, difference: got %v, want %v", got, want)

	var warned []eventsv1.Event
	require.True(t, waitFor(30*time.Second, func() bool {
		var events eventsv1.EventList
		require.NoError(t, env.Client.List(ctx, &events, client.InNamespace(ns)))
		warned = warned[:0]
		for _, e := range events.Items {
			if e.Reason == "CountDiffers" {
				warned = append(warned, e)
			}
		}
		return len(warned) > 0
	}), "no CountDiffers Event")
	require.Len(t, warned, 1, "the naive pool's, once")
	assert.Equal(t, "naive", warned[0].Regarding.Name)
	assert.Equal(t, corev1.EventTypeWarning, warned[0].Type)
	assert.Contains(t, warned[0].Note, "status.legacyCompleting shows 2, but tally counts 3 completing pods (written to status.completing)")

	var all corev1.PodList
	require.NoError(t, env.Client.List(ctx, &all, client.InNamespace(ns)))
	for name, want := range map[string]explain.Compared{
		"naive":   {Count: config.Completing, Path: legacyField, Operator: ptrTo[int64](2), TallyPath: "status.completing", Tally: ptrTo[int64](3), Fresh: 3},
		"correct": {Count: config.Completing, Path: legacyField, Operator: ptrTo[int64](3), TallyPath: "status.completing", Tally: ptrTo[int64](3), Fresh: 3},
	} {
		r := explain.Explain(pool(name), shadow, all.Items)
		assert.True(t, r.Equal, "tally's own fields of %s", name)
		assert.Equal(t, []explain.Compared{want}, r.Compared, name)
	}
}
