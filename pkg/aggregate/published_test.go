package aggregate

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
)

func TestPublishedSumsByKind(t *testing.T) {
	pools := schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}
	jobs := schema.GroupKind{Group: "batch", Kind: "Job"}
	key := func(kind schema.GroupKind, name string) parentKey {
		return parentKey{kind: kind, name: types.NamespacedName{Namespace: "ns", Name: name}}
	}
	p := newPublished()
	p.set(key(pools, "a"), count.Counts{Completing: 2, Active: 3})
	p.set(key(pools, "b"), count.Counts{Completing: 1, Completed: 4, Unexpected: 1, CompletedTotal: 9})
	p.set(key(jobs, "c"), count.Counts{Active: 5})
	p.set(key(jobs, "gone"), count.Counts{Active: 7})
	p.forget(key(jobs, "gone"))
	p.set(key(pools, "a"), count.Counts{Completing: 1, Active: 3})

	want := `
# HELP tally_aggregator_parents Parents reconciled whose counts tally_aggregator_pods sums, by parent kind.
# TYPE tally_aggregator_parents gauge
tally_aggregator_parents{kind="Job.batch"} 1
tally_aggregator_parents{kind="WorkerPool.example.tally.dev"} 2
# HELP tally_aggregator_pods Pods counted, summed over the parents of a kind as their last reconcile counted them, by parent kind and count (completing, completed, active, unexpected).
# TYPE tally_aggregator_pods gauge
tally_aggregator_pods{count="active",kind="Job.batch"} 5
tally_aggregator_pods{count="completed",kind="Job.batch"} 0
tally_aggregator_pods{count="completing",kind="Job.batch"} 0
tally_aggregator_pods{count="unexpected",kind="Job.batch"} 0
tally_aggregator_pods{count="active",kind="WorkerPool.example.tally.dev"} 3
tally_aggregator_pods{count="completed",kind="WorkerPool.example.tally.dev"} 4
tally_aggregator_pods{count="completing",kind="WorkerPool.example.tally.dev"} 2
tally_aggregator_pods{count="unexpected",kind="WorkerPool.example.tally.dev"} 1
`
	require.NoError(t, testutil.CollectAndCompare(p, strings.NewReader(want)))
}

// TestAStoppedManagersChangesAreNotWaiting: a change a manager saw and
// never picked up (a deposed leader's) is reported as waiting while that
// manager runs, and no longer once it stopped and another started: the
// next manager, a standby, picks up nothing, so the gauge would grow for
// good.
func TestAStoppedManagersChangesAreNotWaiting(t *testing.T) {
	waiting := func() float64 {
		families, err := metrics.Registry.Gather()
		require.NoError(t, err)
		for _, f := range families {
			if f.GetName() == "tally_aggregator_oldest_unprocessed_change_seconds" {
				return f.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("no tally_aggregator_oldest_unprocessed_change_seconds")
		return 0
	}
	deposed := observe()
	r := reconcilerFor(map[config.Count]string{config.Active: "status.active"}, "")
	r.observed = deposed
	r.pendingRequest(types.NamespacedName{Namespace: "ns", Name: "pool"})
	deposed.changes.since[parentKey{kind: r.gvk.GroupKind(), name: types.NamespacedName{Namespace: "ns", Name: "pool"}}] = time.Now().Add(-time.Minute)
	require.GreaterOrEqual(t, waiting(), 60.0, "the change is waiting while its manager runs")
	r.observed.counted.set(parentKey{kind: r.gvk.GroupKind()}, count.Counts{Active: 2})
	require.Equal(t, 1, testutil.CollectAndCount(currentCounts{}, "tally_aggregator_parents"))

	deposed.forget()
	assert.Zero(t, waiting(), "a stopped manager's change is reported as waiting")
	assert.Zero(t, testutil.CollectAndCount(currentCounts{}), "a stopped manager's counts are published")

	standby := observe()
	standby.changes.seen(parentKey{kind: r.gvk.GroupKind()}, time.Now().Add(-time.Second))
	deposed.forget()
	assert.Positive(t, waiting(), "a stopped manager's forget clears the one running after it")
	standby.forget()
}
