package aggregate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

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
	c.init(kind.String(), compareFields(config.Parent{Compare: map[config.Count]string{config.Completing: "status.legacy"}}))

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

	d := c.set(a, config.Completing, 2, t0)
	assert.Equal(t, drift{by: 2, since: t0}, d)
	c.warn(a, config.Completing)
	d = c.set(a, config.Completing, -1, t0.Add(time.Minute))
	assert.Equal(t, drift{by: -1, since: t0, warned: true}, d, "still differing: the same episode")
	c.set(b, config.Completing, 0, t0)
	assert.Equal(t, "tally_aggregator_compare_difference=1 tally_aggregator_compare_differing_parents=1 tally_aggregator_compared_parents=2", gauges())

	c.set(a, config.Completing, 0, t0.Add(2*time.Minute))
	d = c.set(a, config.Completing, 3, t0.Add(3*time.Minute))
	assert.Equal(t, drift{by: 3, since: t0.Add(3 * time.Minute)}, d, "a new episode, not warned")

	c.forget(a)
	assert.Equal(t, "tally_aggregator_compare_difference=0 tally_aggregator_compare_differing_parents=0 tally_aggregator_compared_parents=1", gauges())
}

// comparedCollector registers a compared on its own.
type comparedCollector struct{ *compared }

func (c comparedCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }
