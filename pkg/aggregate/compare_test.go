package aggregate

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
)

// TestCompared: a difference keeps the time it started at while the fields
// differ, by whatever; agreeing again ends it, and a later difference
// starts anew, warned again. The gauges sum the parents by kind and count,
// there at 0 before any parent is compared, and forget a parent gone.
func TestCompared(t *testing.T) {
	kind := schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}
	a := parentKey{kind: kind, name: types.NamespacedName{Namespace: "ns", Name: "a"}}
	b := parentKey{kind: kind, name: types.NamespacedName{Namespace: "ns", Name: "b"}}
	t0 := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	c := newCompared()
	c.init(kind.String(), config.Parent{Compare: map[config.Count]string{config.Completing: "status.legacy"}}.CompareFields())

	gauges := func() string {
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(comparedCollector{c})
		families, err := reg.Gather()
		assert.NoError(t, err)
		var out []string
		for _, f := range families {
			for _, m := range f.GetMetric() {
				out = append(out, fmt.Sprintf("%s=%g", f.GetName(), m.GetGauge().GetValue()))
			}
		}
		return strings.Join(out, " ")
	}
	assert.Equal(t, "tally_aggregator_compare_difference=0 tally_aggregator_compare_differing_parents=0 tally_aggregator_compared_parents=0", gauges())

	d := c.set(a, "uid-a", config.Completing, 2, t0)
	assert.Equal(t, drift{uid: "uid-a", by: 2, since: t0}, d)
	c.warn(a, config.Completing)
	d = c.set(a, "uid-a", config.Completing, -1, t0.Add(time.Minute))
	assert.Equal(t, drift{uid: "uid-a", by: -1, since: t0, warned: true}, d, "still differing: the same episode")
	c.set(b, "uid-b", config.Completing, 0, t0)
	assert.Equal(t, "tally_aggregator_compare_difference=1 tally_aggregator_compare_differing_parents=1 tally_aggregator_compared_parents=2", gauges())

	c.set(a, "uid-a", config.Completing, 0, t0.Add(2*time.Minute))
	d = c.set(a, "uid-a", config.Completing, 3, t0.Add(3*time.Minute))
	assert.Equal(t, drift{uid: "uid-a", by: 3, since: t0.Add(3 * time.Minute)}, d, "a new episode, not warned")
	c.warn(a, config.Completing)
	d = c.set(a, "uid-a2", config.Completing, 3, t0.Add(4*time.Minute))
	assert.Equal(t, drift{uid: "uid-a2", by: 3, since: t0.Add(4 * time.Minute)}, d, "a parent created again under the name: a new episode")
	c.set(b, "uid-b", config.Completing, math.MinInt64, t0)
	assert.Equal(t, "tally_aggregator_compare_difference=9.223372036854776e+18 tally_aggregator_compare_differing_parents=2 tally_aggregator_compared_parents=2", gauges(),
		"an absolute difference, whatever the value")
	assert.True(t, c.unreadable(b, "uid-b", config.Completing))
	assert.False(t, c.unreadable(b, "uid-b", config.Completing), "reported once")
	assert.Equal(t, "tally_aggregator_compare_difference=3 tally_aggregator_compare_differing_parents=1 tally_aggregator_compared_parents=1", gauges(),
		"a field that is not an integer is not compared")
	c.set(b, "uid-b", config.Completing, 0, t0)

	c.forget(a)
	assert.Equal(t, "tally_aggregator_compare_difference=0 tally_aggregator_compare_differing_parents=0 tally_aggregator_compared_parents=1", gauges())
}

// comparedCollector registers a compared on its own.
type comparedCollector struct{ *compared }

func (c comparedCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

// TestCompareCounts: a parent whose field differs from tally's count gets
// one Warning Event once DriftAfter has passed, and is brought back for it;
// nothing is compared from a pass whose apply met a newer parent.
func TestCompareCounts(t *testing.T) {
	cfg, err := config.Parse([]byte("parents: [{group: example.tally.dev, version: v1, kind: ShadowPool, counts: {completing: status.tally.completing}, compare: {completing: status.completing}}]"))
	require.NoError(t, err)
	rec := events.NewFakeRecorder(10)
	r := NewReconciler(cfg.Parents[0], Deps{Recorder: rec, DriftAfter: time.Hour})
	key := parentKey{kind: r.gvk.GroupKind(), name: types.NamespacedName{Namespace: "ns", Name: "pool"}}
	parent := &unstructured.Unstructured{Object: map[string]any{"status": map[string]any{"completing": int64(2)}}}
	parent.SetUID("uid")
	ctx, pass := withPass(context.Background(), 0, "")

	again := r.compareCounts(ctx, key, parent, count.Counts{Completing: 1})
	assert.InDelta(t, time.Hour.Seconds(), again.Seconds(), 1, "brought back when the Event is due")
	assert.Empty(t, rec.Events)

	r.DriftAfter = time.Nanosecond
	assert.Zero(t, r.compareCounts(ctx, key, parent, count.Counts{Completing: 1}))
	require.Len(t, rec.Events, 1)
	assert.Contains(t, <-rec.Events, "Warning CountDiffers status.completing shows 2, but tally counts 1 completing pods (written to status.tally.completing)")
	r.compareCounts(ctx, key, parent, count.Counts{Completing: 0})
	assert.Empty(t, rec.Events, "once an episode")

	pass.lag()
	assert.Equal(t, conflictRequeue, r.compareCounts(ctx, key, parent, count.Counts{Completing: 2}), "brought back to compare")
	assert.Equal(t, int64(2), r.observed.compared.drifts[key][config.Completing].by, "not compared from a parent older than the API server's")
}
