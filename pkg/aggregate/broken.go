package aggregate

import (
	"cmp"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"

	"tally.dev/tally/pkg/config"
)

// brokenWarnEvery is the least time between two Events about one parent's
// custom counts that cannot be kept.
const brokenWarnEvery = time.Hour

// brokenCounts are the custom counts of one kind that the aggregator cannot
// keep (config.CustomCount.Err: a ConfigMap edited by hand, a rollback to
// a version whose CEL lacks a function). They are left unwritten; the
// kind's other counts, its totals and its releases are served all the
// same. Each is reported once at start (a log line naming it, and
// tally_aggregator_custom_count_invalid), and by a Warning Event on each
// parent of the kind, at most one per parent per brokenWarnEvery.
type brokenCounts struct {
	kind string
	// message lists the counts and their errors, for the Events.
	message string

	mu sync.Mutex
	// warned is when each parent was last warned; pruned is when the
	// parents warned long ago (deleted ones among them) were last
	// forgotten.
	warned map[types.UID]time.Time
	pruned time.Time
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
		parts = append(parts, fmt.Sprintf("%q (%v)", c.Name, c.Err))
	}
	return &brokenCounts{
		kind:    kind,
		message: fmt.Sprintf("tally leaves unwritten the custom counts of %s it cannot keep: %s", kind, strings.Join(parts, "; ")),
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
