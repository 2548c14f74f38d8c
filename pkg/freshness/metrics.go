package freshness

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

var (
	barriers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_pod_view_barriers_total",
		Help: "Barriers run after a doubt about the pod view, by result: proved (the view is fresh once the cache holds what the barrier found), superseded (a newer doubt came first, or the cache got there first) or error (the API server did not answer; tried again with back-off).",
	}, []string{"result"})
	barrierSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tally_aggregator_pod_view_barrier_seconds",
		Help:    "Time from a doubt's first barrier to its proof: the resourceVersion read, and a watch from the cache's own version up to it.",
		Buckets: []float64{0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30},
	})
	barrierRequests = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tally_aggregator_pod_view_barrier_requests_total",
		Help: "Requests the pod view's barriers sent: a LIST of at most one pod for each version read, and each watch up to it.",
	})

	parentBarriers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_parent_view_barriers_total",
		Help: "Barriers run after a doubt about a parent kind's view, by kind and result (as tally_aggregator_pod_view_barriers_total). While the view is not known fresh (until a barrier proves it, or the cache reaches the version a barrier read first), the kind's parents are read from the API server.",
	}, []string{"kind", "result"})
	parentBarrierSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tally_aggregator_parent_view_barrier_seconds",
		Help:    "Time from a doubt's first barrier to its proof, for a parent kind's view.",
		Buckets: []float64{0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30},
	}, []string{"kind"})
	parentBarrierRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_parent_view_barrier_requests_total",
		Help: "Requests a parent kind's view's barriers sent, by kind.",
	}, []string{"kind"})
)

// meters are one view's barrier metrics.
type meters struct {
	barriers func(result string) prometheus.Counter
	seconds  prometheus.Observer
	requests prometheus.Counter
}

// metersOf returns the metrics of the pod view (kind empty) or of a parent
// kind's view.
func metersOf(kind string) meters {
	if kind == "" {
		return meters{
			barriers: func(result string) prometheus.Counter { return barriers.WithLabelValues(result) },
			seconds:  barrierSeconds, requests: barrierRequests,
		}
	}
	return meters{
		barriers: func(result string) prometheus.Counter { return parentBarriers.WithLabelValues(kind, result) },
		seconds:  parentBarrierSeconds.WithLabelValues(kind), requests: parentBarrierRequests.WithLabelValues(kind),
	}
}

// published is the view the stale gauge reads.
var published = struct {
	sync.Mutex
	view interface{ Stale() time.Duration }
}{}

func init() {
	metrics.Registry.MustRegister(barriers, barrierSeconds, barrierRequests, parentBarriers, parentBarrierSeconds, parentBarrierRequests,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tally_aggregator_pod_watch_stale_seconds",
			Help: "How long the pod view has not been known fresh: from a doubt (the pod watch ended, failed or was throttled, a relist, a pause of the process) until the cache holds a version read after it; 0 while fresh. No status is written meanwhile.",
		}, func() float64 {
			published.Lock()
			defer published.Unlock()
			if published.view == nil {
				return 0
			}
			return published.view.Stale().Seconds()
		}))
}
