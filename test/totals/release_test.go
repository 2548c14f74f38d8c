package totals

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// strandGroup is the group of the kinds this file installs.
const strandGroup = "strand.tally.dev"

// kindCRD returns the CRD of a namespaced kind of strandGroup whose status
// declares completing, unexpectedTotal and, with ledger, tallyLedger; with
// or without a status subresource.
func kindCRD(kind string, status, ledger bool) *apiextensionsv1.CustomResourceDefinition {
	plural := strings.ToLower(kind) + "s"
	props := map[string]apiextensionsv1.JSONSchemaProps{"completing": {Type: "integer"}, "unexpectedTotal": {Type: "integer"}}
	if ledger {
		uids := apiextensionsv1.JSONSchemaProps{Type: "array", Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &apiextensionsv1.JSONSchemaProps{Type: "string"}}}
		props["tallyLedger"] = apiextensionsv1.JSONSchemaProps{Type: "object", Properties: map[string]apiextensionsv1.JSONSchemaProps{"completed": uids, "unexpected": uids}}
	}
	version := apiextensionsv1.CustomResourceDefinitionVersion{
		Name: "v1", Served: true, Storage: true,
		Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
			Type: "object",
			Properties: map[string]apiextensionsv1.JSONSchemaProps{
				"spec":   {Type: "object", XPreserveUnknownFields: ptr.To(true)},
				"status": {Type: "object", Properties: props},
			},
		}},
	}
	if status {
		version.Subresources = &apiextensionsv1.CustomResourceSubresources{Status: &apiextensionsv1.CustomResourceSubresourceStatus{}}
	}
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: plural + "." + strandGroup},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: strandGroup, Scope: apiextensionsv1.NamespaceScoped,
			Names:    apiextensionsv1.CustomResourceDefinitionNames{Kind: kind, ListKind: kind + "List", Plural: plural, Singular: strings.ToLower(kind)},
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{version},
		},
	}
}

func installCRD(t *testing.T, c *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	require.NoError(t, env.Client.Create(context.Background(), c))
	t.Cleanup(func() { _ = env.Client.Delete(context.Background(), c) })
	gk := schema.GroupKind{Group: c.Spec.Group, Kind: c.Spec.Names.Kind}
	require.Eventually(t, func() bool {
		_, err := env.Client.RESTMapper().RESTMapping(gk, "v1")
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "the client never mapped %s", gk)
}

// createParent creates a parent of kind and n pods it controls, through
// the webhook.
func createParent(t *testing.T, gvk schema.GroupVersionKind, ns, name string, n int) (types.UID, []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	parent := &unstructured.Unstructured{}
	parent.SetGroupVersionKind(gvk)
	parent.SetNamespace(ns)
	parent.SetName(name)
	parent.Object["spec"] = map[string]any{"replicas": int64(n)}
	require.NoError(t, env.Client.Create(ctx, parent))
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = builder.Pod(ns, fmt.Sprintf("%s-%03d", name, i)).ControlledBy(gvk, name, parent.GetUID()).Build()
		require.NoError(t, env.Client.Create(ctx, pods[i]))
	}
	return parent.GetUID(), pods
}

// tracked creates n more pods of the parent of kind gvk named name, with
// the tracking finalizer from their CREATE, as a webhook of a release that
// did not check the kind would have given it.
func tracked(t *testing.T, gvk schema.GroupVersionKind, ns, name string, uid types.UID, n int) []*corev1.Pod {
	t.Helper()
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = builder.Pod(ns, fmt.Sprintf("%s-tracked-%d", name, i)).ControlledBy(gvk, name, uid).Finalizer(keys.TrackingFinalizer).Build()
		require.NoError(t, env.Client.Create(context.Background(), pods[i]))
	}
	return pods
}

// goneWithin deletes pods and waits until none is left in the API; it
// returns how long the last took.
func goneWithin(t *testing.T, pods []*corev1.Pod, bound time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	begin := time.Now()
	for _, p := range pods {
		require.NoError(t, client.IgnoreNotFound(env.Client.Delete(ctx, p.DeepCopy())))
	}
	require.Eventually(t, func() bool {
		for _, p := range pods {
			if err := env.Client.Get(ctx, client.ObjectKeyFromObject(p), &corev1.Pod{}); !apierrors.IsNotFound(err) {
				return false
			}
		}
		return true
	}, bound, 50*time.Millisecond, "pods still in the API %s after their deletion: %v", bound, withFinalizer(t, pods[0].Namespace))
	return time.Since(begin)
}

// TestUnservableKindsStrandNoPod: three kinds opt in to totals; the API
// server serves only one of them for its totals (one kind has no status
// subresource, one no ledger in its schema, and a third loses the ledger
// from its schema after its pods were tracked). The webhook gives the
// finalizer only to the first kind's pods; pods of the others that carry it
// lose it at once; none waits on tally once deleted; the healthy kind's
// totals are exact.
func TestUnservableKindsStrandNoPod(t *testing.T) {
	ctx := context.Background()
	installCRD(t, kindCRD("NoStatus", false, true))
	installCRD(t, kindCRD("NoLedger", true, false))
	installCRD(t, kindCRD("LosesLedger", true, true))
	var cfg strings.Builder
	cfg.WriteString("parents:\n")
	cfg.WriteString("  - {group: example.tally.dev, version: v1, kind: WorkerPool, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}, ledger: status.tallyLedger}\n")
	for _, kind := range []string{"NoStatus", "NoLedger", "LosesLedger"} {
		fmt.Fprintf(&cfg, "  - {group: %s, version: v1, kind: %s, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}, ledger: status.tallyLedger}\n", strandGroup, kind)
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte(cfg.String()), 0o600))

	ns := namespace(t)
	startWebhook(t, ns, path)
	agg := startAggregator(t, "aggregator", path, "")
	gvk := func(kind string) schema.GroupVersionKind {
		return schema.GroupVersionKind{Group: strandGroup, Version: "v1", Kind: kind}
	}
	// The webhook's gate checks the kinds when it starts.
	require.Eventually(t, func() bool {
		probe := builder.Pod(ns, "probe").ControlledBy(gvk("LosesLedger"), "none", "00000000-0000-4000-8000-000000000000").Build()
		return env.Client.Create(ctx, probe, client.DryRunAll) == nil && len(probe.Finalizers) == 1
	}, 30*time.Second, 100*time.Millisecond, "the webhook never tracked a servable kind")

	_, pools := createParent(t, operator.GVK, ns, "pool", 6)
	noStatusUID, noStatus := createParent(t, gvk("NoStatus"), ns, "no-status", 4)
	noLedgerUID, noLedger := createParent(t, gvk("NoLedger"), ns, "no-ledger", 4)
	_, loses := createParent(t, gvk("LosesLedger"), ns, "loses", 4)
	for _, p := range append(append([]*corev1.Pod{}, noStatus...), noLedger...) {
		assert.Empty(t, p.Finalizers, "the webhook gives no finalizer to a pod of a kind that cannot keep totals: %s", p.Name)
	}
	for _, p := range append(append([]*corev1.Pod{}, pools...), loses...) {
		assert.Contains(t, p.Finalizers, keys.TrackingFinalizer, "the webhook tracks the pods of a served kind: %s", p.Name)
	}

	// Pods of the unservable kinds that carry the finalizer anyway lose it
	// without being deleted.
	noStatus = append(noStatus, tracked(t, gvk("NoStatus"), ns, "no-status", noStatusUID, 2)...)
	noLedger = append(noLedger, tracked(t, gvk("NoLedger"), ns, "no-ledger", noLedgerUID, 2)...)
	require.Eventually(t, func() bool {
		held := withFinalizer(t, ns)
		for _, p := range append(noStatus[4:], noLedger[4:]...) {
			if contains(held, p.Name) {
				return false
			}
		}
		return true
	}, 15*time.Second, 50*time.Millisecond, "pods of kinds that cannot keep totals keep the finalizer")
	took := goneWithin(t, append(noStatus, noLedger...), 10*time.Second)
	t.Logf("pods of the unservable kinds gone %s after their deletion", took.Round(10*time.Millisecond))

	// The healthy kind: two pods deleted, one failed; exact totals.
	require.NoError(t, finish(ctx, pools[0], deletedRunning, false))
	require.NoError(t, finish(ctx, pools[1], deletedPending, false))
	require.NoError(t, finish(ctx, pools[2], failed, false))
	require.Eventually(t, func() bool {
		_, unexpected, ledger := totals(t, ns, "pool")
		return unexpected == 3 && ledger == 0
	}, 30*time.Second, 100*time.Millisecond, "the healthy kind's totals")

	// The ledger leaves LosesLedger's schema after its pods were tracked:
	// once deleted, they go within seconds all the same.
	updateCRD(t, "losesledgers."+strandGroup, func(v *apiextensionsv1.CustomResourceDefinitionVersion) {
		delete(v.Schema.OpenAPIV3Schema.Properties["status"].Properties, "tallyLedger")
	})
	took = goneWithin(t, loses, 15*time.Second)
	t.Logf("pods of a kind whose schema lost its ledger gone %s after their deletion", took.Round(10*time.Millisecond))
	log, err := os.ReadFile(agg.p.LogPath())
	require.NoError(t, err)
	assert.Contains(t, string(log), "Released pods held by the tracking finalizer")

	var events corev1.EventList
	require.NoError(t, env.Client.List(ctx, &events, client.InNamespace(ns)))
	reasons := map[string]bool{}
	for _, e := range events.Items {
		reasons[e.Reason+"/"+e.InvolvedObject.Kind] = true
	}
	assert.True(t, reasons["TrackingReleasedUncounted/NoLedger"], "a Warning Event on the parent whose pods were released: %v", reasons)

	// kubectl tally explain and doctor show it.
	var out, errOut bytes.Buffer
	streams := genericiooptions.IOStreams{Out: &out, ErrOut: &errOut}
	app.Main([]string{"--kubeconfig", filepath.Join(dir, "admin.kubeconfig"), "--config", path, "-n", ns, "explain", "noledgers." + strandGroup + "/no-ledger"}, streams)
	assert.Contains(t, out.String(), "Pods released without being counted in the totals", "explain:\n%s%s", out.String(), errOut.String())
	assert.Contains(t, out.String(), "TrackingReleasedUncounted noledger "+ns+"/no-ledger: tally cannot keep the totals of NoLedger."+strandGroup)
}

func contains(list []string, s string) bool {
	for _, e := range list {
		if e == s {
			return true
		}
	}
	return false
}

// updateCRD changes a CRD's only version, retrying conflicts.
func updateCRD(t *testing.T, name string, change func(*apiextensionsv1.CustomResourceDefinitionVersion)) {
	t.Helper()
	require.Eventually(t, func() bool {
		var c apiextensionsv1.CustomResourceDefinition
		require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Name: name}, &c))
		change(&c.Spec.Versions[0])
		return env.Client.Update(context.Background(), &c) == nil
	}, 10*time.Second, 50*time.Millisecond)
}

// managers returns the field managers of a pool's status and the fields
// each owns there.
func managers(t *testing.T, ns, name string) map[string]string {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, u))
	out := map[string]string{}
	for _, mf := range u.GetManagedFields() {
		if mf.Subresource == "status" && mf.FieldsV1 != nil {
			out[mf.Manager] = string(mf.FieldsV1.GetRawBytes())
		}
	}
	return out
}

// applyStatus applies status fields of a pool under manager, as a release
// of tally would.
func applyStatus(t *testing.T, ns, name, manager string, status map[string]any) {
	t.Helper()
	u := &unstructured.Unstructured{Object: map[string]any{"status": status}}
	u.SetGroupVersionKind(operator.GVK)
	u.SetNamespace(ns)
	u.SetName(name)
	require.NoError(t, env.Client.Status().Apply(context.Background(), client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(manager), client.ForceOwnership))
}

// TestHistorySurvivesUpgradeRollbackAndOptOut: a pool whose totals were
// written by the single-manager layout keeps them through the upgrade
// (ownership moves to tally-aggregator-totals, nothing resets), through
// what a rollback to a release without totals applies, and through an
// opt-out, which also releases its pods.
func TestHistorySurvivesUpgradeRollbackAndOptOut(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	_, pods := createPool(t, ns, "pool", 8)

	// The previous layout: counts, totals and ledger under one manager.
	applyStatus(t, ns, "pool", aggregate.FieldManager, map[string]any{
		"completing": int64(0), "completed": int64(0), "active": int64(8), "unexpected": int64(0),
		"completedTotal": int64(5), "unexpectedTotal": int64(7),
		"tallyLedger": map[string]any{"completed": []any{}, "unexpected": []any{}},
	})

	agg := startAggregator(t, "aggregator", withTotals, "")
	require.NoError(t, finish(ctx, pods[0], failed, false))
	var c, u int64
	var l int
	if !assert.Eventually(t, func() bool {
		c, u, l = totals(t, ns, "pool")
		return c == 5 && u == 8 && l == 0
	}, 30*time.Second, 100*time.Millisecond) {
		require.FailNow(t, fmt.Sprintf("the totals go on from the previous layout's: completed %d, unexpected %d, %d in the ledger; status managers %v",
			c, u, l, managers(t, ns, "pool")))
	}
	owned := managers(t, ns, "pool")
	assert.NotContains(t, owned[aggregate.FieldManager], "Total", "the counts' manager owns no total any more: %v", owned)
	assert.NotContains(t, owned[aggregate.FieldManager], "tallyLedger")
	assert.Contains(t, owned[aggregate.TotalsFieldManager], "f:unexpectedTotal")
	assert.Contains(t, owned[aggregate.TotalsFieldManager], "f:tallyLedger")

	// A rollback to a release without totals applies the counts alone.
	agg.kill()
	applyStatus(t, ns, "pool", aggregate.FieldManager, map[string]any{
		"completing": int64(0), "completed": int64(0), "active": int64(7), "unexpected": int64(1),
	})
	c, u, _ = totals(t, ns, "pool")
	assert.Equal(t, [2]int64{5, 8}, [2]int64{c, u}, "the rolled-back release's apply keeps the totals")

	// Opt out: the totals stay, the pods lose the finalizer, the counts
	// go on.
	startAggregator(t, "opted-out", withoutTotals, "")
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, 30*time.Second, 100*time.Millisecond,
		"the pods of an opted-out kind keep %s: %v", keys.TrackingFinalizer, withFinalizer(t, ns))
	require.NoError(t, finish(ctx, pods[1], failed, false))
	require.Eventually(t, func() bool {
		active, err := env.StatusCount(ctx, operator.GVK, ns, "pool", "status", "active")
		return err == nil && active == 6
	}, 30*time.Second, 100*time.Millisecond, "the counts go on after the opt-out")
	c, u, _ = totals(t, ns, "pool")
	assert.Equal(t, [2]int64{5, 8}, [2]int64{c, u}, "an opted-out kind keeps its last totals")
}

// TestConfigChangesKeepHistory: with totals recorded, one total is
// unmapped, then renamed, then the ledger is renamed while it holds a UID
// not yet folded, then the example's configuration comes back; and a pool
// of the single-manager layout meets an opt-out. No change erases a total
// or a ledger's UID, and no total ever goes down.
func TestConfigChangesKeepHistory(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	updateCRD(t, "workerpools.example.tally.dev", func(v *apiextensionsv1.CustomResourceDefinitionVersion) {
		status := v.Schema.OpenAPIV3Schema.Properties["status"]
		status.Properties["crashTotal"] = apiextensionsv1.JSONSchemaProps{Type: "integer", Format: "int64"}
		status.Properties["ledgerV2"] = status.Properties["tallyLedger"]
		v.Schema.OpenAPIV3Schema.Properties["status"] = status
	})
	startWebhook(t, ns, withTotals)
	seen := framework.WatchTotals(t, env.Config, ns)
	_, pods := createPool(t, ns, "pool", 12)
	createPool(t, ns, "legacy", 0)

	status := func(field string) (int64, bool) {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(operator.GVK)
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pool"}, u))
		v, found, _ := unstructured.NestedFieldNoCopy(u.Object, "status", field)
		n, _ := v.(int64)
		return n, found
	}
	// unfolded counts the UIDs in either ledger of the pool.
	unfolded := func() int {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(operator.GVK)
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pool"}, u))
		n := 0
		for _, ledger := range []string{"tallyLedger", "ledgerV2"} {
			for _, list := range []string{"completed", "unexpected"} {
				l, _, _ := unstructured.NestedStringSlice(u.Object, "status", ledger, list)
				n += len(l)
			}
		}
		return n
	}
	next := 0
	// phase runs an aggregator with cfg while one pod fails and one
	// completes as asked, then waits for want (status fields of the pool)
	// with nothing left in its ledgers.
	var agg *aggregator
	phase := func(name, cfg string, want map[string]int64) {
		t.Helper()
		if agg != nil {
			agg.kill()
		}
		agg = startAggregator(t, name, cfg, "")
		require.NoError(t, finish(ctx, pods[next], failed, false))
		require.NoError(t, finish(ctx, pods[next+1], succeeded, true))
		next += 2
		shows := func() map[string]int64 {
			got := map[string]int64{}
			for field := range want {
				got[field], _ = status(field)
			}
			return got
		}
		if !assert.Eventually(t, func() bool {
			return maps.Equal(shows(), want) && unfolded() == 0
		}, 30*time.Second, 100*time.Millisecond) {
			require.FailNow(t, fmt.Sprintf("%s: the pool shows %v with %d UIDs in its ledgers, want %v with empty ledgers",
				name, shows(), unfolded(), want))
		}
	}

	phase("totals", withTotals, map[string]int64{"completedTotal": 1, "unexpectedTotal": 1})
	// Unmapped: unexpectedTotal keeps its value; the failed pod of this
	// phase is in no total that is mapped.
	phase("one-total", oneTotal, map[string]int64{"completedTotal": 2, "unexpectedTotal": 1})
	// Renamed: the old field keeps its value, the new one starts at zero.
	phase("renamed-total", renamedTotal, map[string]int64{"completedTotal": 3, "unexpectedTotal": 1, "crashTotal": 1})

	// A UID recorded in the ledger and released, not yet folded, when the
	// ledger is renamed: it moves to the new ledger and is folded there.
	agg.kill()
	agg = nil
	applyStatus(t, ns, "pool", aggregate.TotalsFieldManager, map[string]any{
		"completedTotal": int64(3), "unexpectedTotal": int64(1), "crashTotal": int64(1),
		"tallyLedger": map[string]any{"completed": []any{}, "unexpected": []any{"00000000-0000-4000-8000-00000000dead"}},
	})
	phase("renamed-ledger", renamedLedger, map[string]int64{"completedTotal": 4, "unexpectedTotal": 3, "crashTotal": 1})
	_, oldLedger := status("tallyLedger")
	assert.False(t, oldLedger, "the renamed ledger stays beside the new one")

	phase("reverted", withTotals, map[string]int64{"completedTotal": 5, "unexpectedTotal": 4, "crashTotal": 1})

	// Opted out while a pool still has the single-manager layout (an
	// upgrade and an opt-out at once): its history is handed over, not
	// erased.
	agg.kill()
	// active is wrong, so the counts' apply that would remove the totals
	// does happen.
	applyStatus(t, ns, "legacy", aggregate.FieldManager, map[string]any{
		"completing": int64(0), "completed": int64(0), "active": int64(3), "unexpected": int64(0),
		"completedTotal": int64(5), "unexpectedTotal": int64(7),
		"tallyLedger": map[string]any{"completed": []any{}, "unexpected": []any{}},
	})
	agg = startAggregator(t, "opted-out", withoutTotals, "")
	require.Eventually(t, func() bool {
		active, err := env.StatusCount(ctx, operator.GVK, ns, "legacy", "status", "active")
		return err == nil && active == 0
	}, 30*time.Second, 100*time.Millisecond, "the legacy pool's counts are not written")
	owned := managers(t, ns, "legacy")
	assert.NotContains(t, owned[aggregate.FieldManager], "Total", "the counts' manager still holds the legacy pool's totals")
	assert.Contains(t, owned[aggregate.TotalsFieldManager], "f:unexpectedTotal")
	c, u, _ := totals(t, ns, "legacy")
	assert.Equal(t, [2]int64{5, 7}, [2]int64{c, u}, "an opt-out erased the single-manager layout's totals")
	c, u, _ = totals(t, ns, "pool")
	assert.Equal(t, [2]int64{5, 4}, [2]int64{c, u}, "an opt-out erased the totals")

	for _, pool := range []string{"pool", "legacy"} {
		var last [2]int64
		for _, s := range seen.Of(pool) {
			assert.GreaterOrEqual(t, s[0], last[0], "completedTotal of %s went down: %v", pool, seen.Of(pool))
			assert.GreaterOrEqual(t, s[1], last[1], "unexpectedTotal of %s went down: %v", pool, seen.Of(pool))
			last = s
		}
	}
}

// TestUnlistableKindStallsNoOther: beside a healthy kind and a kind that
// cannot keep totals, a third kind the API server cannot list (its served
// version needs a conversion webhook that is not there) has a tracked pod.
// Its informer never syncs; the other kinds' controllers start all the same
// (each kind's parents have a cache of their own) and their releases
// happen (the release passes read parents within a bound): the unservable
// kind's pods lose the finalizer, and the healthy kind's deleted pods,
// whose records the API server keeps refusing, are released after the
// grace.
func TestUnlistableKindStallsNoOther(t *testing.T) {
	ctx := context.Background()
	unlistable := kindCRD("Unlistable", true, true)
	v2 := *unlistable.Spec.Versions[0].DeepCopy()
	v2.Name, v2.Storage = "v2", false
	unlistable.Spec.Versions = append(unlistable.Spec.Versions, v2)
	unlistable.Spec.Conversion = &apiextensionsv1.CustomResourceConversion{
		Strategy: apiextensionsv1.WebhookConverter,
		Webhook: &apiextensionsv1.WebhookConversion{
			ClientConfig:             &apiextensionsv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1/convert")},
			ConversionReviewVersions: []string{"v1"},
		},
	}
	installCRD(t, unlistable)
	installCRD(t, kindCRD("Unserved", true, false))
	gvk := func(kind, version string) schema.GroupVersionKind {
		return schema.GroupVersionKind{Group: strandGroup, Version: version, Kind: kind}
	}
	var cfg strings.Builder
	cfg.WriteString("parents:\n")
	cfg.WriteString("  - {group: example.tally.dev, version: v1, kind: WorkerPool, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}, ledger: status.tallyLedger}\n")
	fmt.Fprintf(&cfg, "  - {group: %s, version: v2, kind: Unlistable, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}, ledger: status.tallyLedger}\n", strandGroup)
	fmt.Fprintf(&cfg, "  - {group: %s, version: v1, kind: Unserved, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}, ledger: status.tallyLedger}\n", strandGroup)
	path := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte(cfg.String()), 0o600))

	ns := namespace(t)
	startWebhook(t, ns, path)
	// Created in the storage version, the object cannot be listed in v2.
	stuckUID, _ := createParent(t, gvk("Unlistable", "v1"), ns, "stuck", 0)
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(gvk("UnlistableList", "v2"))
	require.Error(t, env.Client.List(ctx, list, client.InNamespace(ns)), "the API server lists the kind in v2")
	stuck := tracked(t, gvk("Unlistable", "v2"), ns, "stuck", stuckUID, 1)
	t.Cleanup(func() { releaseAll(t, stuck) })
	unservedUID, _ := createParent(t, gvk("Unserved", "v1"), ns, "unserved", 0)
	unserved := tracked(t, gvk("Unserved", "v1"), ns, "unserved", unservedUID, 2)
	_, pods := createPool(t, ns, "pool", 3)
	for _, p := range pods {
		require.Contains(t, p.Finalizers, keys.TrackingFinalizer)
	}
	blockStatusWrites(t, ns)

	startAggregator(t, "aggregator", path, "", "--tracking-grace", "3s")
	took := goneWithin(t, append(pods, unserved...), 30*time.Second)
	t.Logf("the other kinds' pods gone %s after their deletion", took.Round(10*time.Millisecond))
	assert.Equal(t, []string{stuck[0].Name}, withFinalizer(t, ns), "the unlistable kind's pod is left to its kind")
}

// releaseAll removes the tracking finalizer from pods, so that their
// namespace can go.
func releaseAll(t *testing.T, pods []*corev1.Pod) {
	for _, p := range pods {
		err := env.Client.Patch(context.Background(), p.DeepCopy(), client.RawPatch(types.StrategicMergePatchType, aggregate.ReleasePatch(p.UID)))
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("releasing %s: %v", p.Name, err)
		}
	}
}
