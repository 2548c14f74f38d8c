package count

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/podexpr"
)

// customCounts are one kind's custom counts, compiled.
type customCounts struct {
	kind  string
	names []string
	// programs has a nil in the place of a count that cannot be kept
	// (config.CustomCount.Err): it matches no pod, and has no field.
	programs []*podexpr.Program
	errors   []prometheus.Counter
	// logged is, by count, when an evaluation error was last logged (Unix
	// nanoseconds): at most one a minute per count.
	logged []atomic.Int64
}

// errorLogEvery is the least time between two log lines about one custom
// count's evaluation errors.
const errorLogEvery = time.Minute

func newCustomCounts(p config.Parent) *customCounts {
	programs, _ := p.Programs()
	c := &customCounts{kind: p.GroupKind().String(), programs: programs, logged: make([]atomic.Int64, len(programs))}
	for _, cc := range p.CustomCounts {
		c.names = append(c.names, cc.Name)
		c.errors = append(c.errors, customCountErrors.WithLabelValues(c.kind, cc.Name))
	}
	return c
}

// match returns the bits of the custom counts that match pod. An
// evaluation that fails does not match; it is counted, and logged.
func (c *customCounts) match(pod *corev1.Pod) uint32 {
	var bits uint32
	for i, prg := range c.programs {
		if prg == nil {
			continue
		}
		ok, err := prg.Match(pod)
		if err != nil {
			c.failed(i, pod, err)
			continue
		}
		if ok {
			bits |= 1 << i
		}
	}
	return bits
}

func (c *customCounts) failed(i int, pod *corev1.Pod, err error) {
	c.errors[i].Inc()
	now := time.Now().UnixNano()
	last := c.logged[i].Load()
	if now-last < int64(errorLogEvery) || !c.logged[i].CompareAndSwap(last, now) {
		return
	}
	ctrl.Log.WithName("aggregator").Info("A custom count's expression failed on a pod, which it does not count (guard fields a pod may lack with has(); more such failures are counted, and logged at most once a minute)",
		"kind", c.kind, "count", c.names[i], "pod", pod.Namespace+"/"+pod.Name, "error", err.Error())
}

// TallyCustom counts, for each of n custom counts, the pods of the parent
// with UID uid in namespace ns that it matches (the pods Tally counts);
// partial reports that some of them could not be evaluated (read by a
// sweep, without their status).
func TallyCustom(ns string, uid types.UID, pods []*Pod, n int) (counts []int64, partial bool) {
	counts = make([]int64, n)
	for _, pod := range pods {
		if !inParent(pod, ns, uid) {
			continue
		}
		if pod.Unevaluated {
			partial = true
			continue
		}
		for i := range counts {
			if pod.Matches&(1<<i) != 0 {
				counts[i]++
			}
		}
	}
	return counts, partial
}
