package aggregate

import (
	"cmp"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"

	"tally.dev/tally/pkg/config"
)

// brokenWarnEvery is the least time between two Events about one parent's
// custom counts that cannot be kept.
const brokenWarnEvery = time.Hour

// maxNote is the longest note the API server takes in an Event
// (events.k8s.io/v1); a longer one is refused, and the Event lost.
const maxNote = 1024

// brokenCounts are the custom counts of one kind that the aggregator cannot
// keep (config.CustomCount.Err: a ConfigMap edited by hand, a rollback to
// a version whose CEL lacks a function). They are left unwritten; the
// kind's other counts, its totals and its releases are served all the
// same. Each is reported once at start (a log line naming it, and
// tally_aggregator_custom_count_invalid), and by a Warning Event on each
// parent of the kind, at most one per parent per brokenWarnEvery.
type brokenCounts struct {
	// message lists the counts and their errors, for the Events.
	message string

	mu sync.Mutex
	// warned is when each parent was last warned; pruned is when the
	// parents warned long ago (deleted ones among them) were last
	// forgotten.
	warned map[types.UID]time.Time
	pruned time.Time
}

// CustomCountReports are the custom counts of each kind that the
// aggregator cannot keep, reported once per process: the managers it
// starts again (after a lost lease, an outage) share them, so that a
// parent is warned at most once per brokenWarnEvery whatever happens.
type CustomCountReports struct {
	kinds map[schema.GroupKind]*brokenCounts
}

// NewCustomCountReports logs and exports the custom counts of parents that
// cannot be kept.
func NewCustomCountReports(parents []config.Parent) *CustomCountReports {
	r := &CustomCountReports{kinds: map[schema.GroupKind]*brokenCounts{}}
	for _, p := range parents {
		r.kinds[p.GroupKind()] = newBrokenCounts(p)
	}
	return r
}

// of returns the broken custom counts of p; r nil reports them anew.
func (r *CustomCountReports) of(p config.Parent) *brokenCounts {
	if r == nil {
		return newBrokenCounts(p)
	}
	return r.kinds[p.GroupKind()]
}

// newBrokenCounts returns the broken custom counts of p, reported; nil when
// it has none.
func newBrokenCounts(p config.Parent) *brokenCounts {
	kind := p.GroupKind().String()
	broken := p.Broken()
	for i, c := range p.CustomCounts {
		v := 0.0
		if c.Err != nil {
			v = 1
		}
		customCountInvalid.WithLabelValues(kind, cmp.Or(c.Name, fmt.Sprintf("customCounts[%d]", i))).Set(v)
	}
	if len(broken) == 0 {
		return nil
	}
	log := ctrl.Log.WithName("aggregator")
	var parts []string
	for _, c := range broken {
		log.Error(c.Err, "A custom count cannot be kept: its field is left unwritten, the kind's other counts, totals and releases are served (fix the configuration: kubectl tally doctor shows the error)",
			"kind", kind, "count", c.Name)
		parts = append(parts, fmt.Sprintf("%q (%s)", c.Name, oneLine(c.Err)))
	}
	message := fmt.Sprintf("tally leaves unwritten the custom counts of %s it cannot keep (the aggregator's log and kubectl tally doctor give each error): %s",
		kind, strings.Join(parts, "; "))
	if len(message) > maxNote {
		message = strings.ToValidUTF8(message[:maxNote-len("…")], "") + "…"
	}
	return &brokenCounts{
		message: message,
		warned:  map[types.UID]time.Time{},
		pruned:  time.Now(),
	}
}

// warn records a Warning Event on parent, unless one was recorded less than
// brokenWarnEvery before now.
func (b *brokenCounts) warn(recorder events.EventRecorder, parent runtime.Object, uid types.UID, now time.Time) {
	if b == nil || recorder == nil {
		return
	}
	b.mu.Lock()
	last, seen := b.warned[uid]
	due := !seen || now.Sub(last) >= brokenWarnEvery
	if due {
		b.warned[uid] = now
	}
	if now.Sub(b.pruned) >= brokenWarnEvery {
		b.pruned = now
		for other, at := range b.warned {
			if now.Sub(at) >= brokenWarnEvery {
				delete(b.warned, other)
			}
		}
	}
	b.mu.Unlock()
	if due {
		recorder.Eventf(parent, nil, corev1.EventTypeWarning, "CustomCountInvalid", "ApplyCounts", "%s", b.message)
	}
}

// oneLine is err on one line, without the lines that quote the expression
// and point at a column in it (CEL's " | ..." lines).
func oneLine(err error) string {
	var kept []string
	for line := range strings.Lines(err.Error()) {
		if line = strings.TrimRight(line, "\n"); !strings.HasPrefix(line, " | ") {
			kept = append(kept, line)
		}
	}
	return strings.Join(kept, " ")
}
