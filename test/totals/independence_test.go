package totals

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/aggregator/app"
	plugin "tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

// TestTotalsNeverDependOnCounts: one kind maps a count to a path its schema
// does not declare (a typo, or a CRD edit that dropped the field), another
// a total. The first keeps its totals exactly all the same (every finished
// pod is recorded, folded and released, none lost), with a Warning Event
// on the parent that names the field; the second cannot keep totals, so
// its pods never get the tracking finalizer, and its counts are written;
// nor can a third, whose schema declares its total as a string. A fourth
// kind's schema declares a count as a string: its totals are kept exactly
// too.
func TestTotalsNeverDependOnCounts(t *testing.T) {
	ctx := context.Background()
	installCRD(t, kindCRD("CountTypo", true, true))
	installCRD(t, kindCRD("TotalTypo", true, true))
	mistyped := kindCRD("TotalMistyped", true, true)
	mistyped.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties["unexpectedTotal"] = apiextensionsv1.JSONSchemaProps{Type: "string"}
	installCRD(t, mistyped)
	countMistyped := kindCRD("CountMistyped", true, true)
	countMistyped.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties["completing"] = apiextensionsv1.JSONSchemaProps{Type: "string"}
	installCRD(t, countMistyped)
	gvk := func(kind string) schema.GroupVersionKind {
		return schema.GroupVersionKind{Group: strandGroup, Version: "v1", Kind: kind}
	}
	cfg := "parents:\n" +
		"  - {group: " + strandGroup + ", version: v1, kind: CountTypo, ledger: status.tallyLedger, counts: {completing: status.completing, active: status.notInTheSchema.active, unexpectedTotal: status.unexpectedTotal}}\n" +
		"  - {group: " + strandGroup + ", version: v1, kind: TotalTypo, ledger: status.tallyLedger, counts: {completing: status.completing, unexpectedTotal: status.notDeclaredTotal}}\n" +
		"  - {group: " + strandGroup + ", version: v1, kind: TotalMistyped, ledger: status.tallyLedger, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}}\n" +
		"  - {group: " + strandGroup + ", version: v1, kind: CountMistyped, ledger: status.tallyLedger, counts: {completing: status.completing, unexpectedTotal: status.unexpectedTotal}}\n"
	path := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte(cfg), 0o600))

	ns := namespace(t)
	startWebhook(t, ns, path)
	startAggregator(t, "aggregator", path, "", "--tracking-grace", "5s")
	// The webhook's gate checks the kinds when it starts.
	require.Eventually(t, func() bool {
		probe := builder.Pod(ns, "probe").ControlledBy(gvk("CountTypo"), "none", "00000000-0000-4000-8000-000000000000").Build()
		return env.Client.Create(ctx, probe, client.DryRunAll) == nil && len(probe.Finalizers) == 1
	}, 30*time.Second, 100*time.Millisecond, "the webhook never tracked the kind whose totals are declared")

	_, typo := createParent(t, gvk("CountTypo"), ns, "count-typo", 4)
	_, stringCount := createParent(t, gvk("CountMistyped"), ns, "count-mistyped", 3)
	_, untracked := createParent(t, gvk("TotalTypo"), ns, "total-typo", 3)
	_, untypable := createParent(t, gvk("TotalMistyped"), ns, "total-mistyped", 3)
	for _, p := range append(typo, stringCount...) {
		require.Contains(t, p.Finalizers, keys.TrackingFinalizer, "a kind whose totals and ledger are declared is tracked: %s", p.Name)
	}
	for _, p := range untracked {
		require.Empty(t, p.Finalizers, "a kind with a total its schema does not declare keeps no totals: %s", p.Name)
	}
	for _, p := range untypable {
		require.Empty(t, p.Finalizers, "a kind with a total its schema declares as a string keeps no totals: %s", p.Name)
	}
	for _, p := range append(typo, stringCount...) {
		require.NoError(t, finish(ctx, p, failed, false))
		require.NoError(t, env.Client.Delete(ctx, p.DeepCopy()))
	}
	took := goneWithin(t, append(typo, stringCount...), 30*time.Second)
	t.Logf("the finished pods of the kind with a count not in its schema gone %s after their deletion", took.Round(10*time.Millisecond))

	read := func(kind, name string, path ...string) (int64, bool) {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(gvk(kind))
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, u))
		n, found, _ := unstructured.NestedInt64(u.Object, path...)
		return n, found
	}
	require.Eventually(t, func() bool {
		n, _ := read("CountTypo", "count-typo", "status", "unexpectedTotal")
		return n == 4
	}, 15*time.Second, 100*time.Millisecond, "the totals of a kind whose counts the schema refuses lose its finished pods")
	require.Eventually(t, func() bool {
		n, _ := read("CountMistyped", "count-mistyped", "status", "unexpectedTotal")
		return n == 3
	}, 15*time.Second, 100*time.Millisecond, "the totals of a kind whose count the schema declares as a string lose its finished pods")
	require.Eventually(t, func() bool {
		n, found := read("TotalTypo", "total-typo", "status", "completing")
		return found && n == 0
	}, 15*time.Second, 100*time.Millisecond, "the counts of a kind whose totals the schema refuses are not written")
	require.Eventually(t, func() bool {
		n, found := read("TotalMistyped", "total-mistyped", "status", "completing")
		return found && n == 0
	}, 15*time.Second, 100*time.Millisecond, "the counts of a kind whose totals the schema types otherwise are not written")
	require.Eventually(t, func() bool { return noted(t, ns, "StatusFieldNotInSchema", "status.notInTheSchema.active") }, 10*time.Second, 100*time.Millisecond,
		"no Warning Event names the count the schema refuses")
	assert.True(t, noted(t, ns, "StatusFieldNotInSchema", "the totals and the ledger are kept all the same"))
}

// TestParentDeletedWhileFenced: the only aggregator is frozen (SIGSTOP)
// for longer than its lease, the parent of tracked pods is deleted
// meanwhile, and the aggregator resumes. Its first reconcile of the
// deletion finds it may not write yet (its lease renewal has not been
// sent): the release waits for it instead of being dropped, and no pod is
// left holding the finalizer.
func TestParentDeletedWhileFenced(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	leaseNS, err := env.Namespace(ctx, "lease")
	require.NoError(t, err)
	startWebhook(t, ns, withTotals)
	agg := startAggregator(t, "aggregator", withTotals, leaseNS)
	require.Eventually(t, agg.leads, 30*time.Second, 50*time.Millisecond)
	_, pods := createPool(t, ns, "pool", 4)
	require.NoError(t, finish(ctx, pods[0], failed, false))
	require.Eventually(t, func() bool { _, u, _ := totals(t, ns, "pool"); return u == 1 }, 30*time.Second, 50*time.Millisecond)

	require.NoError(t, agg.p.Signal(syscall.SIGSTOP))
	time.Sleep(app.LeaseDuration + 3*time.Second)
	require.NoError(t, env.Client.Delete(ctx, operator.Pool(ns, "pool", 0)))
	require.NoError(t, finish(ctx, pods[1], failed, false))
	require.NoError(t, agg.p.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == 0 }, 20*time.Second, 100*time.Millisecond,
		"pods of a parent deleted while the aggregator was fenced keep %s: %v", keys.TrackingFinalizer, withFinalizer(t, ns))
}

// TestUninstallWhileTallyRuns: the uninstall hook runs while pods are
// created, and while an aggregator whose pod does not go within
// --stop-timeout still runs and puts the finalizer back on running pods;
// the aggregator is killed late. The hook releases until a pass finds none
// after the stop, so no pod is left carrying the finalizer.
func TestUninstallWhileTallyRuns(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	tallyNS, err := env.Namespace(ctx, "tally")
	require.NoError(t, err)
	startWebhook(t, ns, withTotals)
	agg := startAggregator(t, "aggregator", withTotals, "")
	_, pods := createPool(t, ns, "pool", 5)
	require.NoError(t, finish(ctx, pods[0], failed, false))

	// The aggregator's Deployment, and a pod of it that does not go (no
	// kubelet runs here): the hook scales it to zero and waits in vain.
	labels := map[string]string{"app": "tally-aggregator"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: tallyNS, Name: "tally-aggregator"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](1), Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "aggregator", Image: "tally"}}},
			},
		},
	}
	require.NoError(t, env.Client.Create(ctx, dep))
	stuck := builder.Pod(tallyNS, "tally-aggregator-0").Build()
	stuck.Labels = labels
	require.NoError(t, env.Client.Create(ctx, stuck))

	var out bytes.Buffer
	streams := genericiooptions.IOStreams{Out: &out, ErrOut: &out}
	done := make(chan int, 1)
	go func() {
		done <- plugin.Main([]string{"--kubeconfig", filepath.Join(dir, "admin.kubeconfig"), "--tally-namespace", tallyNS,
			"finalizers", "remove", "--all-namespaces", "--stop-webhook", "tally-" + ns, "--stop-aggregator", "tally-aggregator",
			"--stop-timeout", "2s", "--settle", "4s"}, streams)
	}()
	// Pods created while the hook runs: the paused webhook does not track
	// them, the aggregator that still runs does, until it is killed.
	for i := range 8 {
		time.Sleep(time.Second)
		p := builder.Pod(ns, fmt.Sprintf("late-%d", i)).ControlledBy(operator.GVK, "pool", pods[0].OwnerReferences[0].UID).Build()
		require.NoError(t, env.Client.Create(ctx, p))
		if i == 5 {
			agg.kill()
			require.NoError(t, env.Client.Delete(ctx, stuck))
		}
	}
	select {
	case code := <-done:
		require.Equal(t, 0, code, "the hook failed:\n%s", out.String())
	case <-time.After(2 * time.Minute):
		t.Fatalf("the hook did not end:\n%s", out.String())
	}
	assert.Empty(t, withFinalizer(t, ns), "pods left carrying %s after the hook:\n%s", keys.TrackingFinalizer, out.String())
	assert.Contains(t, out.String(), "until a pass finds none")
	t.Logf("the hook:\n%s", out.String())
}

// noted reports whether a Warning Event of reason whose note contains text
// was recorded in ns.
func noted(t *testing.T, ns, reason, text string) bool {
	t.Helper()
	var events corev1.EventList
	require.NoError(t, env.Client.List(context.Background(), &events, client.InNamespace(ns)))
	for _, e := range events.Items {
		if e.Reason == reason && strings.Contains(e.Message, text) {
			return true
		}
	}
	return false
}
