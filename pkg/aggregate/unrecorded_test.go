package aggregate

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
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
	used := func(d time.Duration) heldPod { return heldPod{seen: now.Add(-time.Hour), used: d} }
	always := func(*Pod) bool { return true }
	never := func(*Pod) bool { return false }
	tests := []struct {
		name        string
		held        []*Pod
		before      map[types.UID]heldPod
		elapsed     time.Duration
		runs        func(*Pod) bool
		want        map[types.UID]heldPod
		wantExpired []types.UID
	}{
		{name: "first seen: the grace starts now", held: []*Pod{held("a", 0)}, elapsed: time.Hour, runs: always,
			want: map[types.UID]heldPod{"a": {seen: now}}},
		{name: "deleted long before it was seen (the aggregator was away): the whole grace is left",
			held: []*Pod{held("a", time.Hour)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": {seen: now}}},
		{name: "within the grace", held: []*Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - 3*time.Second)},
			elapsed: 2 * time.Second, runs: always, want: map[types.UID]heldPod{"a": used(grace - time.Second)}},
		{name: "the whole grace used", held: []*Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - time.Second)},
			elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(grace + time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "paused (fenced, the gate cannot tell, parent not reconciled yet): the grace waits",
			held: []*Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - time.Second)},
			elapsed: time.Hour, runs: never, want: map[types.UID]heldPod{"a": used(grace - time.Second)}},
		{name: "only the pods whose grace runs use it", held: []*Pod{held("a", 0), held("b", 0)},
			before: map[types.UID]heldPod{"a": used(time.Second), "b": used(time.Second)}, elapsed: time.Second,
			runs: func(p *Pod) bool { return p.UID == "a" },
			want: map[types.UID]heldPod{"a": used(2 * time.Second), "b": used(time.Second)}},
		{name: "pods no longer held are forgotten", held: []*Pod{held("b", 0)}, before: map[types.UID]heldPod{"a": used(time.Hour)},
			runs: always, want: map[types.UID]heldPod{"b": {seen: now}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			known, expired := overdue(tt.held, tt.before, now, tt.elapsed, grace, tt.runs)
			assert.Equal(t, tt.want, known)
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
		name          string
		held          map[types.UID]heldPod
		count, oldest float64
	}{
		{name: "two held, the oldest for 90s (whatever grace it used)", held: map[types.UID]heldPod{
			"a": {seen: now.Add(-90 * time.Second), used: time.Second}, "b": {seen: now.Add(-time.Second)},
		}, count: 2, oldest: 90},
		{name: "none held", count: 0, oldest: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reportHeld(kind, tt.held, now)
			assert.Equal(t, tt.count, testutil.ToFloat64(heldPods.WithLabelValues(kind.String())))
			assert.Equal(t, tt.oldest, testutil.ToFloat64(oldestHeldPod.WithLabelValues(kind.String())))
		})
	}
}

// blockingReader is a cache whose kind never syncs: every read waits for
// its context.
type blockingReader struct{ client.Reader }

func (blockingReader) Get(ctx context.Context, _ client.ObjectKey, _ client.Object, _ ...client.GetOption) error {
	<-ctx.Done()
	return ctx.Err()
}

// patchRecorder records the pods patched.
type patchRecorder struct {
	client.Writer
	mu      sync.Mutex
	patched []string
}

func (w *patchRecorder) Patch(_ context.Context, obj client.Object, _ client.Patch, _ ...client.PatchOption) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.patched = append(w.patched, obj.GetName())
	return nil
}

// TestReleaseDoesNotWaitForAnUnsyncedCache: the parents of a kind whose
// informer never syncs are read within a bound, and their pods released
// all the same, so that one kind cannot stall the releases of the others.
func TestReleaseDoesNotWaitForAnUnsyncedCache(t *testing.T) {
	p := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "StuckPool",
		Counts: map[config.Count]string{config.UnexpectedTotal: "status.unexpectedTotal"}, Ledger: "status.ledger"}
	w := &patchRecorder{}
	u := NewUnrecorded([]config.Parent{p}, nil, nil, blockingReader{}, w, &events.FakeRecorder{}, time.Minute, nil, &reconciledParents{}, logr.Discard())
	pod := &Pod{Meta: Meta{Namespace: "ns", Name: "held", UID: "uid-1"}, Tracking: true, Phase: corev1.PodFailed,
		Controller: Controller{Kind: p.GroupKind(), Name: "pool"}}
	done := make(chan error, 1)
	go func() { done <- u.releaseAll(context.Background(), p, []*Pod{pod}, "lost", "test") }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(3 * parentReadWait):
		t.Fatal("a release pass waited on a cache that never syncs")
	}
	assert.Equal(t, []string{"held"}, w.patched)
}
