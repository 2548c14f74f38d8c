package explain

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

const uid = types.UID("pool-uid")

func pod(name string, opts ...func(*corev1.Pod)) corev1.Pod {
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name,
			Labels:          map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool"},
			Annotations:     map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "pool", UID: uid, Controller: ptr.To(true)}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning},
	}
	for _, o := range opts {
		o(&p)
	}
	return p
}

func intent(p *corev1.Pod) {
	p.Annotations[keys.CompletionIntent] = "scale-down"
	p.Annotations[keys.CompletionIntentBy] = "alice"
	p.Annotations[keys.CompletionIntentAt] = "2026-11-30T10:00:00Z"
}

// unadmitted sets an intent tally did not see set.
func unadmitted(p *corev1.Pod)                   { p.Annotations[keys.CompletionIntent] = "drain" }
func phase(ph corev1.PodPhase) func(*corev1.Pod) { return func(p *corev1.Pod) { p.Status.Phase = ph } }
func deleting(p *corev1.Pod) {
	p.DeletionTimestamp = &metav1.Time{Time: time.Date(2026, 11, 30, 10, 1, 0, 0, time.UTC)}
}
func unstamped(p *corev1.Pod) { delete(p.Labels, keys.ParentUID) }
func otherController(p *corev1.Pod) {
	p.OwnerReferences = []metav1.OwnerReference{{Kind: "ReplicaSet", Name: "rs", UID: "rs-uid", Controller: ptr.To(true)}}
}
func otherNamespace(p *corev1.Pod) { p.Namespace = "elsewhere" }

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pod    corev1.Pod
		class  config.Count
		reason string
	}{
		{"running", pod("a"), config.Active, "no intent, Running"},
		{"pending", pod("a", phase("")), config.Active, "no intent, no phase yet"},
		{"intent running", pod("a", intent), config.Completing, `intent "scale-down" by alice at 2026-11-30T10:00:00Z, Running`},
		{"intent terminating", pod("a", intent, deleting), config.Completing, `intent "scale-down" by alice at 2026-11-30T10:00:00Z, Running, terminating since 2026-11-30T10:01:00Z`},
		{"intent succeeded", pod("a", intent, phase(corev1.PodSucceeded)), config.Completed, `intent "scale-down" by alice at 2026-11-30T10:00:00Z, Succeeded`},
		{"intent failed", pod("a", intent, phase(corev1.PodFailed)), config.Completed, `intent "scale-down" by alice at 2026-11-30T10:00:00Z, Failed`},
		{"failed", pod("a", phase(corev1.PodFailed)), config.Unexpected, "no intent, Failed"},
		{"deleted running", pod("a", deleting), config.Unexpected, "no intent, Running, terminating since 2026-11-30T10:01:00Z"},
		{"intent tally did not see, running", pod("a", unadmitted), config.Completing, `intent "drain", Running`},
		{"intent tally did not see, failed", pod("a", unadmitted, phase(corev1.PodFailed)), config.Unexpected,
			`intent "drain", not admitted: tally did not admit it on this pod, and the pod had finished (phase Failed) when tally first saw the intent (the sweep removes it), Failed`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			class, reason := Classify(&tc.pod, mutate.NewMutator([]config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}}, nil))
			assert.Equal(t, tc.class, class)
			assert.Equal(t, tc.reason, reason)
		})
	}
}

func TestExplain(t *testing.T) {
	parentKind := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool",
		Counts: map[config.Count]string{config.Active: "status.active", config.Completing: "status.completing", config.Unexpected: "status.unexpected"}}
	parent := func(status map[string]any) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "example.tally.dev/v1", "kind": "WorkerPool", "status": status}}
		u.SetNamespace("ns")
		u.SetName("pool")
		u.SetUID(uid)
		return u
	}
	pods := []corev1.Pod{pod("b"), pod("a", intent), pod("c", phase(corev1.PodFailed)),
		pod("d", unstamped), pod("forged", otherController), pod("elsewhere", otherNamespace)}

	t.Run("differs", func(t *testing.T) {
		r := Explain(parent(map[string]any{"active": int64(1), "completing": int64(1), "unexpected": int64(1)}), parentKind, pods)
		assert.False(t, r.Equal, "d is not stamped: tally's active misses it")
		assert.Equal(t, []string{"a", "b", "c", "d"}, names(r.Pods))
		assert.Equal(t, []string{"d"}, r.Unstamped)
		assert.Equal(t, []Field{
			{Count: config.Completing, Path: "status.completing", Tally: ptr.To[int64](1), Fresh: 1},
			{Count: config.Active, Path: "status.active", Tally: ptr.To[int64](1), Fresh: 2},
			{Count: config.Unexpected, Path: "status.unexpected", Tally: ptr.To[int64](1), Fresh: 1},
		}, r.Fields)
		assert.Len(t, r.NotCounted, 1)
		assert.Equal(t, "forged", r.NotCounted[0].Name)
		assert.Contains(t, r.NotCounted[0].Reason, "ReplicaSet rs")
	})
	t.Run("equal", func(t *testing.T) {
		r := Explain(parent(map[string]any{"active": int64(2), "completing": int64(1), "unexpected": float64(1)}), parentKind, pods)
		assert.True(t, r.Equal)
	})
	t.Run("totals beside no fresh count, and the ledger", func(t *testing.T) {
		withTotals := parentKind
		withTotals.Counts = map[config.Count]string{config.Active: "status.active", config.UnexpectedTotal: "status.restarts"}
		withTotals.Ledger = "status.ledger"
		tracked := pod("t", func(p *corev1.Pod) { p.Finalizers = []string{keys.TrackingFinalizer} })
		r := Explain(parent(map[string]any{"active": int64(3), "restarts": int64(7),
			"ledger": map[string]any{"unexpected": []any{"u1", "u2"}}}), withTotals, append(pods, tracked))
		assert.True(t, r.Equal, "totals are not compared with a fresh count")
		assert.Equal(t, []Total{{Count: config.UnexpectedTotal, Path: "status.restarts", Tally: ptr.To[int64](7)}}, r.Totals)
		assert.Equal(t, &Ledger{Path: "status.ledger", Unexpected: 2}, r.Ledger)
		assert.True(t, r.Pods[len(r.Pods)-1].Tracking)

		r = Explain(parent(map[string]any{"active": int64(3), "ledger": "garbage"}), withTotals, pods)
		assert.False(t, r.Equal, "an unreadable ledger stops the totals")
		assert.Contains(t, r.Ledger.Error, "the ledger status.ledger is a string")
	})
	t.Run("custom counts, with the pods they match and fail on", func(t *testing.T) {
		withCustom := parentKind
		withCustom.CustomCounts = []config.CustomCount{
			{Name: "ready", Path: "status.ready", Expression: `pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`},
		}
		ready := func(p *corev1.Pod) {
			p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		}
		notReady := func(p *corev1.Pod) {
			p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
		}
		r := Explain(parent(map[string]any{"active": int64(2), "completing": int64(1), "unexpected": int64(1), "ready": int64(1)}), withCustom,
			[]corev1.Pod{pod("b", ready), pod("a", intent, notReady), pod("c", phase(corev1.PodFailed)), pod("e", ready), pod("forged", otherController, ready)})
		custom := r.Fields[len(r.Fields)-1]
		assert.Equal(t, config.Count("ready"), custom.Count)
		assert.Equal(t, []string{"b", "e"}, custom.Matching, "the pods of S(P) only")
		assert.Equal(t, []string{"c: no such key: conditions"}, custom.Failed)
		assert.Equal(t, int64(2), custom.Fresh)
		assert.False(t, r.Equal, "status.ready shows 1, two pods match")
		assert.False(t, custom.WaitsOnUnstamped)

		r = Explain(parent(map[string]any{"active": int64(2), "ready": int64(1)}), withCustom, []corev1.Pod{pod("b", ready), pod("u", unstamped, ready)})
		custom = r.Fields[len(r.Fields)-1]
		assert.True(t, custom.WaitsOnUnstamped, "a pod the aggregator cannot evaluate")
		assert.Equal(t, int64(2), custom.Fresh, "the fresh count includes it")
	})
	t.Run("a custom count the aggregator cannot keep", func(t *testing.T) {
		withBroken := parentKind
		withBroken.CustomCounts = []config.CustomCount{
			{Name: "ready", Path: "status.ready", Expression: `pod.status.ready`, Err: errors.New("parents[0].customCounts[0].expression: does not compile")},
		}
		r := Explain(parent(map[string]any{"active": int64(2), "completing": int64(1), "unexpected": int64(1)}), withBroken, pods)
		for _, f := range r.Fields {
			assert.NotEqual(t, config.Count("ready"), f.Count, "a count left unwritten is not compared")
		}
		assert.Equal(t, []Unkept{{Count: "ready", Path: "status.ready", Error: "parents[0].customCounts[0].expression: does not compile"}}, r.Unkept)
	})
	t.Run("fields the operator keeps beside tally's and a fresh count", func(t *testing.T) {
		shadow := parentKind
		shadow.Compare = map[config.Count]string{config.Completing: "status.legacy.completing", config.Completed: "status.legacy.completed", "ready": "status.legacy.ready"}
		shadow.CustomCounts = []config.CustomCount{{Name: "ready", Path: "status.ready", Expression: `pod.status.phase == "Running"`}}
		r := Explain(parent(map[string]any{"active": int64(2), "completing": int64(1), "unexpected": int64(1), "ready": int64(3),
			"legacy": map[string]any{"completing": int64(3), "ready": "two"}}), shadow, pods)
		assert.True(t, r.Equal, "tally's own fields hold the fresh counts")
		assert.Equal(t, []Compared{
			{Count: config.Completing, Path: "status.legacy.completing", Operator: ptr.To[int64](3), TallyPath: "status.completing", Tally: ptr.To[int64](1), Fresh: 1},
			{Count: config.Completed, Path: "status.legacy.completed", Operator: ptr.To[int64](0), Fresh: 0},
			{Count: "ready", Path: "status.legacy.ready", TallyPath: "status.ready", Tally: ptr.To[int64](3), Fresh: 3},
		}, r.Compared, "absent is 0; not an integer is nil; a count tally does not write has no field")
		assert.False(t, r.Compared[0].Equal())
		assert.True(t, r.Compared[1].Equal())
		assert.False(t, r.Compared[2].Equal())
		assert.Empty(t, r.Uncompared)

		shadow.CompareErrs = map[config.Count]error{config.CompletedTotal: errors.New("parents[0].compare.completedTotal: a total cannot be compared")}
		r = Explain(parent(map[string]any{}), shadow, pods)
		assert.Equal(t, []string{"parents[0].compare.completedTotal: a total cannot be compared"}, r.Uncompared)
	})
	t.Run("field absent", func(t *testing.T) {
		r := Explain(parent(map[string]any{"active": int64(2), "completing": int64(1)}), parentKind, pods)
		assert.False(t, r.Equal)
		assert.Nil(t, r.Fields[2].Tally)
	})
}

func names(pods []Pod) []string {
	var n []string
	for _, p := range pods {
		n = append(n, p.Name)
	}
	return n
}
