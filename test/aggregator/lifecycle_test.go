package aggregator

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// crd returns the CRD of a namespaced test kind with the given status
// fields (integers), with or without a status subresource.
func crd(kind string, status bool, fields ...string) *apiextensionsv1.CustomResourceDefinition {
	plural := strings.ToLower(kind) + "s"
	props := map[string]apiextensionsv1.JSONSchemaProps{}
	for _, f := range fields {
		props[f] = apiextensionsv1.JSONSchemaProps{Type: "integer"}
	}
	version := apiextensionsv1.CustomResourceDefinitionVersion{
		Name: "v1", Served: true, Storage: true,
		Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
			Type: "object",
			Properties: map[string]apiextensionsv1.JSONSchemaProps{
				"spec":   {Type: "object", XPreserveUnknownFields: ptrTo(true)},
				"status": {Type: "object", Properties: props},
			},
		}},
	}
	if status {
		version.Subresources = &apiextensionsv1.CustomResourceSubresources{Status: &apiextensionsv1.CustomResourceSubresourceStatus{}}
	}
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: plural + ".late.tally.dev"},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: "late.tally.dev", Scope: apiextensionsv1.NamespaceScoped,
			Names:    apiextensionsv1.CustomResourceDefinitionNames{Kind: kind, ListKind: kind + "List", Plural: plural, Singular: strings.ToLower(kind)},
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{version},
		},
	}
}

func ptrTo[T any](v T) *T { return &v }

func installCRD(t *testing.T, c *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	require.NoError(t, env.Client.Create(context.Background(), c))
	t.Cleanup(func() { _ = env.Client.Delete(context.Background(), c) })
	waitEstablished(t, c.Name)
	// Established comes before the API server's discovery shows the kind:
	// wait until the client can map it.
	gk := schema.GroupKind{Group: c.Spec.Group, Kind: c.Spec.Names.Kind}
	require.True(t, waitFor(30*time.Second, func() bool {
		_, err := env.Client.RESTMapper().RESTMapping(gk, c.Spec.Versions[0].Name)
		return err == nil
	}), "the client never mapped %s", gk)
}

func waitEstablished(t *testing.T, name string) {
	t.Helper()
	require.True(t, waitFor(30*time.Second, func() bool {
		var got apiextensionsv1.CustomResourceDefinition
		if err := env.Client.Get(context.Background(), client.ObjectKey{Name: name}, &got); err != nil {
			return false
		}
		for _, c := range got.Status.Conditions {
			if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
				return true
			}
		}
		return false
	}), "CRD %s never established", name)
}

// updateCRD changes a CRD's only version with change, retrying conflicts.
func updateCRD(t *testing.T, name string, change func(*apiextensionsv1.CustomResourceDefinitionVersion)) {
	t.Helper()
	require.True(t, waitFor(10*time.Second, func() bool {
		var c apiextensionsv1.CustomResourceDefinition
		require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Name: name}, &c))
		change(&c.Spec.Versions[0])
		return env.Client.Update(context.Background(), &c) == nil
	}))
}

func lateGVK(kind string) schema.GroupVersionKind {
	return schema.GroupVersionKind{Group: "late.tally.dev", Version: "v1", Kind: kind}
}

// convergesKind waits until a parent of any kind shows its true counts.
func convergesKind(t *testing.T, gvk schema.GroupVersionKind, ns, name string, uid types.UID, counts map[config.Count]string, timeout time.Duration) {
	t.Helper()
	var want, got map[config.Count]int64
	ok := waitFor(timeout, func() bool {
		all := listTruth(t, ns, uid)
		want = map[config.Count]int64{}
		for c := range counts {
			want[c] = all[c]
		}
		got = shown(t, gvk, ns, name, counts)
		return equal(want, got)
	})
	require.True(t, ok, "status of %s %s/%s: got %v, want %v", gvk.Kind, ns, name, got, want)
}

// TestAStandbySeesAKindServedLater: a replica that does not lead checks a
// kind it cannot serve yet again, as the leader does, so its problem gauge
// clears once the kind's CRD is installed. A standby that checked only at
// its start reported the kind unservable until it led, and
// TallyParentKindUnservable fired on a healthy install whose CRD came after
// tally (seen on a real Prometheus, make e2e-cluster).
func TestAStandbySeesAKindServedLater(t *testing.T) {
	ctx := context.Background()
	leaseNS := newNamespace(t)
	// Another replica holds the lease throughout.
	now := metav1.NewMicroTime(time.Now())
	require.NoError(t, env.Client.Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Namespace: leaseNS, Name: app.DefaultLeaderElectionID},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("another-replica"), LeaseDurationSeconds: ptr.To[int32](3600),
			AcquireTime: &now, RenewTime: &now},
	}))
	standby := lateGVK("StandbyPool")
	startAggregator(t, []config.Parent{workerPools, parentOf(standby, twoCounts)}, nil,
		func(o *app.Options) { o.LeaderElect, o.LeaderElectionNamespace = true, leaseNS })
	problem := func() float64 {
		return gauge(t, "tally_aggregator_parent_kind_problems", "StandbyPool.late.tally.dev", "not-served")
	}
	require.True(t, waitFor(10*time.Second, func() bool { return problem() == 1 }), "the standby does not report the kind's CRD missing")

	installCRD(t, crd(standby.Kind, true, "completing", "active"))
	assert.True(t, waitFor(90*time.Second, func() bool { return problem() == 0 }),
		"the standby still reports the kind unservable 90 s after its CRD was installed")
	var lease coordinationv1.Lease
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: leaseNS, Name: app.DefaultLeaderElectionID}, &lease))
	assert.Equal(t, "another-replica", ptr.Deref(lease.Spec.HolderIdentity, ""), "the replica took the lease: it was not a standby")
}

// TestKindsThatAppearLater: a kind whose CRD is installed 10 s after the
// aggregator started, and a kind given a status subresource later, are
// served without a restart, and their problem gauges clear.
func TestKindsThatAppearLater(t *testing.T) {
	framework.Long(t)
	ns := newNamespace(t)
	late, noStatusYet := lateGVK("LatePool"), lateGVK("SubresourceLaterPool")
	installCRD(t, crd(noStatusYet.Kind, false, "completing", "active"))
	startAggregator(t, []config.Parent{workerPools, parentOf(late, twoCounts), parentOf(noStatusYet, twoCounts)}, nil)

	require.True(t, waitFor(10*time.Second, func() bool {
		return gauge(t, "tally_aggregator_parent_kind_problems", "LatePool.late.tally.dev", "not-served") == 1 &&
			gauge(t, "tally_aggregator_parent_kind_problems", "SubresourceLaterPool.late.tally.dev", "no-status-subresource") == 1
	}))
	time.Sleep(10 * time.Second)

	installCRD(t, crd(late.Kind, true, "completing", "active"))
	uid := createParent(t, late, ns, "late")
	createAll(t, mixedPods(late, ns, "late", uid, 6))
	convergesKind(t, late, ns, "late", uid, twoCounts, 90*time.Second)
	assert.Zero(t, gauge(t, "tally_aggregator_parent_kind_problems", "LatePool.late.tally.dev", "not-served"))

	uid = createParent(t, noStatusYet, ns, "sub")
	createAll(t, mixedPods(noStatusYet, ns, "sub", uid, 4))
	updateCRD(t, "subresourcelaterpools.late.tally.dev", func(v *apiextensionsv1.CustomResourceDefinitionVersion) {
		v.Subresources = &apiextensionsv1.CustomResourceSubresources{Status: &apiextensionsv1.CustomResourceSubresourceStatus{}}
	})
	convergesKind(t, noStatusYet, ns, "sub", uid, twoCounts, 90*time.Second)
	assert.Zero(t, gauge(t, "tally_aggregator_parent_kind_problems", "SubresourceLaterPool.late.tally.dev", "no-status-subresource"))
}

// TestSchemaFixedAfterStart: a CRD that does not declare a mapped field is
// fixed while the aggregator runs; the idle parent gets its counts without
// any change of its own.
func TestSchemaFixedAfterStart(t *testing.T) {
	ns := newNamespace(t)
	gvk := lateGVK("FixedPool")
	installCRD(t, crd(gvk.Kind, true, "completing"))
	uid := createParent(t, gvk, ns, "idle")
	createAll(t, mixedPods(gvk, ns, "idle", uid, 5))
	startAggregator(t, []config.Parent{parentOf(gvk, twoCounts)}, nil)
	require.True(t, waitFor(30*time.Second, func() bool {
		return gauge(t, "tally_aggregator_parent_kind_problems", "FixedPool.late.tally.dev", "field-not-in-schema") == 1
	}), "the missing field is not reported")

	updateCRD(t, "fixedpools.late.tally.dev", func(v *apiextensionsv1.CustomResourceDefinitionVersion) {
		status := v.Schema.OpenAPIV3Schema.Properties["status"]
		status.Properties["active"] = apiextensionsv1.JSONSchemaProps{Type: "integer"}
		v.Schema.OpenAPIV3Schema.Properties["status"] = status
	})
	convergesKind(t, gvk, ns, "idle", uid, twoCounts, 90*time.Second)
	// A refusal can still come after the first apply that succeeded (seen
	// once in CI, 2026-12-02); the next apply that succeeds clears it.
	assert.True(t, waitFor(30*time.Second, func() bool {
		return gauge(t, "tally_aggregator_parent_kind_problems", "FixedPool.late.tally.dev", "field-not-in-schema") == 0
	}), "the problem is still reported once the schema declares the field")
}

// TestOtherNamespaceIsNotCounted: a pod in another namespace whose
// controller ownerReference carries the parent's UID is not the parent's.
func TestOtherNamespaceIsNotCounted(t *testing.T) {
	ns, other := newNamespace(t), newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	createAll(t, mixedPods(operator.GVK, ns, "pool", uid, 3))
	createAll(t, mixedPods(operator.GVK, other, "pool", uid, 4))
	startAggregator(t, []config.Parent{workerPools}, nil)
	converges(t, ns, "pool", uid)
	assert.Equal(t, int64(3), sum(shown(t, operator.GVK, ns, "pool", allCounts)))
}

// staleReader serves one parent as a cache that is behind would: the
// version it held before the parent was deleted and created again.
type staleReader struct{ parent *unstructured.Unstructured }

func (s staleReader) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	s.parent.DeepCopyInto(obj.(*unstructured.Unstructured))
	return nil
}

func (s staleReader) List(context.Context, client.ObjectList, ...client.ListOption) error {
	return nil
}

// reconcilerWith returns a reconciler of WorkerPools that sees parent
// through a stale cache and the given pods.
func reconcilerWith(t *testing.T, parent *unstructured.Unstructured, pods ...*count.Pod) *aggregate.Reconciler {
	t.Helper()
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	for _, p := range pods {
		require.NoError(t, indexer.Add(p))
	}
	return aggregate.NewReconciler(workerPools, aggregate.Deps{
		Parents: staleReader{parent}, Live: env.Client, Writer: env.Client, Pods: indexer,
		Backfilled: func(context.Context) error { return nil }, Recorder: events.NewFakeRecorder(10),
	})
}

// TestRecreatedParentNeverGetsOldCounts: a parent deleted and created again
// under the same name is never written with counts computed for the old
// one, even by a reconciler whose cache still shows the old parent: its
// apply meets a conflict, and the count taken again on the parent read
// from the API server is the replacement's own (it has no pods).
func TestRecreatedParentNeverGetsOldCounts(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	old := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, old))
	reducer := count.NewReducer([]config.Parent{workerPools})
	var pods []*count.Pod
	for _, p := range mixedPods(operator.GVK, ns, "pool", old.GetUID(), 5) {
		pods = append(pods, reducer.Pod(p))
	}

	require.NoError(t, env.Client.Delete(ctx, old))
	replacement := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, replacement))

	conflicts := counter(t, "tally_aggregator_apply_conflicts_total", "WorkerPool.example.tally.dev")
	_, err := reconcilerWith(t, old, pods...).Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(old)})
	require.NoError(t, err)
	got := &unstructured.Unstructured{}
	got.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(replacement), got))
	oldCounts := count.Tally(ns, old.GetUID(), pods)
	var total int64
	for count, path := range allCounts {
		total += oldCounts.Get(count)
		v, _, _ := unstructured.NestedInt64(got.Object, strings.Split(path, ".")...)
		assert.Zero(t, v, "the replacement was written with the old parent's counts: %v", got.Object["status"])
	}
	require.NotZero(t, total, "the old parent's pods count nothing: the test would prove nothing")
	assert.Equal(t, conflicts+1, counter(t, "tally_aggregator_apply_conflicts_total", "WorkerPool.example.tally.dev"))
}

// TestStatusNotFoundOfExistingParent: a 404 to the status apply of a
// parent that exists (its status subresource was removed) is an error and
// a problem gauge, not "parent gone".
func TestStatusNotFoundOfExistingParent(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	gvk := lateGVK("LostStatusPool")
	installCRD(t, crd(gvk.Kind, true, "completing"))
	parent := operator.Pool(ns, "pool", 0)
	parent.SetGroupVersionKind(gvk)
	require.NoError(t, env.Client.Create(ctx, parent))
	updateCRD(t, "loststatuspools.late.tally.dev", func(v *apiextensionsv1.CustomResourceDefinitionVersion) { v.Subresources = nil })

	p := parentOf(gvk, map[config.Count]string{config.Completing: "status.completing"})
	r := aggregate.NewReconciler(p, aggregate.Deps{
		Parents: staleReader{parent}, Live: env.Client, Writer: env.Client,
		Pods:       toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers),
		Backfilled: func(context.Context) error { return nil }, Recorder: events.NewFakeRecorder(10),
	})
	var err error
	require.True(t, waitFor(30*time.Second, func() bool {
		_, err = r.Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(parent)})
		return err != nil
	}), "a 404 from an existing parent's status was taken as the parent being gone")
	assert.Contains(t, err.Error(), "the parent exists but its status is not served")
	assert.Equal(t, 1.0, gauge(t, "tally_aggregator_parent_kind_problems", "LostStatusPool.late.tally.dev", "status-not-found"))

	// A parent that is really gone is not an error.
	require.NoError(t, env.Client.Delete(ctx, parent))
	_, err = r.Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(parent)})
	assert.NoError(t, err)
}

func sum(counts map[config.Count]int64) int64 {
	var n int64
	for _, v := range counts {
		n += v
	}
	return n
}

// TestClusterScopedParentKindIsRefused: a parent kind the API server serves
// as cluster-scoped is refused at start-up with an error naming the key.
func TestClusterScopedParentKindIsRefused(t *testing.T) {
	global := crd("GlobalPool", true, "completing")
	global.Spec.Scope = apiextensionsv1.ClusterScoped
	installCRD(t, global)
	err := app.Run(context.Background(), &config.Config{Parents: []config.Parent{workerPools, parentOf(lateGVK("GlobalPool"), nil)}}, env.Config,
		app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 1})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "parents[1] (late.tally.dev/v1, Kind=GlobalPool): the kind is cluster-scoped")
}

// viewAfterCount is a pod indexer whose reads, once done, run then: the
// pod view changes between the count and the write.
type viewAfterCount struct {
	toolscache.Indexer
	then func()
}

func (v viewAfterCount) ByIndex(index, value string) ([]any, error) {
	defer v.then()
	return v.Indexer.ByIndex(index, value)
}

// TestNoWriteFromAViewThatWasStale: counts are written only from a pod view
// that was fresh when they were taken and has not broken since. A view that
// becomes fresh only after the count, or that breaks and recovers between
// the count and the write, writes nothing; the next reconcile, on an
// unbroken fresh view, writes.
func TestNoWriteFromAViewThatWasStale(t *testing.T) {
	for _, tc := range []struct {
		name string
		// fresh and epoch are the view before the count; then changes
		// them after it.
		fresh bool
		then  func(fresh *atomic.Bool, epoch *atomic.Uint64)
	}{
		{"stale when counted, fresh when written", false, func(fresh *atomic.Bool, _ *atomic.Uint64) { fresh.Store(true) }},
		{"broken and recovered between the count and the write", true, func(_ *atomic.Bool, epoch *atomic.Uint64) { epoch.Add(1) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := newNamespace(t)
			pool := operator.Pool(ns, "pool", 0)
			require.NoError(t, env.Client.Create(ctx, pool))
			reducer := count.NewReducer([]config.Parent{workerPools})
			indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
			for _, p := range mixedPods(operator.GVK, ns, "pool", pool.GetUID(), 5) {
				require.NoError(t, indexer.Add(reducer.Pod(p)))
			}
			var fresh atomic.Bool
			var epoch atomic.Uint64
			fresh.Store(tc.fresh)
			changed := false
			r := aggregate.NewReconciler(workerPools, aggregate.Deps{
				Parents: env.Client, Live: env.Client, Writer: env.Client,
				Pods: viewAfterCount{Indexer: indexer, then: func() {
					if !changed {
						changed = true
						tc.then(&fresh, &epoch)
					}
				}},
				Backfilled: func(context.Context) error { return nil }, Recorder: events.NewFakeRecorder(10),
				// The view of the pool's namespace, which the reconciler
				// must ask about.
				MayWrite: func(n string) bool { return n == ns && fresh.Load() },
				ViewEpoch: func(n string) uint64 {
					if n != ns {
						return math.MaxUint64
					}
					return epoch.Load()
				},
			})
			req := reconcile.Request{NamespacedName: client.ObjectKeyFromObject(pool)}
			result, err := r.Reconcile(ctx, req)
			require.NoError(t, err)
			assert.NotZero(t, result.RequeueAfter, "the parent is not counted again")
			got := &unstructured.Unstructured{}
			got.SetGroupVersionKind(operator.GVK)
			require.NoError(t, env.Client.Get(ctx, req.NamespacedName, got))
			_, found, _ := unstructured.NestedMap(got.Object, "status")
			assert.False(t, found, "counts taken from a view that was not fresh all along were written: %v", got.Object["status"])

			if !changed {
				// Nothing was counted from the stale view.
				changed = true
				tc.then(&fresh, &epoch)
			}
			_, err = r.Reconcile(ctx, req)
			require.NoError(t, err)
			require.NoError(t, env.Client.Get(ctx, req.NamespacedName, got))
			_, found, _ = unstructured.NestedMap(got.Object, "status")
			assert.True(t, found, "nothing written from a fresh, unbroken view")
		})
	}
}

// TestARereadReleasesOnce: a kind that keeps no totals, three pods carrying
// the tracking finalizer, and a cache behind the parent: the counts' apply
// meets a conflict after the pods are released, and the reconcile runs
// again on the parent read from the API server, with the same cached pods.
// Each pod is released, counted and reported once.
func TestARereadReleasesOnce(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	pool := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, pool))
	cached := pool.DeepCopy()
	// Another writer changes the status: the cached copy is behind.
	require.NoError(t, unstructured.SetNestedField(pool.Object, int64(42), "status", "completing"))
	require.NoError(t, env.Client.Status().Update(ctx, pool))

	reducer := count.NewReducer([]config.Parent{workerPools})
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	for i := range 3 {
		p := member(operator.GVK, ns, "pool", pool.GetUID(), fmt.Sprintf("p-%d", i)).Finalizer(keys.TrackingFinalizer).Build()
		require.NoError(t, indexer.Add(reducer.Pod(p)))
	}
	recorder := events.NewFakeRecorder(20)
	r := aggregate.NewReconciler(workerPools, aggregate.Deps{
		Parents: staleReader{cached}, Live: env.Client, Writer: env.Client, Pods: indexer,
		Backfilled: func(context.Context) error { return nil }, Recorder: recorder,
	})
	released := counter(t, "tally_aggregator_tracking_finalizers_total", "orphaned", "WorkerPool.example.tally.dev")
	conflicts := counter(t, "tally_aggregator_apply_conflicts_total", "WorkerPool.example.tally.dev")
	_, err := r.Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(pool)})
	require.NoError(t, err)
	require.Equal(t, conflicts+1, counter(t, "tally_aggregator_apply_conflicts_total", "WorkerPool.example.tally.dev"), "the cache was not behind")
	assert.Equal(t, released+3, counter(t, "tally_aggregator_tracking_finalizers_total", "orphaned", "WorkerPool.example.tally.dev"))
	assert.Len(t, recorder.Events, 1, "one Warning Event for the three pods")
}

// notServed answers every request for WorkerPools 404 "page not found", as
// an API server that has just started does until it has read the CRDs.
type notServed struct{ rt http.RoundTripper }

func (n notServed) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.Contains(r.URL.Path, "/workerpools") {
		return &http.Response{StatusCode: http.StatusNotFound, Status: "404 Not Found", Header: http.Header{"Content-Type": {"text/plain"}},
			Body: io.NopCloser(strings.NewReader("404 page not found")), Request: r}, nil
	}
	return n.rt.RoundTrip(r)
}

// TestANotServedParentIsNotGone: the status apply and the read from the API
// server both answered "404 page not found" (the resource not served, not
// the parent gone): the reconcile fails, and is retried with back-off,
// rather than take the parent for gone and drop its count.
func TestANotServedParentIsNotGone(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	pool := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, pool))
	reducer := count.NewReducer([]config.Parent{workerPools})
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	for _, p := range mixedPods(operator.GVK, ns, "pool", pool.GetUID(), 5) {
		require.NoError(t, indexer.Add(reducer.Pod(p)))
	}
	cfg := rest.CopyConfig(env.Config)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return notServed{rt} })
	c, err := client.New(cfg, client.Options{})
	require.NoError(t, err)
	r := aggregate.NewReconciler(workerPools, aggregate.Deps{
		Parents: staleReader{pool}, Live: c, Writer: c, Pods: indexer,
		Backfilled: func(context.Context) error { return nil }, Recorder: events.NewFakeRecorder(10),
	})
	_, err = r.Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(pool)})
	assert.ErrorContains(t, err, "does not serve")
}

// TestANotServedParentKeepsItsPods: the parent read answered "404 page not
// found" (a restarted API server that has not read the CRDs yet), by the
// cache's reader or the API server's: its pods are not taken for orphans,
// and keep their finalizers.
func TestANotServedParentKeepsItsPods(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	pool := operator.Pool(ns, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, pool))
	reducer := count.NewReducer([]config.Parent{workerPools})
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	for i := range 3 {
		p := member(operator.GVK, ns, "pool", pool.GetUID(), fmt.Sprintf("p-%d", i)).Finalizer(keys.TrackingFinalizer).Build()
		require.NoError(t, indexer.Add(reducer.Pod(p)))
	}
	cfg := rest.CopyConfig(env.Config)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return notServed{rt} })
	c, err := client.New(cfg, client.Options{})
	require.NoError(t, err)
	r := aggregate.NewReconciler(workerPools, aggregate.Deps{
		Parents: c, Live: c, Writer: env.Client, Pods: indexer,
		Backfilled: func(context.Context) error { return nil }, Recorder: events.NewFakeRecorder(10),
	})
	released := counter(t, "tally_aggregator_tracking_finalizers_total", "orphaned", "WorkerPool.example.tally.dev")
	_, err = r.Reconcile(ctx, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(pool)})
	assert.Error(t, err, "a parent not served was taken for gone")
	assert.Equal(t, released, counter(t, "tally_aggregator_tracking_finalizers_total", "orphaned", "WorkerPool.example.tally.dev"),
		"the pods of a parent not served were released as orphans")
}
