package aggregate

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/config"
)

// cachedPod is a pod as the cache shows it.
func cachedPod(uid types.UID, phase corev1.PodPhase, tracking, intent, deleting bool) *Pod {
	p := &Pod{ObjectMeta: metav1.ObjectMeta{Name: string(uid), Namespace: "ns", UID: uid}, Phase: phase, Tracking: tracking, Intent: intent}
	if deleting {
		p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	}
	return p
}

func none(types.UID) bool { return false }

func names(pods []*Pod) []types.UID {
	var out []types.UID
	for _, p := range pods {
		out = append(out, p.UID)
	}
	return out
}

func TestAdvance(t *testing.T) {
	running := cachedPod("run", corev1.PodRunning, true, false, false)
	untracked := cachedPod("new", corev1.PodRunning, false, false, false)
	failed := cachedPod("fail", corev1.PodFailed, true, false, false)
	done := cachedPod("done", corev1.PodSucceeded, true, true, false)
	deleting := cachedPod("del", corev1.PodRunning, true, false, true)
	deletingIntent := cachedPod("deli", corev1.PodPending, true, true, true)
	gone := cachedPod("gone", corev1.PodSucceeded, false, false, false)
	released := func(uid types.UID) bool { return uid == "fail" }

	tests := []struct {
		name     string
		pods     []*Pod
		book     Book
		released func(types.UID) bool
		live     map[types.UID]LivePod
		want     Step
	}{
		{
			name: "nothing finished: pods without the finalizer get it",
			pods: []*Pod{running, untracked},
			want: Step{Track: []*Pod{untracked}},
		},
		{
			name: "a finished pod needs the API server's word",
			pods: []*Pod{running, failed},
			want: Step{NeedLive: true},
		},
		{
			name: "finished pods are recorded by class, and released",
			pods: []*Pod{failed, done, deleting, deletingIntent},
			live: map[types.UID]LivePod{"fail": {Tracking: true}, "done": {Tracking: true, Intent: true}, "del": {Tracking: true}, "deli": {Tracking: true, Intent: true}},
			want: Step{
				Book:    Book{Completed: []types.UID{"done", "deli"}, Unexpected: []types.UID{"fail", "del"}},
				Release: []*Pod{failed, done, deleting, deletingIntent},
			},
		},
		{
			name: "a pod the cache shows stale (its finalizer gone) is not recorded",
			pods: []*Pod{failed},
			live: map[types.UID]LivePod{"fail": {}},
			want: Step{},
		},
		{
			name:     "a pod this process released is neither recorded nor read",
			pods:     []*Pod{failed},
			released: released,
			want:     Step{},
		},
		{
			name:     "a released ledger pod is folded without a read",
			pods:     []*Pod{failed},
			book:     Book{Unexpected: []types.UID{"fail"}, UnexpectedTotal: 4, CompletedTotal: 2},
			released: released,
			want:     Step{Book: Book{CompletedTotal: 2, UnexpectedTotal: 5}},
		},
		{
			name: "a ledger pod still carrying the finalizer stays, and is released",
			pods: []*Pod{done},
			book: Book{Completed: []types.UID{"done"}},
			want: Step{Book: Book{Completed: []types.UID{"done"}}, Release: []*Pod{done}},
		},
		{
			name: "a ledger pod the cache shows without the finalizer needs the API server's word",
			pods: []*Pod{gone},
			book: Book{Unexpected: []types.UID{"gone"}},
			want: Step{NeedLive: true},
		},
		{
			name: "ledger pods gone from the API server are folded",
			book: Book{Completed: []types.UID{"a"}, Unexpected: []types.UID{"b", "c"}, CompletedTotal: 1},
			live: map[types.UID]LivePod{"c": {Tracking: true}},
			want: Step{Book: Book{Unexpected: []types.UID{"c"}, CompletedTotal: 2, UnexpectedTotal: 1}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.released == nil {
				tc.released = none
			}
			got := Advance(tc.pods, tc.book, tc.released, tc.live)
			assert.Equal(t, tc.want.NeedLive, got.NeedLive)
			assert.True(t, tc.want.Book.Equal(&got.Book), "book: got %+v, want %+v", got.Book, tc.want.Book)
			assert.ElementsMatch(t, names(tc.want.Release), names(got.Release), "release")
			assert.ElementsMatch(t, names(tc.want.Track), names(got.Track), "track")
		})
	}
}

// TestAdvanceBoundsTheLedger: at most MaxLedger pods wait in the ledger;
// the others keep their finalizer until a fold makes room.
func TestAdvanceBoundsTheLedger(t *testing.T) {
	var pods []*Pod
	live := map[types.UID]LivePod{}
	for i := range MaxLedger + 20 {
		uid := types.UID(fmt.Sprintf("p%04d", i))
		pods = append(pods, cachedPod(uid, corev1.PodFailed, true, false, false))
		live[uid] = LivePod{Tracking: true}
	}
	book := Book{Unexpected: []types.UID{"old"}}
	step := Advance(pods, book, none, live)
	assert.Len(t, step.Book.Unexpected, MaxLedger)
	assert.Equal(t, int64(1), step.Book.UnexpectedTotal, "the ledger pod gone from the API server is folded first")
	assert.Len(t, step.Release, MaxLedger)
}

// TestAdvanceCountsOnce replays a pod's life with the process crashing at
// each point (before its status write lands, or between the write and the
// finalizer's removal), with a cache that shows the finalizer long after it
// is gone: the pod is added to its total once, and the ledger empties.
func TestAdvanceCountsOnce(t *testing.T) {
	for _, stale := range []bool{false, true} {
		for crash := range 8 {
			t.Run(fmt.Sprintf("stale cache %v, crash %d", stale, crash), func(t *testing.T) {
				var book Book
				apiTracking := true
				remembered := map[types.UID]bool{}
				for round := range 12 {
					// The cache catches up at round 10 when stale.
					cacheTracking := apiTracking || (stale && round < 10)
					pod := cachedPod("p", corev1.PodFailed, cacheTracking, false, false)
					released := func(u types.UID) bool { return remembered[u] }
					step := Advance([]*Pod{pod}, book, released, nil)
					if step.NeedLive {
						step = Advance([]*Pod{pod}, book, released, map[types.UID]LivePod{"p": {Tracking: apiTracking}})
					}
					switch {
					case round == crash && crash%2 == 0:
						// Crash before the status write: a new process
						// remembers nothing.
						remembered = map[types.UID]bool{}
						continue
					case round == crash:
						// Crash after the write, before the release.
						book = step.Book
						remembered = map[types.UID]bool{}
						continue
					}
					book = step.Book
					for _, p := range step.Release {
						apiTracking = false
						remembered[p.UID] = true
					}
				}
				assert.Equal(t, Book{UnexpectedTotal: 1}, book)
			})
		}
	}
}

func TestReadBook(t *testing.T) {
	fields := []config.Field{{Count: config.CompletedTotal, Path: []string{"status", "done"}}, {Count: config.Active, Path: []string{"status", "active"}}}
	ledger := []string{"status", "ledger"}
	tests := []struct {
		name    string
		status  map[string]any
		want    Book
		wantErr string
	}{
		{name: "empty status", status: map[string]any{}},
		{
			name:   "ledger and total",
			status: map[string]any{"done": int64(3), "ledger": map[string]any{"completed": []any{"a"}, "unexpected": []any{"b", "c"}}},
			want:   Book{Completed: []types.UID{"a"}, Unexpected: []types.UID{"b", "c"}, CompletedTotal: 3},
		},
		{name: "total from JSON", status: map[string]any{"done": float64(7)}, want: Book{CompletedTotal: 7}},
		{name: "negative total", status: map[string]any{"done": int64(-1)}, wantErr: "status.done holds -1, not a total"},
		{name: "ledger not an object", status: map[string]any{"ledger": "x"}, wantErr: "the ledger status.ledger is a string"},
		{name: "ledger list not a list", status: map[string]any{"ledger": map[string]any{"completed": "a"}}, wantErr: "status.ledger.completed is a string"},
		{name: "ledger entry not a UID", status: map[string]any{"ledger": map[string]any{"unexpected": []any{int64(1)}}}, wantErr: "holds 1, not a pod UID"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadBook(map[string]any{"status": tc.status}, ledger, fields)
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}
