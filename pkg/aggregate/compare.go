package aggregate

import (
	"context"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/config"
)

// DefaultDriftAfter is how long a field a parent's operator keeps may differ
// from tally's count before the parent gets a Warning Event.
const DefaultDriftAfter = time.Minute

// OperatorValue reads the value a parent's operator keeps at path: absent is
// 0 (an operator's status struct may omit a zero), and a value that is not
// an integer cannot be compared (false).
func OperatorValue(parent *unstructured.Unstructured, path []string) (int64, bool) {
	v, found, err := unstructured.NestedFieldNoCopy(parent.Object, path...)
	if err != nil {
		return 0, false
	}
	if !found || v == nil {
		return 0, true
	}
	return ledger.ToInt64(v)
}

// compareCounts compares each field the parent's operator keeps with
// tally's count, records the difference for the metrics, and records a
// Warning Event on a parent whose field has differed for DriftAfter (once
// until it agrees again). It returns when the parent should be compared
// again to tell: 0 when no warning is due.
func (r *Reconciler) compareCounts(ctx context.Context, key parentKey, parent *unstructured.Unstructured, counts count.Counts) time.Duration {
	if len(r.compare) == 0 {
		return 0
	}
	if !r.mayWrite(ctx) || !r.sameView(ctx) || passOf(ctx).isLagged() {
		// Nothing compared from a view that stopped being fresh since the
		// count, nor from a parent older than the API server's (an apply
		// met a newer one): the parent comes back, fresh or read again.
		return conflictRequeue
	}
	now := time.Now()
	var again time.Duration
	for _, f := range r.compare {
		tally, known := counts.Value(f)
		if !known {
			// A custom count not known yet: the last difference stands.
			continue
		}
		path := strings.Join(f.Path, ".")
		operator, ok := OperatorValue(parent, f.Path)
		if !ok {
			if r.observed.compared.unreadable(key, parent.GetUID(), f.Count) {
				log.FromContext(ctx).Info("A field the operator keeps is not an integer; not compared until it is", "kind", r.kind,
					"parent", key.name.String(), "field", path, "count", f.Count)
			}
			continue
		}
		d := r.observed.compared.set(key, parent.GetUID(), f.Count, operator-tally, now)
		if d.by == 0 || d.warned {
			continue
		}
		if wait := d.since.Add(r.DriftAfter).Sub(now); wait > 0 {
			again = nonZeroMin(again, wait)
			continue
		}
		r.observed.compared.warn(key, f.Count)
		written := "not written"
		for _, w := range r.counts {
			if w.Count == f.Count {
				written = "written to " + strings.Join(w.Path, ".")
			}
		}
		since := now.Sub(d.since).Round(time.Second)
		log.FromContext(ctx).Info("A field the operator keeps differs from tally's count", "kind", r.kind, "parent", key.name.String(),
			"field", path, "operator", operator, "count", f.Count, "tally", tally, "for", since.String())
		if r.Recorder != nil {
			r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "CountDiffers", "Compare",
				"%s shows %d, but tally counts %d %s pods (%s); they have differed for %s: kubectl tally explain shows both beside a fresh count",
				path, operator, tally, f.Count, written, since)
		}
	}
	return again
}

func nonZeroMin(a, b time.Duration) time.Duration {
	if a == 0 {
		return b
	}
	return min(a, b)
}

// drift is how one field a parent's operator keeps differs from tally's
// count.
type drift struct {
	// uid is the parent's: a parent created again under the same name
	// starts anew.
	uid types.UID
	// by is the operator's value minus tally's.
	by int64
	// since is when it started to differ; warned, whether the parent got
	// its Event since.
	since  time.Time
	warned bool
	// notInteger: the operator's value is not an integer, and not
	// compared.
	notInteger bool
}

// compared is how the fields that parents' operators keep compare with
// tally's counts, for the metrics: each parent's last difference by count.
type compared struct {
	mu sync.Mutex
	// kinds are the counts compared, by kind, so that their series are
	// there (at 0) before the first parent is compared.
	kinds  map[string][]config.Count
	drifts map[parentKey]map[config.Count]*drift
}

func newCompared() *compared {
	return &compared{kinds: map[string][]config.Count{}, drifts: map[parentKey]map[config.Count]*drift{}}
}

// init records the counts of kind that are compared.
func (c *compared) init(kind string, fields []config.Field) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range fields {
		c.kinds[kind] = append(c.kinds[kind], f.Count)
	}
}

// set records the difference for count of parent, whose UID is uid, at
// now, and returns it: since stays as it was while the fields differ, by
// whatever, on the same parent.
func (c *compared) set(parent parentKey, uid types.UID, name config.Count, by int64, now time.Time) drift {
	c.mu.Lock()
	defer c.mu.Unlock()
	byCount := c.of(parent)
	d := byCount[name]
	switch {
	case d == nil || d.uid != uid || d.notInteger || d.by == 0 && by != 0:
		d = &drift{uid: uid, since: now}
		byCount[name] = d
	case by == 0:
		d.warned = false
	}
	d.by = by
	return *d
}

// unreadable records that the operator's field for count of parent is not
// an integer, and reports whether it was not known so.
func (c *compared) unreadable(parent parentKey, uid types.UID, name config.Count) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	byCount := c.of(parent)
	if d := byCount[name]; d != nil && d.uid == uid && d.notInteger {
		return false
	}
	byCount[name] = &drift{uid: uid, notInteger: true}
	return true
}

// of returns the drifts of parent, made empty if it has none; c.mu held.
func (c *compared) of(parent parentKey) map[config.Count]*drift {
	byCount := c.drifts[parent]
	if byCount == nil {
		byCount = map[config.Count]*drift{}
		c.drifts[parent] = byCount
	}
	return byCount
}

// warn records that parent got the Event of count's difference.
func (c *compared) warn(parent parentKey, name config.Count) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d := c.drifts[parent][name]; d != nil {
		d.warned = true
	}
}

// forget drops a parent that is gone.
func (c *compared) forget(parent parentKey) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.drifts, parent)
}

var (
	comparedDesc = prometheus.NewDesc("tally_aggregator_compared_parents",
		"Parents whose operator keeps a field that tally compares with its own count (shadow mode: the kind's compare), by parent kind and count (on the leader).",
		[]string{"kind", "count"}, nil)
	differingDesc = prometheus.NewDesc("tally_aggregator_compare_differing_parents",
		"Parents whose operator's field differs from tally's count when last compared, by parent kind and count (on the leader).",
		[]string{"kind", "count"}, nil)
	differenceDesc = prometheus.NewDesc("tally_aggregator_compare_difference",
		"Sum over the parents of how far the operator's field is from tally's count (the absolute difference), by parent kind and count (on the leader).",
		[]string{"kind", "count"}, nil)
)

// Collect sends the compared, differing and difference gauges of every
// kind and count compared.
func (c *compared) Collect(ch chan<- prometheus.Metric) {
	type sums struct{ parents, differing, difference float64 }
	c.mu.Lock()
	by := map[[2]string]*sums{}
	for kind, names := range c.kinds {
		for _, name := range names {
			by[[2]string{kind, string(name)}] = &sums{}
		}
	}
	for parent, byCount := range c.drifts {
		for name, d := range byCount {
			s := by[[2]string{parent.kind.String(), string(name)}]
			if s == nil || d.notInteger {
				continue
			}
			s.parents++
			if d.by != 0 {
				s.differing++
				s.difference += math.Abs(float64(d.by))
			}
		}
	}
	c.mu.Unlock()
	for _, k := range slices.SortedFunc(maps.Keys(by), func(a, b [2]string) int { return strings.Compare(a[0]+"/"+a[1], b[0]+"/"+b[1]) }) {
		s := by[k]
		ch <- prometheus.MustNewConstMetric(comparedDesc, prometheus.GaugeValue, s.parents, k[0], k[1])
		ch <- prometheus.MustNewConstMetric(differingDesc, prometheus.GaugeValue, s.differing, k[0], k[1])
		ch <- prometheus.MustNewConstMetric(differenceDesc, prometheus.GaugeValue, s.difference, k[0], k[1])
	}
}
