package aggregate

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
)

// published keeps each parent's counts as its last reconcile computed them,
// and exports their sums by kind: what the counts of a kind add up to
// across the cluster, for dashboards.
type published struct {
	mu     sync.Mutex
	counts map[parentKey]count.Counts
}

var (
	podsDesc = prometheus.NewDesc("tally_aggregator_pods",
		"Pods counted, summed over the parents of a kind as their last reconcile counted them, by parent kind and count (completing, completed, active, unexpected).",
		[]string{"kind", "count"}, nil)
	parentsDesc = prometheus.NewDesc("tally_aggregator_parents",
		"Parents reconciled whose counts tally_aggregator_pods sums, by parent kind.",
		[]string{"kind"}, nil)
)

func newPublished() *published {
	return &published{counts: map[parentKey]count.Counts{}}
}

// set records the counts of parent.
func (p *published) set(parent parentKey, c count.Counts) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.counts[parent] = c
}

// forget drops a parent that is gone.
func (p *published) forget(parent parentKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.counts, parent)
}

// Describe implements prometheus.Collector.
func (p *published) Describe(ch chan<- *prometheus.Desc) {
	ch <- podsDesc
	ch <- parentsDesc
}

// Collect implements prometheus.Collector.
func (p *published) Collect(ch chan<- prometheus.Metric) {
	type sum struct {
		parents int
		counts  count.Counts
	}
	p.mu.Lock()
	kinds := map[string]*sum{}
	for key, c := range p.counts {
		s := kinds[key.kind.String()]
		if s == nil {
			s = &sum{}
			kinds[key.kind.String()] = s
		}
		s.parents++
		s.counts.Completing += c.Completing
		s.counts.Completed += c.Completed
		s.counts.Active += c.Active
		s.counts.Unexpected += c.Unexpected
	}
	p.mu.Unlock()
	for kind, s := range kinds {
		ch <- prometheus.MustNewConstMetric(parentsDesc, prometheus.GaugeValue, float64(s.parents), kind)
		for _, name := range config.Counts {
			ch <- prometheus.MustNewConstMetric(podsDesc, prometheus.GaugeValue, float64(s.counts.Get(name)), kind, string(name))
		}
	}
}
