package aggregate

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

func TestOverdue(t *testing.T) {
	now := time.Unix(10_000, 0)
	grace := 2 * time.Minute
	held := func(uid types.UID, deleted time.Duration) *Pod {
		p := &Pod{Meta: Meta{UID: uid}, Tracking: true, Phase: corev1.PodSucceeded}
		if deleted > 0 {
			p.DeletionTimestamp = &metav1.Time{Time: now.Add(-deleted)}
		}
		return p
	}
	tests := []struct {
		name        string
		held        []*Pod
		before      map[types.UID]time.Time
		wantSince   map[types.UID]time.Time
		wantExpired []types.UID
	}{
		{name: "first seen now", held: []*Pod{held("a", 0)},
			wantSince: map[types.UID]time.Time{"a": now}},
		{name: "seen within the grace", held: []*Pod{held("a", 0)}, before: map[types.UID]time.Time{"a": now.Add(-grace + time.Second)},
			wantSince: map[types.UID]time.Time{"a": now.Add(-grace + time.Second)}},
		{name: "seen the whole grace", held: []*Pod{held("a", 0)}, before: map[types.UID]time.Time{"a": now.Add(-grace)},
			wantSince: map[types.UID]time.Time{"a": now.Add(-grace)}, wantExpired: []types.UID{"a"}},
		{name: "deleted before it was seen: a restarted aggregator does not wait again", held: []*Pod{held("a", 3*time.Minute)},
			wantSince: map[types.UID]time.Time{"a": now.Add(-3 * time.Minute)}, wantExpired: []types.UID{"a"}},
		{name: "pods no longer held are forgotten", held: []*Pod{held("b", 0)}, before: map[types.UID]time.Time{"a": now.Add(-time.Hour)},
			wantSince: map[types.UID]time.Time{"b": now}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			since, expired := overdue(tt.held, tt.before, now, grace)
			assert.Equal(t, tt.wantSince, since)
			var uids []types.UID
			for _, p := range expired {
				uids = append(uids, p.UID)
			}
			assert.Equal(t, tt.wantExpired, uids)
		})
	}
}

func TestIndexHeld(t *testing.T) {
	kind := Controller{Kind: schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}}
	tests := []struct {
		name        string
		pod         *Pod
		held, track bool
	}{
		{"running, tracked", &Pod{Tracking: true, Phase: corev1.PodRunning, Controller: kind}, false, true},
		{"finished, tracked", &Pod{Tracking: true, Phase: corev1.PodFailed, Controller: kind}, true, true},
		{"being deleted, tracked", &Pod{Tracking: true, Phase: corev1.PodRunning, Controller: kind, Meta: Meta{DeletionTimestamp: &metav1.Time{}}}, true, true},
		{"finished, released", &Pod{Phase: corev1.PodSucceeded, Controller: kind}, false, false},
		{"tracked, of no tracked kind", &Pod{Tracking: true, Phase: corev1.PodSucceeded}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			keys, err := indexHeld(tt.pod)
			assert.NoError(t, err)
			assert.Equal(t, tt.held, len(keys) == 1, "held index")
			keys, err = indexTrackingKind(tt.pod)
			assert.NoError(t, err)
			assert.Equal(t, tt.track, len(keys) == 1, "tracking-kind index")
		})
	}
}

func TestReportHeld(t *testing.T) {
	now := time.Unix(10_000, 0)
	kind := schema.GroupKind{Group: "example.tally.dev", Kind: "HeldPool"}
	tests := []struct {
		name         string
		since        map[types.UID]time.Time
		held, oldest float64
	}{
		{name: "two held, the oldest for 90s", since: map[types.UID]time.Time{"a": now.Add(-90 * time.Second), "b": now.Add(-time.Second)}, held: 2, oldest: 90},
		{name: "none held", held: 0, oldest: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reportHeld(kind, tt.since, now)
			assert.Equal(t, tt.held, testutil.ToFloat64(heldPods.WithLabelValues(kind.String())))
			assert.Equal(t, tt.oldest, testutil.ToFloat64(oldestHeldPod.WithLabelValues(kind.String())))
		})
	}
}
