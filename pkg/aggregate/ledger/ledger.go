package ledger

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
)

// MaxLedger bounds how many pods a parent's ledger holds at once, as the
// Job controller bounds status.uncountedTerminatedPods: finished pods
// beyond it keep their finalizer until a fold makes room.
const MaxLedger = 500

// Book is what a parent's status says of its finished pods: the pods
// recorded as finished but not yet added to the totals (the ledger), and
// the totals.
type Book struct {
	// Completed and Unexpected are the ledger: the UIDs of recorded pods
	// that finished with and without an intent.
	Completed, Unexpected []types.UID
	// CompletedTotal and UnexpectedTotal are the totals.
	CompletedTotal, UnexpectedTotal int64
}

// Has reports whether uid is in the ledger.
func (b *Book) Has(uid types.UID) bool {
	return slices.Contains(b.Completed, uid) || slices.Contains(b.Unexpected, uid)
}

// Get returns the total named c; 0 for a count that is not a total.
func (b *Book) Get(c config.Count) int64 {
	switch c {
	case config.CompletedTotal:
		return b.CompletedTotal
	case config.UnexpectedTotal:
		return b.UnexpectedTotal
	}
	return 0
}

func (b *Book) size() int { return len(b.Completed) + len(b.Unexpected) }

// Equal reports whether two books hold the same ledger and totals.
func (b *Book) Equal(o *Book) bool {
	return b.CompletedTotal == o.CompletedTotal && b.UnexpectedTotal == o.UnexpectedTotal &&
		slices.Equal(b.Completed, o.Completed) && slices.Equal(b.Unexpected, o.Unexpected)
}

// LivePod is what the API server, read just now, says of one pod.
type LivePod struct {
	// Tracking reports that the pod carries keys.TrackingFinalizer.
	Tracking bool
	// Intent reports that the pod carries a keys.CompletionIntent tally
	// admitted: the only one that counts on a finished pod.
	Intent bool
}

// Live is what the API server said just now of the pods it was asked about.
// The zero Live knows nothing.
type Live struct {
	// Pods holds the pods asked about and found, by UID.
	Pods map[types.UID]LivePod
	// Asked holds the UIDs of the pods asked about: one asked about and not
	// in Pods is gone. Nil with All.
	Asked map[types.UID]bool
	// All reports that every pod of the parent was read: a pod not in Pods
	// is gone.
	All bool
}

// knows reports what the API server said of uid, and whether it was asked.
func (l *Live) knows(uid types.UID) (LivePod, bool) {
	if l.All || l.Asked[uid] {
		return l.Pods[uid], true
	}
	return LivePod{}, false
}

// Step is what one reconcile does about a parent's finished pods.
type Step struct {
	// Book is the ledger and totals the parent must show next.
	Book Book
	// Release are the pods whose finalizer goes once Book is written: they
	// are recorded in it.
	Release []*count.Pod
	// Track are the pods that must carry the finalizer and do not.
	Track []*count.Pod
	// Confirm are the cached pods whose state decides the step and that the
	// cache cannot vouch for: each is read from the API server (a GET) and
	// the step taken again. Until then they are left as they are: not
	// recorded, or kept in the ledger.
	Confirm []*count.Pod
	// Unlisted reports a ledger UID that the cache does not show and this
	// process did not release: only a list of the parent's pods tells
	// whether it is gone. It is kept in the ledger until then.
	Unlisted bool
}

// Settled reports whether the step decided everything: nothing waits for
// the API server's word.
func (s *Step) Settled() bool { return len(s.Confirm) == 0 && !s.Unlisted }

// Advance takes one step of the ledger protocol for the parent's pods in S(P)
// (pods), from what its status shows (book).
//
// The protocol (docs/how-it-works.md): a finished pod carrying the
// finalizer is first recorded in the ledger (a status write); its finalizer
// is removed only once the ledger holding it is written; a ledger UID whose
// pod no longer carries the finalizer is folded into its total and leaves the
// ledger in one status write. A pod is recorded only if it is not in the
// ledger and the API server shows it with the finalizer; a UID is folded
// only once its finalizer is known to be gone. So a pod is added to a total
// once: while it carries the finalizer it is not folded, and once the
// finalizer is gone it is never recorded again.
//
// released reports the pods whose finalizer this process removed (a patch
// the API server accepted): for them the cache's view is not needed. live
// holds what the API server said of the pods a previous step asked to
// Confirm (or of them all). Any decision the cache alone cannot make safely
// (a pod the cache may show stale) is left for later and its pod named in
// Confirm; the rest of the step is taken. As the Job controller does with
// its own finalizer removals, nothing is read for a pod this process
// released, and at most the candidates are read, never the parent's pods:
// a list is asked for (Unlisted) only for a ledger UID the cache has never
// shown, which happens after a restart when its pod was deleted meanwhile.
func Advance(pods []*count.Pod, book Book, released func(types.UID) bool, live Live) Step {
	cached := make(map[types.UID]*count.Pod, len(pods))
	for _, p := range pods {
		cached[p.UID] = p
	}
	step := Step{Book: Book{CompletedTotal: book.CompletedTotal, UnexpectedTotal: book.UnexpectedTotal}}
	confirm := func(p *count.Pod) { step.Confirm = append(step.Confirm, p) }
	var release []types.UID
	keep := func(uids []types.UID, total *int64) []types.UID {
		var out []types.UID
		for _, uid := range uids {
			p, shown := cached[uid]
			lp, asked := live.knows(uid)
			switch {
			case released(uid), asked && !lp.Tracking:
				*total++
			case asked, shown && p.Tracking:
				// Carries it (perhaps stale in the cache: removing a
				// finalizer already gone is harmless).
				out = append(out, uid)
				release = append(release, uid)
			case shown:
				out = append(out, uid)
				confirm(p)
			default:
				out = append(out, uid)
				step.Unlisted = true
			}
		}
		return out
	}
	step.Book.Completed = keep(book.Completed, &step.Book.CompletedTotal)
	step.Book.Unexpected = keep(book.Unexpected, &step.Book.UnexpectedTotal)

	room := MaxLedger - step.Book.size()
	for _, p := range pods {
		switch {
		case !p.Finished():
			// Only a pod stamped with its parent's identity is given the
			// finalizer (the chart's policy refuses the others).
			if !p.Tracking && !p.Misstamped {
				step.Track = append(step.Track, p)
			}
			continue
		case !p.Tracking || book.Has(p.UID) || released(p.UID) || room <= 0:
			continue
		}
		lp, asked := live.knows(p.UID)
		switch {
		case !asked:
			confirm(p)
			room--
			continue
		case !lp.Tracking:
			continue
		}
		room--
		if lp.Intent || p.Intent {
			step.Book.Completed = append(step.Book.Completed, p.UID)
		} else {
			step.Book.Unexpected = append(step.Book.Unexpected, p.UID)
		}
		release = append(release, p.UID)
	}
	for _, uid := range release {
		if p, ok := cached[uid]; ok {
			step.Release = append(step.Release, p)
		}
	}
	return step
}

// ReadBook reads the ledger at ledger and the totals at the paths mapped
// in fields from a parent's object. Absent fields are empty.
func ReadBook(obj map[string]any, ledger []string, fields []config.Field) (Book, error) {
	var b Book
	for _, f := range fields {
		var total *int64
		switch f.Count {
		case config.CompletedTotal:
			total = &b.CompletedTotal
		case config.UnexpectedTotal:
			total = &b.UnexpectedTotal
		default:
			continue
		}
		v, found, err := nestedField(obj, f.Path)
		if err != nil || !found {
			continue
		}
		n, ok := ToInt64(v)
		if !ok || n < 0 {
			return Book{}, fmt.Errorf("%s holds %v, not a total", joinPath(f.Path), v)
		}
		*total = n
	}
	v, found, err := nestedField(obj, ledger)
	if err != nil || !found || v == nil {
		return b, nil
	}
	m, ok := v.(map[string]any)
	if !ok {
		return Book{}, fmt.Errorf("the ledger %s is a %T, not an object", joinPath(ledger), v)
	}
	for key, dst := range map[string]*[]types.UID{"completed": &b.Completed, "unexpected": &b.Unexpected} {
		list, _ := m[key].([]any)
		if m[key] != nil && list == nil {
			return Book{}, fmt.Errorf("the ledger %s.%s is a %T, not a list of pod UIDs", joinPath(ledger), key, m[key])
		}
		for _, e := range list {
			s, ok := e.(string)
			if !ok || s == "" {
				return Book{}, fmt.Errorf("the ledger %s.%s holds %v, not a pod UID", joinPath(ledger), key, e)
			}
			*dst = append(*dst, types.UID(s))
		}
	}
	return b, nil
}

// LedgerValue returns the ledger as it is written to the parent's status.
func (b *Book) LedgerValue() map[string]any {
	list := func(uids []types.UID) []any {
		out := make([]any, len(uids))
		for i, u := range uids {
			out[i] = string(u)
		}
		return out
	}
	return map[string]any{"completed": list(b.Completed), "unexpected": list(b.Unexpected)}
}

func nestedField(obj map[string]any, path []string) (any, bool, error) {
	return unstructured.NestedFieldNoCopy(obj, path...)
}

func joinPath(path []string) string { return strings.Join(path, ".") }

// ToInt64 returns v as an integer, as decoded from JSON or set by the
// aggregator.
func ToInt64(v any) (int64, bool) {
	switch n := v.(type) {
	case int64:
		return n, true
	case int32:
		return int64(n), true
	case int:
		return int64(n), true
	case float64:
		if n == math.Trunc(n) && math.Abs(n) < 1<<53 {
			return int64(n), true
		}
	}
	return 0, false
}

// PodBatch bounds the pods one reconcile reads from the API server, and the
// finalizer patches it sends: the rest wait for the next reconcile of the
// parent, which follows at once.
const PodBatch = 100

// Batch returns the pods to track and to release in one reconcile, at most
// PodBatch in all, releases first: they record the finish of pods.
func Batch(track, release []*count.Pod) ([]*count.Pod, []*count.Pod) {
	release = release[:min(len(release), PodBatch)]
	return track[:min(len(track), PodBatch-len(release))], release
}

// FoldDelay is how long the fold of pods this process just released may
// wait for a record to ride with: pods finishing one at a time then cost
// one ledger write each (the next pod's record carries the last one's
// fold) instead of two. The totals may show a finished pod up to about
// this much later.
const FoldDelay = time.Second

// FoldWait returns how long the step may wait before it is written: a step
// that only folds pods this process released less than FoldDelay ago, and
// does nothing else, waits for the next record or for the delay, whichever
// comes first. Zero when it is to be written now.
func FoldWait(book *Book, step *Step, released map[types.UID]time.Time, now time.Time) time.Duration {
	if step.Book.Equal(book) || len(step.Release) > 0 || len(step.Track) > 0 || !step.Settled() || book.size() >= MaxLedger/2 {
		return 0
	}
	for _, uid := range slices.Concat(step.Book.Completed, step.Book.Unexpected) {
		if !book.Has(uid) {
			return 0 // a record: written now, with the folds
		}
	}
	wait := FoldDelay
	for _, uid := range slices.Concat(book.Completed, book.Unexpected) {
		if step.Book.Has(uid) {
			continue
		}
		at, ok := released[uid]
		if !ok {
			return 0 // folded from the API server's word: no release to pair with
		}
		// The first released is due first.
		wait = min(wait, FoldDelay-now.Sub(at))
	}
	return max(wait, 0)
}
