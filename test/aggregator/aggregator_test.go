package aggregator

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

var (
	batchPoolGVK    = schema.GroupVersionKind{Group: "test.tally.dev", Version: "v1", Kind: "BatchPool"}
	shardSetGVK     = schema.GroupVersionKind{Group: "test.tally.dev", Version: "v1", Kind: "ShardSet"}
	noStatusPoolGVK = schema.GroupVersionKind{Group: "test.tally.dev", Version: "v1", Kind: "NoStatusPool"}
	plainPoolGVK    = schema.GroupVersionKind{Group: "test.tally.dev", Version: "v1", Kind: "PlainPool"}
	twoCounts       = map[config.Count]string{config.Completing: "status.completing", config.Active: "status.active"}
)

func parentOf(gvk schema.GroupVersionKind, counts map[config.Count]string) config.Parent {
	return config.Parent{Group: gvk.Group, Version: gvk.Version, Kind: gvk.Kind, Counts: counts}
}

// mixedPods returns n pods of a parent in every state the counts tell apart.
func mixedPods(gvk schema.GroupVersionKind, ns, parent string, uid types.UID, n int) []*corev1.Pod {
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = member(gvk, ns, parent, uid, fmt.Sprintf("%s-%03d", strings.ToLower(parent), i)).Mixed(i).Build()
	}
	return pods
}

// TestFirstWriteIsTheTruth starts the aggregator on parents whose pods
// already exist: the first value it ever writes is the true count, never 0
// or a count of the pods listed so far.
func TestFirstWriteIsTheTruth(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	names := []string{"p0", "p1", "p2"}
	uids := map[string]types.UID{}
	var pods []*corev1.Pod
	for _, name := range names {
		uids[name] = createParent(t, operator.GVK, ns, name)
		pods = append(pods, mixedPods(operator.GVK, ns, name, uids[name], 500)...)
	}
	createAll(t, pods)
	// Phases are status: set them as the kubelet would.
	for _, p := range pods {
		if p.Status.Phase != "" {
			require.NoError(t, setPhase(ctx, env.Client, p.DeepCopy(), p.Status.Phase))
		}
	}

	w := watchPools(t, ns)
	var mu sync.Mutex
	written := map[string][]map[config.Count]int64{}
	go func() {
		for ev := range w.ResultChan() {
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			if _, found, _ := unstructured.NestedMap(u.Object, "status"); !found {
				continue
			}
			mu.Lock()
			written[u.GetName()] = append(written[u.GetName()], fieldsOf(u, allCounts))
			mu.Unlock()
		}
	}()

	startAggregator(t, []config.Parent{workerPools}, nil)
	for _, name := range names {
		converges(t, ns, name, uids[name])
	}
	mu.Lock()
	defer mu.Unlock()
	for _, name := range names {
		want := listTruth(t, ns, uids[name])
		require.NotEmpty(t, written[name], name)
		assert.Equal(t, want, written[name][0], "first status written for %s", name)
		for i, got := range written[name] {
			assert.Equal(t, want, got, "status write %d of %s", i, name)
		}
	}
}

// TestOnePodWatchForAllKinds configures three parent kinds: the aggregator
// opens exactly one pod watch against the API server (beside the freshness
// barrier's watches of a few seconds, which a busy machine may need).
func TestOnePodWatchForAllKinds(t *testing.T) {
	ns := newNamespace(t)
	cfg, requests := counting()
	startAggregator(t, []config.Parent{workerPools, parentOf(batchPoolGVK, twoCounts), parentOf(shardSetGVK, twoCounts)}, cfg)

	for _, gvk := range []schema.GroupVersionKind{operator.GVK, batchPoolGVK, shardSetGVK} {
		uid := createParent(t, gvk, ns, "parent")
		createAll(t, mixedPods(gvk, ns, "parent", uid, 6)[:6])
		want := map[config.Count]int64{config.Completing: 2, config.Active: 4}
		var got map[config.Count]int64
		ok := waitFor(30*time.Second, func() bool {
			got = shown(t, gvk, ns, "parent", twoCounts)
			return equal(want, got)
		})
		require.True(t, ok, "%s: got %v, want %v", gvk.Kind, got, want)
		ns = newNamespace(t) // pod names repeat across kinds
	}
	requests.mu.Lock()
	defer requests.mu.Unlock()
	assert.Equal(t, 1, requests.count["GET /api/v1/pods watch"], "pod watches opened: %v", requests.count)
}

// TestFieldOwnership: the aggregator owns exactly the mapped fields. Another
// manager cannot take one without force; with force it can, and the
// aggregator takes it back. Fields of other managers are never touched.
func TestFieldOwnership(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	createAll(t, mixedPods(operator.GVK, ns, "pool", uid, 9))
	operatorStatus := func(status map[string]any, opts ...client.SubResourceApplyOption) error {
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "example.tally.dev/v1", "kind": "WorkerPool",
			"metadata": map[string]any{"name": "pool", "namespace": ns}, "status": status,
		}}
		return env.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u), opts...)
	}
	require.NoError(t, operatorStatus(map[string]any{"observedGeneration": int64(7)}, client.FieldOwner("operator")))

	startAggregator(t, []config.Parent{workerPools}, nil)
	converges(t, ns, "pool", uid)

	err := operatorStatus(map[string]any{"completing": int64(99)}, client.FieldOwner("intruder"))
	require.Error(t, err)
	assert.True(t, apierrors.IsConflict(err), "%v", err)
	assert.Contains(t, err.Error(), aggregate.FieldManager)

	require.NoError(t, operatorStatus(map[string]any{"completing": int64(99)}, client.FieldOwner("intruder"), client.ForceOwnership))
	converges(t, ns, "pool", uid)

	pool := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pool), pool))
	gen, _, _ := unstructured.NestedInt64(pool.Object, "status", "observedGeneration")
	assert.Equal(t, int64(7), gen)
	owned := map[string]string{}
	for _, mf := range pool.GetManagedFields() {
		if mf.Subresource == "status" && mf.FieldsV1 != nil {
			owned[mf.Manager] = mf.FieldsV1.GetRawString()
		}
	}
	assert.JSONEq(t, `{"f:status":{"f:active":{},"f:completed":{},"f:completing":{},"f:unexpected":{}}}`, owned[aggregate.FieldManager])
	assert.JSONEq(t, `{"f:status":{"f:observedGeneration":{}}}`, owned["operator"])
}

// TestRestartConvergesAndIdleReconcileSendsNothing stops the aggregator in
// the middle of churn, changes pods while it is down, and starts a new one:
// the values converge to the truth. A reconcile with nothing changed then
// sends no write.
func TestRestartConvergesAndIdleReconcileSendsNothing(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	pods := mixedPods(operator.GVK, ns, "pool", uid, 30)
	createAll(t, pods)

	first := startAggregator(t, []config.Parent{workerPools}, nil)
	converges(t, ns, "pool", uid)

	// Churn: mark 20 pods and delete 5 others, while the aggregator stops
	// half-way through.
	churnErrs := make(chan error, 25)
	var churning sync.WaitGroup
	churning.Go(func() {
		for _, p := range pods[:20] {
			patch := client.MergeFrom(p.DeepCopy())
			p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
			churnErrs <- env.Client.Patch(ctx, p, patch)
			time.Sleep(20 * time.Millisecond)
		}
		for _, p := range pods[20:25] {
			churnErrs <- env.Client.Delete(ctx, p)
		}
	})
	time.Sleep(200 * time.Millisecond)
	first.stop()
	churning.Wait()
	close(churnErrs)
	for err := range churnErrs {
		require.NoError(t, err)
	}

	cfg, requests := counting()
	startAggregator(t, []config.Parent{workerPools}, cfg)
	converges(t, ns, "pool", uid)

	// Touch the parent: its reconcile finds every value right.
	before := counter(t, "tally_aggregator_reconciles_total", "WorkerPool.example.tally.dev")
	writes := requests.matching("PATCH", "/status")
	pool := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pool), pool))
	pool.SetLabels(map[string]string{"touched": "yes"})
	require.NoError(t, env.Client.Update(ctx, pool))
	require.True(t, waitFor(10*time.Second, func() bool {
		return counter(t, "tally_aggregator_reconciles_total", "WorkerPool.example.tally.dev") > before
	}), "the parent was never reconciled")
	assert.Equal(t, writes, requests.matching("PATCH", "/status"), "an idle reconcile sent a write")
}

// TestParentKindProblems: a kind without a status subresource and a kind
// whose schema lacks a mapped field are reported; the other kinds are
// served.
func TestParentKindProblems(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	startAggregator(t, []config.Parent{
		workerPools,
		parentOf(noStatusPoolGVK, nil),
		parentOf(plainPoolGVK, map[config.Count]string{config.Completing: "status.completing"}),
		{Group: "test.tally.dev", Version: "v1", Kind: "Ghost", Counts: config.DefaultCounts},
	}, nil)

	uid := createParent(t, operator.GVK, ns, "pool")
	createAll(t, mixedPods(operator.GVK, ns, "pool", uid, 5))
	converges(t, ns, "pool", uid)

	createParent(t, plainPoolGVK, ns, "plain")
	require.True(t, waitFor(30*time.Second, func() bool {
		var events eventsv1.EventList
		require.NoError(t, env.Client.List(ctx, &events, client.InNamespace(ns)))
		for _, e := range events.Items {
			if e.Regarding.Name == "plain" && e.Reason == "StatusFieldNotInSchema" && strings.Contains(e.Note, "status.completing") {
				return true
			}
		}
		return false
	}), "no StatusFieldNotInSchema event on the PlainPool")

	assert.Equal(t, 1.0, gauge(t, "tally_aggregator_parent_kind_problems", "NoStatusPool.test.tally.dev", "no-status-subresource"))
	assert.Equal(t, 1.0, gauge(t, "tally_aggregator_parent_kind_problems", "PlainPool.test.tally.dev", "field-not-in-schema"))
	assert.Equal(t, 1.0, gauge(t, "tally_aggregator_parent_kind_problems", "Ghost.test.tally.dev", "not-served"))
}

// metric returns the metric of family name whose label values are values.
func metric(t *testing.T, name string, values ...string) *dto.Metric {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			var got []string
			for _, l := range m.GetLabel() {
				got = append(got, l.GetValue())
			}
			if strings.Join(got, ",") == strings.Join(values, ",") {
				return m
			}
		}
	}
	return nil
}

func counter(t *testing.T, name string, values ...string) float64 {
	if m := metric(t, name, values...); m != nil {
		return m.GetCounter().GetValue()
	}
	return 0
}

func gauge(t *testing.T, name string, values ...string) float64 {
	if m := metric(t, name, values...); m != nil {
		return m.GetGauge().GetValue()
	}
	return 0
}

// TestLeaderElectionFailover runs two replicas with leader election: the
// standby takes over when the leader stops, and keeps the counts true.
func TestLeaderElectionFailover(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	leaseNS := newNamespace(t)
	elect := func(o *app.Options) { o.LeaderElect, o.LeaderElectionNamespace = true, leaseNS }
	holder := func() string {
		var lease coordinationv1.Lease
		if err := env.Client.Get(ctx, client.ObjectKey{Namespace: leaseNS, Name: app.DefaultLeaderElectionID}, &lease); err != nil {
			return ""
		}
		return ptr.Deref(lease.Spec.HolderIdentity, "")
	}

	uid := createParent(t, operator.GVK, ns, "pool")
	pods := mixedPods(operator.GVK, ns, "pool", uid, 12)
	createAll(t, pods)
	leader := startAggregator(t, []config.Parent{workerPools}, nil, elect)
	converges(t, ns, "pool", uid)
	first := holder()
	require.NotEmpty(t, first, "the first replica holds no lease")

	startAggregator(t, []config.Parent{workerPools}, nil, elect)
	leader.stop()
	require.True(t, waitFor(30*time.Second, func() bool { h := holder(); return h != "" && h != first }),
		"the standby never took the lease over")

	for _, p := range pods[:4] {
		patch := client.MergeFrom(p.DeepCopy())
		p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
		require.NoError(t, env.Client.Patch(ctx, p, patch))
	}
	converges(t, ns, "pool", uid)
}
