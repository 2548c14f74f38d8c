package aggregate

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

func TestPublishedSumsByKind(t *testing.T) {
	pools := schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}
	jobs := schema.GroupKind{Group: "batch", Kind: "Job"}
	key := func(kind schema.GroupKind, name string) parentKey {
		return parentKey{kind: kind, name: types.NamespacedName{Namespace: "ns", Name: name}}
	}
	p := newPublished()
	p.set(key(pools, "a"), Counts{Completing: 2, Active: 3})
	p.set(key(pools, "b"), Counts{Completing: 1, Completed: 4, Unexpected: 1, CompletedTotal: 9})
	p.set(key(jobs, "c"), Counts{Active: 5})
	p.set(key(jobs, "gone"), Counts{Active: 7})
	p.forget(key(jobs, "gone"))
	p.set(key(pools, "a"), Counts{Completing: 1, Active: 3})

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
