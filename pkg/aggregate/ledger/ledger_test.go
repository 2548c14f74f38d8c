package ledger

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/count/counttest"
	"tally.dev/tally/pkg/config"
)

func none(types.UID) bool { return false }

// asked is a Live that asked about the pods in pods, and found them.
func asked(pods map[types.UID]LivePod) Live {
	l := Live{Pods: pods, Asked: map[types.UID]bool{}}
	for uid := range pods {
		l.Asked[uid] = true
	}
	return l
}

func TestAdvance(t *testing.T) {
	running := counttest.Pod("run", corev1.PodRunning, true, false, false)
	untracked := counttest.Pod("new", corev1.PodRunning, false, false, false)
	failed := counttest.Pod("fail", corev1.PodFailed, true, false, false)
	done := counttest.Pod("done", corev1.PodSucceeded, true, true, false)
	deleting := counttest.Pod("del", corev1.PodRunning, true, false, true)
	deletingIntent := counttest.Pod("deli", corev1.PodPending, true, true, true)
	gone := counttest.Pod("gone", corev1.PodSucceeded, false, false, false)
	released := func(uid types.UID) bool { return uid == "fail" }

	tests := []struct {
		name     string
		pods     []*count.Pod
		book     Book
		released func(types.UID) bool
		live     Live
		want     Step
	}{
		{
			name: "nothing finished: pods without the finalizer get it",
			pods: []*count.Pod{running, untracked},
			want: Step{Track: []*count.Pod{untracked}},
		},
		{
			name: "a finished pod needs the API server's word: it alone is read",
			pods: []*count.Pod{running, failed},
			want: Step{Confirm: []*count.Pod{failed}},
		},
		{
			name: "finished pods are recorded by class, and released",
			pods: []*count.Pod{failed, done, deleting, deletingIntent},
			live: asked(map[types.UID]LivePod{"fail": {Tracking: true}, "done": {Tracking: true, Intent: true}, "del": {Tracking: true}, "deli": {Tracking: true, Intent: true}}),
			want: Step{
				Book:    Book{Completed: []types.UID{"done", "deli"}, Unexpected: []types.UID{"fail", "del"}},
				Release: []*count.Pod{failed, done, deleting, deletingIntent},
			},
		},
		{
			name: "a pod the cache shows stale (its finalizer gone) is not recorded",
			pods: []*count.Pod{failed},
			live: asked(map[types.UID]LivePod{"fail": {}}),
			want: Step{},
		},
		{
			name: "a pod gone from the API server is not recorded",
			pods: []*count.Pod{failed},
			live: Live{Asked: map[types.UID]bool{"fail": true}},
			want: Step{},
		},
		{
			name: "only the pods asked about are decided; the others are asked for again",
			pods: []*count.Pod{failed, done},
			live: asked(map[types.UID]LivePod{"fail": {Tracking: true}}),
			want: Step{Book: Book{Unexpected: []types.UID{"fail"}}, Release: []*count.Pod{failed}, Confirm: []*count.Pod{done}},
		},
		{
			name:     "a pod this process released is neither recorded nor read",
			pods:     []*count.Pod{failed},
			released: released,
			want:     Step{},
		},
		{
			name:     "a released ledger pod is folded without a read",
			pods:     []*count.Pod{failed},
			book:     Book{Unexpected: []types.UID{"fail"}, UnexpectedTotal: 4, CompletedTotal: 2},
			released: released,
			want:     Step{Book: Book{CompletedTotal: 2, UnexpectedTotal: 5}},
		},
		{
			name: "a ledger pod still carrying the finalizer stays, and is released",
			pods: []*count.Pod{done},
			book: Book{Completed: []types.UID{"done"}},
			want: Step{Book: Book{Completed: []types.UID{"done"}}, Release: []*count.Pod{done}},
		},
		{
			name: "a ledger pod the cache shows without the finalizer is kept until the API server's word",
			pods: []*count.Pod{gone, failed},
			book: Book{Unexpected: []types.UID{"gone"}},
			want: Step{Book: Book{Unexpected: []types.UID{"gone"}}, Confirm: []*count.Pod{gone, failed}},
		},
		{
			name: "a ledger pod the API server shows without the finalizer is folded",
			pods: []*count.Pod{gone},
			book: Book{Unexpected: []types.UID{"gone"}},
			live: asked(map[types.UID]LivePod{"gone": {}}),
			want: Step{Book: Book{UnexpectedTotal: 1}},
		},
		{
			name: "a ledger pod the cache has never shown needs a list",
			book: Book{Completed: []types.UID{"a"}},
			want: Step{Book: Book{Completed: []types.UID{"a"}}, Unlisted: true},
		},
		{
			name: "ledger pods gone from the API server are folded",
			book: Book{Completed: []types.UID{"a"}, Unexpected: []types.UID{"b", "c"}, CompletedTotal: 1},
			live: Live{Pods: map[types.UID]LivePod{"c": {Tracking: true}}, All: true},
			want: Step{Book: Book{Unexpected: []types.UID{"c"}, CompletedTotal: 2, UnexpectedTotal: 1}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.released == nil {
				tc.released = none
			}
			got := Advance(tc.pods, tc.book, tc.released, tc.live)
			assert.Equal(t, tc.want.Unlisted, got.Unlisted, "unlisted")
			assert.ElementsMatch(t, counttest.UIDs(tc.want.Confirm), counttest.UIDs(got.Confirm), "confirm")
			assert.True(t, tc.want.Book.Equal(&got.Book), "book: got %+v, want %+v", got.Book, tc.want.Book)
			assert.ElementsMatch(t, counttest.UIDs(tc.want.Release), counttest.UIDs(got.Release), "release")
			assert.ElementsMatch(t, counttest.UIDs(tc.want.Track), counttest.UIDs(got.Track), "track")
		})
	}
}

// TestAdvanceBoundsTheLedger: at most MaxLedger pods wait in the ledger;
// the others keep their finalizer until a fold makes room.
func TestAdvanceBoundsTheLedger(t *testing.T) {
	var pods []*count.Pod
	live := Live{Pods: map[types.UID]LivePod{}, All: true}
	for i := range MaxLedger + 20 {
		uid := types.UID(fmt.Sprintf("p%04d", i))
		pods = append(pods, counttest.Pod(uid, corev1.PodFailed, true, false, false))
		live.Pods[uid] = LivePod{Tracking: true}
	}
	book := Book{Unexpected: []types.UID{"old"}}
	first := Advance(pods, book, none, Live{})
	assert.Len(t, first.Confirm, MaxLedger-1, "no more pods are read than the ledger has room for")
	assert.True(t, first.Unlisted)
	step := Advance(pods, book, none, live)
	assert.Len(t, step.Book.Unexpected, MaxLedger)
	assert.Equal(t, int64(1), step.Book.UnexpectedTotal, "the ledger pod gone from the API server is folded first")
	assert.Len(t, step.Release, MaxLedger)
}

// TestAdvanceCountsOnce replays a pod's life with the process failing at
// each point: a crash before its status write lands, a crash between the
// write and the finalizer's removal, a removal the API server applied whose
// answer was lost. The cache lags the API server (it shows the pod as it was
// a few rounds before, as a new leader's cache can: before the finalizer was
// added, for a pod tracked after its creation) and the pod may be deleted
// once its finalizer is gone. Whatever the point, the pod is added
// to its total once and the ledger empties, reading from the API server
// only the pod itself, and listing the parent's pods only when the ledger
// holds a pod the cache never showed.
func TestAdvanceCountsOnce(t *testing.T) {
	type state struct{ exists, tracking bool }
	for _, lag := range []int{0, 1, 3} {
		for _, deleted := range []bool{false, true} {
			for crash := range 3 * 8 {
				failure, round := crash%3, crash/3
				t.Run(fmt.Sprintf("lag %d, deleted %v, failure %d at round %d", lag, deleted, failure, round), func(t *testing.T) {
					var book Book
					api := state{exists: true, tracking: true}
					// Created untracked, given the finalizer at once.
					history := []state{{exists: true}, api}
					remembered := map[types.UID]bool{}
					lists := 0
					for r := range 16 {
						cache := history[max(0, len(history)-1-lag)]
						if lag > 0 && failure < 2 && r > round && r <= round+lag {
							// The new process's cache is further behind
							// than the crashed one's was.
							cache = history[0]
						}
						if r >= 12 {
							cache = api // caught up
						}
						var pods []*count.Pod
						if cache.exists {
							pods = []*count.Pod{counttest.Pod("p", corev1.PodFailed, cache.tracking, false, false)}
						}
						released := func(u types.UID) bool { return remembered[u] }
						step := Advance(pods, book, released, Live{})
						if !step.Settled() {
							live := Live{Pods: map[types.UID]LivePod{}, Asked: map[types.UID]bool{}, All: step.Unlisted}
							if step.Unlisted {
								lists++
							}
							for _, p := range step.Confirm {
								live.Asked[p.UID] = true
							}
							if api.exists {
								live.Pods["p"] = LivePod{Tracking: api.tracking}
							}
							step = Advance(pods, book, released, live)
						}
						release := func(remember bool) {
							for _, p := range step.Release {
								api.tracking = false
								api.exists = api.exists && !deleted
								remembered[p.UID] = remember
							}
						}
						switch {
						case r == round && failure == 0:
							// Crash before the status write: a new process
							// remembers nothing.
							remembered = map[types.UID]bool{}
						case r == round && failure == 1:
							// Crash after the write, before the release.
							book = step.Book
							remembered = map[types.UID]bool{}
						case r == round:
							// The release applied, its answer lost.
							book = step.Book
							release(false)
						default:
							book = step.Book
							release(true)
						}
						history = append(history, api)
					}
					assert.Equal(t, Book{UnexpectedTotal: 1}, book)
					if !deleted {
						assert.Zero(t, lists, "a pod the cache shows is read alone, never listed")
					}
				})
			}
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

func TestBatch(t *testing.T) {
	pods := func(n int) []*count.Pod { return make([]*count.Pod, n) }
	tests := []struct {
		name                   string
		track, release         int
		wantTrack, wantRelease int
	}{
		{"few", 10, 5, 10, 5},
		{"releases first", 500, 60, 40, 60},
		{"releases alone fill a batch", 10, 300, 0, PodBatch},
		{"tracking alone", 2000, 0, PodBatch, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			track, release := Batch(pods(tc.track), pods(tc.release))
			assert.Len(t, track, tc.wantTrack)
			assert.Len(t, release, tc.wantRelease)
		})
	}
}

func TestFoldWait(t *testing.T) {
	now := time.Now()
	ledger := Book{Unexpected: []types.UID{"a", "b"}}
	folded := Step{Book: Book{Unexpected: []types.UID{"b"}, UnexpectedTotal: 1}}
	tests := []struct {
		name     string
		step     Step
		released map[types.UID]time.Time
		want     time.Duration
	}{
		{"a fold of a pod released just now waits", folded, map[types.UID]time.Time{"a": now.Add(-200 * time.Millisecond)}, 800 * time.Millisecond},
		{"a fold of a pod released long enough ago is due", folded, map[types.UID]time.Time{"a": now.Add(-2 * time.Second)}, 0},
		{"a fold from the API server's word is written now", folded, nil, 0},
		{"a record is written now, folds and all", Step{Book: Book{Unexpected: []types.UID{"b", "c"}, UnexpectedTotal: 1}}, map[types.UID]time.Time{"a": now}, 0},
		{"a step that releases is written now", Step{Book: folded.Book, Release: []*count.Pod{{}}}, map[types.UID]time.Time{"a": now}, 0},
		{"nothing to write", Step{Book: ledger}, nil, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, FoldWait(&ledger, &tc.step, tc.released, now))
		})
	}
}
