package count

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

var (
	customCountErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_custom_count_errors_total",
		Help: "Evaluations of a custom count's expression that failed on a pod (a field the pod lacks, which has() guards against; the cost limit): the pod is not counted in it, by parent kind and custom count.",
	}, []string{"kind", "count"})
)

func init() {
	metrics.Registry.MustRegister(customCountErrors)
}
