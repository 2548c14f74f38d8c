package count

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

const uid = types.UID("uid-p")

var reducer = func() *Reducer {
	r := NewReducer([]config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}})
	return r
}()

// member is a pod of the parent pool, stamped by tally.
func member() *builder.PodBuilder {
	return builder.Pod("ns", "p").ControlledBy(operator.GVK, "pool", uid).
		Label(keys.ParentUID, string(uid)).Label(keys.ParentName, "pool").Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool")
}

func terminating(b *builder.PodBuilder) *corev1.Pod {
	p := b.Build()
	p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	return p
}

// marked adds an intent tally admitted.
func marked(b *builder.PodBuilder) *builder.PodBuilder {
	return b.Annotation(keys.CompletionIntent, "scale-down").
		Annotation(keys.CompletionIntentAt, "2026-12-06T10:00:00Z").Annotation(keys.CompletionIntentBy, "operator")
}

func TestTally(t *testing.T) {
	tests := []struct {
		name string
		pod  *corev1.Pod
		want Counts
	}{
		{"running, no intent: active", member().Phase(corev1.PodRunning).Build(), Counts{Active: 1}},
		{"pending, no intent: active", member().Phase(corev1.PodPending).Build(), Counts{Active: 1}},
		{"no phase yet: active", member().Build(), Counts{Active: 1}},
		{"terminating, no intent: unexpected", terminating(member().Phase(corev1.PodRunning)), Counts{Unexpected: 1}},
		{"succeeded, no intent: unexpected", member().Phase(corev1.PodSucceeded).Build(), Counts{Unexpected: 1}},
		{"failed, no intent: unexpected", member().Phase(corev1.PodFailed).Build(), Counts{Unexpected: 1}},
		{"intent, running: completing", marked(member()).Phase(corev1.PodRunning).Build(), Counts{Completing: 1}},
		{"intent, pending: completing", marked(member()).Phase(corev1.PodPending).Build(), Counts{Completing: 1}},
		{"intent, terminating: still completing", terminating(marked(member()).Phase(corev1.PodRunning)), Counts{Completing: 1}},
		{"intent, succeeded: completed", marked(member()).Phase(corev1.PodSucceeded).Build(), Counts{Completed: 1}},
		{"intent, failed: completed", marked(member()).Phase(corev1.PodFailed).Build(), Counts{Completed: 1}},
		{"intent, succeeded and terminating: completed", terminating(marked(member()).Phase(corev1.PodSucceeded)), Counts{Completed: 1}},
		{"intent tally never admitted, first seen on a failed pod: unexpected", member().Phase(corev1.PodFailed).Annotation(keys.CompletionIntent, "scale-down").
			Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Build(), Counts{Unexpected: 1}},
		{"intent tally never admitted, first seen on a running pod: completing", member().Phase(corev1.PodRunning).Annotation(keys.CompletionIntent, "scale-down").Build(), Counts{Completing: 1}},
		{"invalid intent, never admitted: active", member().Phase(corev1.PodRunning).Annotation(keys.CompletionIntent, "Not A Token").Build(), Counts{Active: 1}},
		{"label without ownerReference: not counted", builder.Pod("ns", "p").Label(keys.ParentUID, string(uid)).Build(), Counts{}},
		{"label with another owner's reference: not counted", builder.Pod("ns", "p").ControlledBy(operator.GVK, "other", "uid-q").Label(keys.ParentUID, string(uid)).Build(), Counts{}},
		{"non-controller reference: not counted", builder.Pod("ns", "p").OwnedBy(operator.GVK, "pool", uid).Label(keys.ParentUID, string(uid)).Build(), Counts{}},
		{"another parent's pod: not counted", builder.Pod("ns", "p").ControlledBy(operator.GVK, "other", "uid-q").Label(keys.ParentUID, "uid-q").Build(), Counts{}},
		{"controller ref to the parent, no label: counted as the sweep stamps it", builder.Pod("ns", "p").ControlledBy(operator.GVK, "pool", uid).Build(), Counts{Active: 1}},
		{"controller ref to the parent, another parent's label: counted as the sweep corrects it", builder.Pod("ns", "p").ControlledBy(operator.GVK, "pool", uid).Label(keys.ParentUID, "uid-q").Build(), Counts{Active: 1}},
		{"another namespace, same controller UID: not counted", builder.Pod("other-ns", "p").ControlledBy(operator.GVK, "pool", uid).Label(keys.ParentUID, string(uid)).Build(), Counts{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Tally("ns", uid, []*Pod{reducer.Pod(tc.pod)}))
		})
	}
}

func TestTallySums(t *testing.T) {
	pods := []*corev1.Pod{
		member().Phase(corev1.PodRunning).Build(),
		member().Phase(corev1.PodRunning).Build(),
		marked(member()).Phase(corev1.PodRunning).Build(),
		marked(member()).Phase(corev1.PodSucceeded).Build(),
		member().Phase(corev1.PodFailed).Build(),
	}
	var cached []*Pod
	for _, p := range pods {
		cached = append(cached, reducer.Pod(p))
	}
	got := Tally("ns", uid, cached)
	assert.Equal(t, Counts{Active: 2, Completing: 1, Completed: 1, Unexpected: 1}, got)
	for name, want := range map[config.Count]int64{config.Active: 2, config.Completing: 1, config.Completed: 1, config.Unexpected: 1} {
		assert.Equal(t, want, got.Get(name), name)
	}
}

func TestMisstamped(t *testing.T) {
	pool := func() *builder.PodBuilder {
		return builder.Pod("ns", "p").ControlledBy(operator.GVK, "pool", uid)
	}
	stamped := func() *builder.PodBuilder {
		return pool().Label(keys.ParentUID, string(uid)).Label(keys.ParentName, "pool").Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool")
	}
	tests := []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"stamped as the webhook would", stamped().Build(), false},
		{"stamped, with an admitted intent", stamped().Annotation(keys.CompletionIntent, "scale-down").
			Annotation(keys.CompletionIntentAt, "2026-11-30T08:00:00Z").Annotation(keys.CompletionIntentBy, "operator").Build(), false},
		{"an intent the webhook never saw (no -at, -by)", stamped().Annotation(keys.CompletionIntent, "scale-down").Build(), true},
		{"untracked, no tally keys", builder.Pod("ns", "p").Build(), false},
		{"tracked controller, no label", pool().Build(), true},
		{"label of another parent", stamped().Label(keys.ParentUID, "uid-q").Build(), true},
		{"label without a controller", builder.Pod("ns", "p").Label(keys.ParentUID, string(uid)).Build(), true},
		{"name label missing", pool().Label(keys.ParentUID, string(uid)).Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool").Build(), true},
		{"intent stamp without an intent", stamped().Annotation(keys.CompletionIntentBy, "someone").Build(), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, reducer.Pod(tc.pod).Misstamped)
		})
	}
}
