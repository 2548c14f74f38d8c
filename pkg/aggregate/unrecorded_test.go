package aggregate

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

func TestOverdue(t *testing.T) {
	now := time.Unix(10_000, 0)
	grace := 2 * time.Minute
	held := func(uid types.UID, deleted time.Duration) *count.Pod {
		p := &count.Pod{Meta: count.Meta{UID: uid}, Tracking: true, Phase: corev1.PodSucceeded}
		if deleted > 0 {
			p.DeletionTimestamp = &metav1.Time{Time: now.Add(-deleted)}
		}
		return p
	}
	finishedAgo := func(uid types.UID, ago time.Duration) *count.Pod {
		p := held(uid, 0)
		p.FinishedAt = now.Add(-ago).Unix()
		return p
	}
	used := func(d time.Duration) heldPod { return heldPod{seen: now.Add(-time.Hour), used: d} }
	// always: the grace runs, and a record of the parent was tried (since
	// the pod was seen); never: the grace waits.
	always := func(*count.Pod) graceOf { return graceOf{runs: true, tried: now} }
	never := func(*count.Pod) graceOf { return graceOf{} }
	tests := []struct {
		name        string
		held        []*count.Pod
		before      map[types.UID]heldPod
		elapsed     time.Duration
		runs        func(*count.Pod) graceOf
		want        map[types.UID]heldPod
		wantExpired []types.UID
	}{
		{name: "first seen: the grace starts now", held: []*count.Pod{held("a", 0)}, elapsed: time.Hour, runs: always,
			want: map[types.UID]heldPod{"a": {seen: now}}},
		{name: "deleted long before it was seen (the aggregator was away): the whole grace is left",
			held: []*count.Pod{held("a", time.Hour)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": {seen: now}}},
		{name: "within the grace", held: []*count.Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - 3*time.Second)},
			elapsed: 2 * time.Second, runs: always, want: map[types.UID]heldPod{"a": used(grace - time.Second)}},
		{name: "the whole grace used", held: []*count.Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - time.Second)},
			elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(grace + time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "paused (fenced, the gate cannot tell, parent not reconciled yet): the grace waits",
			held: []*count.Pod{held("a", 0)}, before: map[types.UID]heldPod{"a": used(grace - time.Second)},
			elapsed: time.Hour, runs: never, want: map[types.UID]heldPod{"a": used(grace - time.Second)}},
		{name: "only the pods whose grace runs use it", held: []*count.Pod{held("a", 0), held("b", 0)},
			before: map[types.UID]heldPod{"a": used(time.Second), "b": used(time.Second)}, elapsed: time.Second,
			runs: func(p *count.Pod) graceOf { return graceOf{runs: p.UID == "a"} },
			want: map[types.UID]heldPod{"a": used(2 * time.Second), "b": used(time.Second)}},
		{name: "past the hold limit: released once its grace ran here for a quarter of it (at most 30s)",
			held: []*count.Pod{finishedAgo("a", 5*grace)}, before: map[types.UID]heldPod{"a": used(29 * time.Second)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(31 * time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "past the hold limit: held while its reconciles may still record it",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(2 * time.Second)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(4 * time.Second)}},
		{name: "past the hold limit, first seen: none of the grace used here yet",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": {seen: now}}},
		{name: "past the hold limit, no record of its parent tried (waiting in the rate limiter): held",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(31 * time.Second)}, elapsed: 2 * time.Second,
			runs: func(*count.Pod) graceOf { return graceOf{runs: true} },
			want: map[types.UID]heldPod{"a": used(33 * time.Second)}},
		{name: "past the hold limit, the last record tried began before the pod was seen: held",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(31 * time.Second)}, elapsed: 2 * time.Second,
			runs: func(*count.Pod) graceOf { return graceOf{runs: true, tried: now.Add(-2 * time.Hour)} },
			want: map[types.UID]heldPod{"a": used(33 * time.Second)}},
		{name: "past the hold limit, no reconcile would record it: released without a record tried",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(31 * time.Second)}, elapsed: 2 * time.Second,
			runs: func(*count.Pod) graceOf { return graceOf{runs: true, orphaned: true} },
			want: map[types.UID]heldPod{"a": used(33 * time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "no record tried, the whole grace used: released",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(grace)}, elapsed: 2 * time.Second,
			runs: func(*count.Pod) graceOf { return graceOf{runs: true} },
			want: map[types.UID]heldPod{"a": used(grace + 2*time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "past the hold limit, exactly 30s used: released",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(28 * time.Second)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(30 * time.Second)}, wantExpired: []types.UID{"a"}},
		{name: "past the hold limit, enough used but paused now: held",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(time.Minute)}, elapsed: 2 * time.Second, runs: never,
			want: map[types.UID]heldPod{"a": used(time.Minute)}},
		{name: "past the hold limit, paused: held",
			held: []*count.Pod{finishedAgo("a", time.Hour)}, before: map[types.UID]heldPod{"a": used(time.Second)}, elapsed: 2 * time.Second, runs: never,
			want: map[types.UID]heldPod{"a": used(time.Second)}},
		{name: "within the hold limit: the grace decides",
			held: []*count.Pod{finishedAgo("a", 5*grace-time.Second)}, before: map[types.UID]heldPod{"a": used(time.Second)}, elapsed: 2 * time.Second, runs: always,
			want: map[types.UID]heldPod{"a": used(3 * time.Second)}},
		{name: "pods no longer held are forgotten", held: []*count.Pod{held("b", 0)}, before: map[types.UID]heldPod{"a": used(time.Hour)},
			runs: always, want: map[types.UID]heldPod{"b": {seen: now}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			known, expired := overdue(tt.held, tt.before, clocks{now, now}, tt.elapsed, grace, tt.runs)
			assert.Equal(t, tt.want, known)
			var uids []types.UID
			for _, p := range expired {
				uids = append(uids, p.UID)
			}
			assert.Equal(t, tt.wantExpired, uids)
		})
	}
	t.Run("a short grace: a quarter of it is enough past the hold limit", func(t *testing.T) {
		const short = 8 * time.Second
		pod := finishedAgo("a", 5*short)
		_, expired := overdue([]*count.Pod{pod}, map[types.UID]heldPod{"a": used(time.Second)}, clocks{now, now}, time.Second, short, always)
		assert.Len(t, expired, 1)
		_, expired = overdue([]*count.Pod{pod}, map[types.UID]heldPod{"a": used(0)}, clocks{now, now}, time.Second, short, always)
		assert.Empty(t, expired, "released with less than a quarter of a short grace used")
	})
	t.Run("the hold limit is by the API server's clock", func(t *testing.T) {
		year := 365 * 24 * time.Hour
		recent, old := finishedAgo("a", grace), finishedAgo("b", 6*grace)
		before := map[types.UID]heldPod{"a": used(grace / 2), "b": used(grace / 2)}
		_, expired := overdue([]*count.Pod{recent}, before, clocks{local: now.Add(year), server: now}, time.Second, grace, always)
		assert.Empty(t, expired, "a local clock a year ahead made a pod past the hold limit")
		_, expired = overdue([]*count.Pod{old}, before, clocks{local: now.Add(-year), server: now}, time.Second, grace, always)
		assert.Len(t, expired, 1, "a local clock a year behind kept a pod past the hold limit")
	})
}

func TestReportHeld(t *testing.T) {
	now := time.Unix(10_000, 0)
	kind := schema.GroupKind{Group: "example.tally.dev", Kind: "HeldPool"}
	pod := func(uid types.UID, finishedAgo time.Duration) *count.Pod {
		p := &count.Pod{Meta: count.Meta{UID: uid}}
		if finishedAgo > 0 {
			p.FinishedAt = now.Add(-finishedAgo).Unix()
		}
		return p
	}
	tests := []struct {
		name          string
		pods          []*count.Pod
		held          map[types.UID]heldPod
		count, oldest float64
	}{
		{name: "two held, the oldest for 90s (whatever grace it used)", pods: []*count.Pod{pod("a", 0), pod("b", 0)}, held: map[types.UID]heldPod{
			"a": {seen: now.Add(-90 * time.Second), used: time.Second}, "b": {seen: now.Add(-time.Second)},
		}, count: 2, oldest: 90},
		{name: "seen a moment ago by this process, finished 10 minutes ago", pods: []*count.Pod{pod("a", 10*time.Minute)},
			held: map[types.UID]heldPod{"a": {seen: now.Add(-time.Second)}}, count: 1, oldest: 600},
		{name: "none held", count: 0, oldest: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reportHeld(kind, tt.pods, tt.held, clocks{now, now})
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
// informer never syncs are read within a bound, once a pass, and their
// pods released all the same, so that one kind cannot stall the releases
// of the others.
func TestReleaseDoesNotWaitForAnUnsyncedCache(t *testing.T) {
	p := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "StuckPool",
		Counts: map[config.Count]string{config.UnexpectedTotal: "status.unexpectedTotal"}, Ledger: "status.ledger"}
	w := &patchRecorder{}
	u := NewUnrecorded([]config.Parent{p}, nil, nil, blockingReader{}, w, &events.FakeRecorder{}, time.Minute, nil, &reconciledParents{}, logr.Discard())
	var pods []*count.Pod
	for i, parent := range []string{"a", "b", "c"} {
		pods = append(pods, &count.Pod{Meta: count.Meta{Namespace: "ns", Name: "held-" + parent, UID: types.UID(fmt.Sprint("uid-", i))}, Tracking: true, Phase: corev1.PodFailed,
			Controller: count.Controller{Kind: p.GroupKind(), Name: parent}})
	}
	done := make(chan error, 1)
	go func() { done <- u.releaseAll(context.Background(), p, pods, nil, "unservable", "test") }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(2 * parentReadWait):
		t.Fatal("a release pass waited on a cache that never syncs for each parent")
	}
	assert.ElementsMatch(t, []string{"held-a", "held-b", "held-c"}, w.patched)
}

// failingReader answers every read with err, and counts them.
type failingReader struct {
	client.Reader
	err error
	// released: the pods read no longer carry the finalizer.
	released bool
	reads    atomic.Int32
}

func (r *failingReader) Get(_ context.Context, key client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	if trackedPod(key, obj) {
		if r.released {
			obj.SetFinalizers(nil)
		}
		return nil
	}
	r.reads.Add(1)
	return r.err
}

// trackedPod answers a read of a pod, whose UID is its name, as carrying the
// tracking finalizer, and reports whether obj was a pod.
func trackedPod(key client.ObjectKey, obj client.Object) bool {
	pod, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok || pod.Kind != "Pod" {
		return false
	}
	pod.SetUID(types.UID(key.Name))
	pod.SetFinalizers([]string{keys.TrackingFinalizer})
	return true
}

// TestLostNeedsTheLedger: a pod whose grace ran out is counted as lost only
// when its parent's ledger, read from the API server, does not hold it,
// and the pod still carried the finalizer just before (else the
// reconciler recorded and released it, and its total holds it). A ledger
// that cannot be read leaves the pod held for the next pass instead of
// counting it as lost (the fold may count it), until a second grace has
// run out; a parent that is gone holds no ledger.
func TestLostNeedsTheLedger(t *testing.T) {
	p := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "LedgerPool",
		Counts: map[config.Count]string{config.UnexpectedTotal: "status.unexpectedTotal"}, Ledger: "status.ledger"}
	kind := p.GroupKind().String()
	pod := &count.Pod{Meta: count.Meta{Namespace: "ns", Name: "held", UID: "held"}, Tracking: true, Phase: corev1.PodFailed,
		Controller: count.Controller{Kind: p.GroupKind(), Name: "pool", UID: "pool-uid"}}
	gone := apierrors.NewNotFound(schema.GroupResource{Resource: "ledgerpools"}, "pool")
	for _, tt := range []struct {
		name                      string
		err                       error
		released, force, wantErr  bool
		wantReleased, wantCounted bool
	}{
		{name: "the API server cannot tell", err: errors.New("connection refused"), wantErr: true},
		{name: "the API server cannot tell for a second grace", err: errors.New("connection refused"), force: true, wantReleased: true, wantCounted: true},
		{name: "the parent is gone", err: gone, wantReleased: true, wantCounted: true},
		{name: "recorded, released and folded meanwhile", err: gone, released: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := &patchRecorder{}
			live := &failingReader{err: tt.err, released: tt.released}
			u := NewUnrecorded([]config.Parent{p}, nil, nil, blockingReader{}, w, &events.FakeRecorder{}, time.Minute, nil, &reconciledParents{}, logr.Discard())
			u.live, u.recording = live, &recordLocks{}
			before := testutil.ToFloat64(trackingLost.WithLabelValues(kind))
			err := u.releaseAll(context.Background(), p, []*count.Pod{pod}, map[types.UID]bool{pod.UID: tt.force}, "lost", "test")
			assert.Equal(t, tt.wantErr, err != nil, "error: %v", err)
			assert.Equal(t, tt.wantReleased, len(w.patched) == 1, "released: %v", w.patched)
			lost := testutil.ToFloat64(trackingLost.WithLabelValues(kind)) - before
			assert.Equal(t, tt.wantCounted, lost == 1, "counted as lost: %v", lost)
			assert.EqualValues(t, 1, live.reads.Load())
		})
	}
}

// TestLostWaitsForARecord: while a reconciler holds a parent's record lock
// (it confirmed a pod and is writing the ledger that records it),
// Unrecorded neither reads that ledger nor releases the parent's pods; it
// reads the ledger once the lock is released, and a pod recorded meanwhile
// is not counted as lost.
func TestLostWaitsForARecord(t *testing.T) {
	p := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "RacePool",
		Counts: map[config.Count]string{config.UnexpectedTotal: "status.unexpectedTotal"}, Ledger: "status.ledger"}
	kind := p.GroupKind().String()
	pod := &count.Pod{Meta: count.Meta{Namespace: "ns", Name: "held", UID: "held"}, Tracking: true, Phase: corev1.PodFailed,
		Controller: count.Controller{Kind: p.GroupKind(), Name: "pool", UID: "pool-uid"}}
	ledger := &ledgerReader{uid: "pool-uid"}
	w := &patchRecorder{}
	locks := &recordLocks{}
	u := NewUnrecorded([]config.Parent{p}, nil, nil, blockingReader{}, w, &events.FakeRecorder{}, time.Minute, nil, &reconciledParents{}, logr.Discard())
	u.live, u.recording = ledger, locks
	before := testutil.ToFloat64(trackingLost.WithLabelValues(kind))

	unlock := locks.lock(parentKey{kind: p.GroupKind(), name: types.NamespacedName{Namespace: "ns", Name: "pool"}})
	done := make(chan error, 1)
	go func() { done <- u.releaseAll(context.Background(), p, []*count.Pod{pod}, nil, "lost", "test") }()
	time.Sleep(100 * time.Millisecond)
	assert.Zero(t, ledger.reads.Load(), "the ledger read while a record was under way")
	ledger.record(pod.UID)
	unlock()
	require.NoError(t, <-done)
	assert.Equal(t, []string{"held"}, w.patched)
	assert.Zero(t, testutil.ToFloat64(trackingLost.WithLabelValues(kind))-before, "a recorded pod counted as lost")
	assert.Empty(t, locks.held, "a lock left behind")
}

// ledgerReader serves one parent whose ledger holds the UIDs recorded.
type ledgerReader struct {
	client.Reader
	uid   types.UID
	mu    sync.Mutex
	uids  []any
	reads atomic.Int32
}

func (r *ledgerReader) record(uid types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.uids = append(r.uids, string(uid))
}

func (r *ledgerReader) Get(_ context.Context, key client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	if trackedPod(key, obj) {
		return nil
	}
	r.reads.Add(1)
	r.mu.Lock()
	defer r.mu.Unlock()
	u := obj.(*unstructured.Unstructured)
	u.SetName(key.Name)
	u.SetNamespace(key.Namespace)
	u.SetUID(r.uid)
	u.Object["status"] = map[string]any{"ledger": map[string]any{"unexpected": append([]any(nil), r.uids...)}}
	return nil
}

func TestListed(t *testing.T) {
	name := func(i, n int) string { return fmt.Sprintf("%0*d", n, i) }
	names := func(count, n int) []string {
		out := make([]string, count)
		for i := range out {
			out[i] = name(i, n)
		}
		return out
	}
	tests := []struct {
		name      string
		names     []string
		wantShown int
	}{
		{name: "none", names: nil, wantShown: 0},
		{name: "a few", names: names(3, 5), wantShown: 3},
		{name: "more than 20 short names", names: names(45, 5), wantShown: 20},
		{name: "long names: bounded by bytes", names: names(10, 253), wantShown: 2},
		{name: "one name longer than the bound is shown", names: names(2, 600), wantShown: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := listed(tt.names)
			for i, n := range tt.names {
				assert.Equal(t, i < tt.wantShown, strings.Contains(got, n), "name %d in %q", i, got)
			}
			if more := len(tt.names) - tt.wantShown; more > 0 {
				assert.True(t, strings.HasSuffix(got, fmt.Sprintf(" and %d more", more)), got)
			}
			if tt.wantShown > 1 {
				assert.LessOrEqual(t, len(got), listedBytes+len(" and 100 more"))
			}
		})
	}
}

func TestFinishedAt(t *testing.T) {
	at := func(s int64) *metav1.Time { return &metav1.Time{Time: time.Unix(s, 0)} }
	tracked := []string{keys.TrackingFinalizer}
	fields := []metav1.ManagedFieldsEntry{{Manager: "webhook", Time: at(1_000)}, {Manager: "kubelet", Subresource: "status", Time: at(1_500)}, {Manager: "none"}}
	tests := []struct {
		name string
		pod  corev1.Pod
		want int64
	}{
		{name: "terminal: the last change made to it",
			pod:  corev1.Pod{ObjectMeta: metav1.ObjectMeta{Finalizers: tracked, ManagedFields: fields}, Status: corev1.PodStatus{Phase: corev1.PodFailed}},
			want: 1_500},
		{name: "deleted while running: when its deletion was asked for",
			pod: corev1.Pod{ObjectMeta: metav1.ObjectMeta{Finalizers: tracked, ManagedFields: fields, DeletionTimestamp: at(2_030), DeletionGracePeriodSeconds: ptr.To[int64](30)},
				Status: corev1.PodStatus{Phase: corev1.PodRunning}},
			want: 2_000},
		{name: "terminal and deleted: when its deletion was asked for, whatever changed after",
			pod: corev1.Pod{ObjectMeta: metav1.ObjectMeta{Finalizers: tracked, ManagedFields: fields, DeletionTimestamp: at(1_800)},
				Status: corev1.PodStatus{Phase: corev1.PodSucceeded}},
			want: 1_800},
		{name: "terminal, no time shown: unknown",
			pod:  corev1.Pod{ObjectMeta: metav1.ObjectMeta{Finalizers: tracked}, Status: corev1.PodStatus{Phase: corev1.PodSucceeded}},
			want: 0},
		{name: "running: not finished",
			pod:  corev1.Pod{ObjectMeta: metav1.ObjectMeta{Finalizers: tracked, ManagedFields: fields}, Status: corev1.PodStatus{Phase: corev1.PodRunning}},
			want: 0},
		{name: "finished, not tracked: not kept",
			pod:  corev1.Pod{ObjectMeta: metav1.ObjectMeta{ManagedFields: fields}, Status: corev1.PodStatus{Phase: corev1.PodFailed}},
			want: 0},
	}
	r := count.NewReducer(nil)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, r.Pod(&tt.pod).FinishedAt)
		})
	}
}

// TestHeldPodsAreLoggedWithWhy: a parent whose pods have been held for a
// minute is logged, naming it, its pods and why they wait, and again a
// minute later at most; one whose pods were held for less is not.
func TestHeldPodsAreLoggedWithWhy(t *testing.T) {
	kind := schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}
	now := time.Unix(10_000, 0)
	pod := func(name, parent string) *count.Pod {
		return &count.Pod{Meta: count.Meta{Name: name, Namespace: "ns", UID: types.UID(name)}, Controller: count.Controller{Kind: kind, Name: parent}}
	}
	held := []*count.Pod{pod("a-1", "a"), pod("a-2", "a"), pod("b-1", "b")}
	known := map[types.UID]heldPod{
		"a-1": {seen: now.Add(-2 * time.Minute), used: 5 * time.Second}, "a-2": {seen: now.Add(-time.Minute)},
		"b-1": {seen: now.Add(-10 * time.Second)},
	}
	var lines []string
	u := &Unrecorded{grace: 2 * time.Minute, logged: map[parentKey]time.Time{},
		log: funcr.New(func(_, args string) { lines = append(lines, args) }, funcr.Options{})}
	why := func(*count.Pod) string { return "the grace waits" }

	u.logWaiting(kind, held, known, clocks{now, now}, why)
	require.Len(t, lines, 1)
	for _, want := range []string{`"parent"={"name"="a" "namespace"="ns"}`, `"reason"="the grace waits"`, `"pods"="a-1, a-2"`, `"heldFor"="2m0s"`, `"graceUsed"="5s"`} {
		assert.Contains(t, lines[0], want)
	}
	u.logWaiting(kind, held, known, clocks{now.Add(30 * time.Second), now.Add(30 * time.Second)}, why)
	assert.Len(t, lines, 1, "logged again within a minute")
	u.logWaiting(kind, held, known, clocks{now.Add(time.Minute), now.Add(time.Minute)}, why)
	assert.Len(t, lines, 3, "a logged again a minute later, b now held for a minute too")
}

// TestRefused: only an answer that the same write would meet again is a
// refusal; a failure on the way, a conflict or throttling is not.
func TestRefused(t *testing.T) {
	gr := schema.GroupResource{Group: "example.tally.dev", Resource: "workerpools"}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("applying: %w", apierrors.NewForbidden(gr, "pool", errors.New("no"))), true},
		{apierrors.NewInvalid(schema.GroupKind{Group: gr.Group, Kind: "WorkerPool"}, "pool", nil), true},
		{apierrors.NewBadRequest("spec: Invalid value"), true},
		{apierrors.NewUnauthorized("token expired"), false},
		{apierrors.NewNotFound(gr, "pool"), false},
		{apierrors.NewConflict(gr, "pool", errors.New("changed")), false},
		{apierrors.NewTooManyRequests("slow down", 1), false},
		{apierrors.NewTimeoutError("slow", 1), false},
		{apierrors.NewInternalError(errors.New("etcd")), false},
		{apierrors.NewServiceUnavailable("starting"), false},
		{errors.New("connection refused"), false},
		{nil, false},
	} {
		assert.Equal(t, tc.want, refused(tc.err), "%v", tc.err)
	}
}
