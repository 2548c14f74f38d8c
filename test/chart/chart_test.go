// Package chart tests the Helm chart: lint, golden renderings, the values
// schema, RBAC and match conditions, a server-side dry-run of every rendered
// object against a real API server (with cert-manager's CRDs), and the
// rendered webhook registration deciding for real which pods reach the
// webhook.
package chart

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
)

const (
	release   = helm.Release
	namespace = helm.Namespace
)

// valuesFile is a values file of testdata/values, or a path of the
// repository (examples/values.yaml).
func valuesFile(name string) string {
	if strings.Contains(name, "/") {
		return repo.Path(name)
	}
	return repo.Path("test", "chart", "testdata", "values", name)
}

// sampleValues is the values file README.md shows.
const sampleValues = "examples/values.yaml"

// TestSampleValues: the README's values file passes the schema and lint,
// and the configuration it renders loads as the binaries load it.
func TestSampleValues(t *testing.T) {
	_, err := helm.Run("lint", helm.Chart(), "--strict", "-f", valuesFile(sampleValues))
	require.NoError(t, err)
	var loaded bool
	for _, u := range objects(t, render(t, sampleValues)) {
		if u.GetKind() != "ConfigMap" {
			continue
		}
		data, _, _ := unstructured.NestedString(u.Object, "data", "config.yaml")
		cfg, err := config.Parse([]byte(data))
		require.NoError(t, err)
		require.Len(t, cfg.Parents, 1)
		assert.Equal(t, "status.active", cfg.Parents[0].Counts[config.Active])
		assert.False(t, cfg.Parents[0].Tracked(), "the sample maps counts alone: totals are an opt-in")
		loaded = true
	}
	assert.True(t, loaded, "no ConfigMap rendered")
}

// render runs helm template with the given values files.
func render(t *testing.T, values ...string) string {
	t.Helper()
	args := []string{"template", release, helm.Chart(), "--namespace", namespace}
	for _, v := range values {
		args = append(args, "-f", valuesFile(v))
	}
	out, err := helm.Run(args...)
	require.NoError(t, err)
	return out
}

// objects decodes a rendering into its objects.
func objects(t *testing.T, manifest string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := helm.Objects(manifest)
	require.NoError(t, err)
	return objs
}

func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string, into any) bool {
	t.Helper()
	for _, u := range objs {
		if u.GetKind() == kind && u.GetName() == name {
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, into))
			return true
		}
	}
	return false
}

func TestLint(t *testing.T) {
	for _, values := range [][]string{nil, {"two-parents.yaml"}, {"helm-certs.yaml"}, {"monitoring.yaml"}, {"fixed-namespaces.yaml"}} {
		args := []string{"lint", "--strict", helm.Chart()}
		for _, v := range values {
			args = append(args, "-f", valuesFile(v))
		}
		out, err := helm.Run(args...)
		require.NoError(t, err, out)
	}
}

// generated matches the certificate material Helm generates afresh on each
// rendering (certificates.mode=helm).
var generated = regexp.MustCompile(`(?m)^(\s*(?:ca\.crt|tls\.crt|tls\.key|caBundle):) \S+$`)

// TestGolden compares renderings with testdata/*.golden; UPDATE_GOLDEN=true
// (make golden) rewrites them.
func TestGolden(t *testing.T) {
	tests := map[string][]string{
		"default":     nil,
		"helm-certs":  {"helm-certs.yaml"},
		"two-parents": {"two-parents.yaml"},
		"monitoring":  {"monitoring.yaml"},
		// Roles in each namespace listed instead of ClusterRole rules.
		"fixed-namespaces": {"fixed-namespaces.yaml"},
	}
	for name, values := range tests {
		t.Run(name, func(t *testing.T) {
			got := generated.ReplaceAllString(render(t, values...), "$1 <generated>")
			path := repo.Path("test", "chart", "testdata", name+".golden")
			if os.Getenv("UPDATE_GOLDEN") == "true" {
				require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err, "run `make golden` to create it")
			assert.Equal(t, string(want), got, "rendering differs from %s; run `make golden` if the change is intended", filepath.Base(path))
		})
	}
}

func TestSchemaRejectsBadValues(t *testing.T) {
	tests := map[string]string{
		"bad-unknown-count.yaml":             "at '/parents/0/counts': additional properties 'finished' not allowed",
		"bad-path.yaml":                      "at '/parents/0/counts/completing': 'spec.completing' does not match pattern",
		"bad-failure-policy.yaml":            "at '/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'",
		"bad-typo.yaml":                      "additional properties 'webhok' not allowed",
		"bad-no-resource.yaml":               "at '/parents/0': missing property 'resource'",
		"bad-timeout.yaml":                   "at '/webhook/timeoutSeconds': maximum: got 60, want 30",
		"bad-image-digest.yaml":              "at '/image/digest': 'sha256:1234' does not match pattern",
		"bad-replicas-without-election.yaml": "at '/aggregator/replicas': value must be one of 1, <nil>",
		"bad-replicaset.yaml":                "at '/parents/0': 'not' failed",
		"bad-pdb-min-available.yaml":         "'half' does not match pattern",
		"bad-alert-ratio.yaml":               "at '/metrics/prometheusRule/thresholds/applyConflictRatio': maximum: got 2, want 1",
		"bad-held-below-grace.yaml":          "heldPodSeconds (240) must be above aggregator.trackingGrace (5m, 300 s)",
		"bad-alert-override.yaml":            "metrics.prometheusRule.overrides.TallyWebhookDwon: tally has no alert of that name",
		"bad-alert-severity.yaml":            "at '/metrics/prometheusRule/overrides/TallyWebhookDown/severity': value must be one of 'critical', 'warning', 'info'",
		"bad-namespaces-release.yaml":        "namespaces: kube-system cannot be listed",
		"bad-namespaces-selector.yaml":       "namespaces and webhook.namespaceSelector cannot both be set",
		"bad-namespaces-name.yaml":           "at '/namespaces/0': 'Workers' does not match pattern",
	}
	for file, want := range tests {
		t.Run(file, func(t *testing.T) {
			_, err := helm.Run("template", release, helm.Chart(), "-f", valuesFile(file))
			require.Error(t, err)
			assert.Contains(t, err.Error(), want)
		})
	}
}

func TestAggregatorRBAC(t *testing.T) {
	objs := objects(t, render(t, "two-parents.yaml"))
	var role rbacv1.ClusterRole
	require.True(t, find(t, objs, "ClusterRole", "tally-aggregator", &role))
	assert.ElementsMatch(t, []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list", "watch"}},
		{APIGroups: []string{"batch.example.com"}, Resources: []string{"batchruns"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"batch.example.com"}, Resources: []string{"batchruns/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{"example.tally.dev"}, Resources: []string{"workerpools"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"example.tally.dev"}, Resources: []string{"workerpools/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{"events.k8s.io"}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
	}, role.Rules)

	var lease rbacv1.Role
	require.True(t, find(t, objs, "Role", "tally-aggregator-leader-election", &lease))
	assert.Equal(t, namespace, lease.Namespace)
	for _, r := range lease.Rules {
		assert.Equal(t, []string{"leases"}, r.Resources)
	}

	// verifyOwner grants the webhook read access to the parent kinds, and
	// nothing else.
	var webhookRole rbacv1.ClusterRole
	require.True(t, find(t, objs, "ClusterRole", "tally-webhook", &webhookRole))
	for _, r := range webhookRole.Rules {
		assert.Equal(t, []string{"get", "list", "watch"}, r.Verbs)
		assert.NotContains(t, r.Resources, "pods")
	}
	// Without verifyOwner the webhook has no role at all.
	assert.False(t, find(t, objects(t, render(t)), "ClusterRole", "tally-webhook", &webhookRole))
}

// TestNamespacedRBAC: with a fixed list of namespaces (values
// `namespaces`), no ClusterRole grants anything on pods or on the parent
// kinds, every Role that does is in a listed namespace (but the uninstall
// hook's list of the aggregator's own pods, in the release's namespace),
// bound there to one
// of tally's service accounts, and each listed namespace has the Roles the
// aggregator, the webhook (verifyOwner) and the uninstall hook need. The
// configuration and the webhook registration select those namespaces by
// name, which the binaries read as the fixed list.
func TestNamespacedRBAC(t *testing.T) {
	listed := []string{"batch", "workers"}
	objs := objects(t, render(t, "fixed-namespaces.yaml"))
	scoped := []string{"pods", "workerpools", "workerpools/status", "batchruns", "batchruns/status"}
	roles := map[string][]string{} // namespace → Roles granting on pods or parents
	for _, u := range objs {
		switch u.GetKind() {
		case "ClusterRole":
			var role rbacv1.ClusterRole
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &role))
			for _, r := range role.Rules {
				for _, res := range scoped {
					assert.NotContains(t, r.Resources, res, "ClusterRole %s", role.Name)
				}
				assert.NotContains(t, r.Resources, "*", "ClusterRole %s", role.Name)
			}
		case "Role":
			var role rbacv1.Role
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &role))
			for _, r := range role.Rules {
				if role.Namespace == namespace && role.Name == "tally-uninstall" && slices.Equal(r.Resources, []string{"pods"}) {
					// The hook waits for the aggregator's own pods to go.
					assert.Equal(t, []string{"list"}, r.Verbs, "Role %s/%s", role.Namespace, role.Name)
					continue
				}
				for _, res := range scoped {
					if slices.Contains(r.Resources, res) {
						assert.Contains(t, listed, role.Namespace, "Role %s/%s grants %s", role.Namespace, role.Name, res)
						roles[role.Namespace] = append(roles[role.Namespace], role.Name)
					}
				}
			}
		case "RoleBinding":
			var binding rbacv1.RoleBinding
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &binding))
			var role rbacv1.Role
			require.True(t, findIn(t, objs, "Role", binding.Namespace, binding.RoleRef.Name, &role), "RoleBinding %s/%s binds a Role of its namespace", binding.Namespace, binding.Name)
			for _, s := range binding.Subjects {
				assert.Equal(t, namespace, s.Namespace, "RoleBinding %s/%s binds tally's service accounts", binding.Namespace, binding.Name)
			}
		}
	}
	for _, ns := range listed {
		assert.ElementsMatch(t, []string{"tally-aggregator", "tally-webhook", "tally-uninstall-pods"}, slices.Compact(slices.Sorted(slices.Values(roles[ns]))), "the Roles of namespace %s", ns)
	}
	var aggregator rbacv1.Role
	require.True(t, findIn(t, objs, "Role", "workers", "tally-aggregator", &aggregator))
	assert.Contains(t, aggregator.Rules, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch", "patch"}})

	var cm corev1.ConfigMap
	require.True(t, find(t, objs, "ConfigMap", "tally-config", &cm))
	cfg, err := config.Parse([]byte(cm.Data["config.yaml"]))
	require.NoError(t, err)
	assert.Equal(t, listed, cfg.FixedNamespaces(), "the binaries read the list from the configuration")
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.True(t, find(t, objs, "MutatingWebhookConfiguration", "tally", &mwc))
	assert.Equal(t, cfg.NamespaceSelector, mwc.Webhooks[0].NamespaceSelector, "the webhook is called in the listed namespaces only")
	var job batchv1.Job
	require.True(t, find(t, objs, "Job", "tally-uninstall", &job))
	args := job.Spec.Template.Spec.Containers[0].Args
	assert.Contains(t, args, "--namespaces=workers,batch")
	assert.NotContains(t, args, "--all-namespaces")
}

// findIn is find for a namespaced object.
func findIn(t *testing.T, objs []*unstructured.Unstructured, kind, ns, name string, into any) bool {
	t.Helper()
	for _, u := range objs {
		if u.GetKind() == kind && u.GetNamespace() == ns && u.GetName() == name {
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, into))
			return true
		}
	}
	return false
}

// TestMatchConditions: the chart renders the webhook mutate.Webhook
// defines (which the suites and the demo register) for the configured
// parents and the release's aggregator: rules, namespaces, match
// conditions and policies, all but where it is served and its per-release
// settings. Its namespaceSelector is the config's, which the aggregator's
// sweep follows.
func TestMatchConditions(t *testing.T) {
	for _, values := range [][]string{nil, {"two-parents.yaml"}, {"namespaces.yaml"}} {
		objs := objects(t, render(t, values...))
		var cm struct {
			Data map[string]string `json:"data"`
		}
		for _, u := range objs {
			if u.GetKind() == "ConfigMap" {
				require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cm))
			}
		}
		cfg, err := config.Parse([]byte(cm.Data["config.yaml"]))
		require.NoError(t, err, "the rendered config file must load: %s", cm.Data["config.yaml"])

		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		require.True(t, find(t, objs, "MutatingWebhookConfiguration", "tally", &mwc))
		require.Len(t, mwc.Webhooks, 1)
		got := mwc.Webhooks[0]
		assert.Equal(t, mutate.Path, *got.ClientConfig.Service.Path)
		want := mutate.Webhook(cfg, got.ClientConfig, helm.AggregatorUser)
		// Values, not definitions: failurePolicy and namespace narrowing.
		want.FailurePolicy = got.FailurePolicy
		want.NamespaceSelector = cfg.NamespaceSelector
		assert.Equal(t, want, got)
		if len(values) > 0 && values[0] == "namespaces.yaml" {
			assert.Equal(t, "kubernetes.io/metadata.name notin (kube-system,tally-system),!tally.example/excluded,team=batch", cfg.Namespaces().String())
		}
		// tally's own pods never reach the webhook, whatever metadata
		// they carry: they start while it is down.
		for _, ns := range []string{"kube-system", helm.Namespace} {
			assert.False(t, cfg.Namespaces().Matches(labels.Set{"kubernetes.io/metadata.name": ns, "team": "batch"}), "namespace %s selected", ns)
		}
	}
}

// TestRenderedConfigLoads: the ConfigMap holds what the parents values say.
func TestRenderedConfigLoads(t *testing.T) {
	objs := objects(t, render(t, "two-parents.yaml"))
	for _, u := range objs {
		if u.GetKind() != "ConfigMap" {
			continue
		}
		data, _, _ := unstructured.NestedString(u.Object, "data", "config.yaml")
		cfg, err := config.Parse([]byte(data))
		require.NoError(t, err)
		assert.True(t, cfg.VerifyOwner)
		require.Len(t, cfg.Parents, 2)
		assert.Equal(t, "status.unexpected", cfg.Parents[0].Counts[config.Unexpected])
		assert.Equal(t, map[config.Count]string{config.Completing: "status.completing"}, cfg.Parents[1].Counts)
		out, err := yaml.Marshal(cfg)
		require.NoError(t, err)
		t.Logf("rendered config:\n%s", out)
	}
}

// TestCustomCounts: custom counts, and the fields compared with them, render
// into the config file as the values give them, names, expressions and
// their quotes intact, and the
// configuration check hook's ConfigMap holds the same file; an expression
// that does not compile passes the values schema (which cannot read CEL)
// and is refused by that check (config.Check, --check-config), naming its
// key, kind, count and position.
func TestCustomCounts(t *testing.T) {
	configOf := func(values string) string {
		configs := map[string]string{}
		for _, u := range objects(t, render(t, values)) {
			if u.GetKind() == "ConfigMap" {
				configs[u.GetName()], _, _ = unstructured.NestedString(u.Object, "data", "config.yaml")
			}
		}
		data, ok := configs[release+"-config"]
		require.True(t, ok, "no ConfigMap %s-config", release)
		require.Equal(t, data, configs[release+"-check-config"], "the hook checks the configuration the binaries read")
		return data
	}
	cfg, err := config.Parse([]byte(configOf("custom-counts.yaml")))
	require.NoError(t, err)
	custom := cfg.Parents[0].CustomCounts
	require.Len(t, custom, 3)
	assert.Equal(t, "on", custom[2].Name, "a name YAML would read as a boolean stays a name")
	assert.Equal(t, `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`, custom[0].Expression)
	assert.Equal(t, `pod.status.containerStatuses.exists(s, s.restartCount > 0) || pod.metadata.name.matches('^w-\\d+$')`, custom[1].Expression)
	assert.Equal(t, map[config.Count]string{config.Completing: "status.legacyCompleting", "on": "status.legacyOn"}, cfg.Parents[0].Compare,
		"shadow mode's fields, a count YAML would read as a boolean included")
	assert.Empty(t, cfg.Parents[0].CompareErrs)

	_, err = config.Check([]byte(configOf("custom-counts-bad-expression.yaml")))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "parents[0].customCounts[0].expression: the expression of WorkerPool.example.tally.dev's count \"ready\" does not compile")
	assert.Contains(t, err.Error(), "ERROR: parents[0].customCounts[0].expression:1:4: undefined field 'stauts'")
}

// TestCertManagerManifests: certs/cert-manager.yaml, for installs without
// Helm, is the chart's own rendering of its certificates for the release
// "tally" in tally-system; `make golden` regenerates it.
func TestCertManagerManifests(t *testing.T) {
	got, err := helm.Run("template", release, helm.Chart(), "--namespace", namespace, "--show-only", "templates/certificates.yaml")
	require.NoError(t, err)
	got = "# cert-manager resources for the tally webhook (release \"tally\", namespace \"tally-system\"),\n" +
		"# for installs without Helm. Generated from charts/tally by `make golden`; do not edit.\n" + got
	path := repo.Path("certs", "cert-manager.yaml")
	if os.Getenv("UPDATE_GOLDEN") == "true" {
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, string(want), got, "certs/cert-manager.yaml is stale; run `make golden`")
}

// TestHAValues: the PodDisruptionBudget is rendered only when a drain can
// satisfy it, the priority class and the webhook's shutdown delay reach the
// pods, and one Lease per release is named and granted alike.
func TestHAValues(t *testing.T) {
	pdb := func(set ...string) bool {
		args := []string{"template", release, helm.Chart(), "--namespace", namespace}
		for _, s := range set {
			args = append(args, "--set", s)
		}
		out, err := helm.Run(args...)
		require.NoError(t, err)
		return strings.Contains(out, "kind: PodDisruptionBudget")
	}
	assert.True(t, pdb(), "2 replicas, minAvailable 1")
	assert.False(t, pdb("webhook.replicas=1"), "1 replica, minAvailable 1: a drain could never evict it")
	assert.True(t, pdb("webhook.podDisruptionBudget.minAvailable=50%"), "2 replicas, 50%: 1")
	assert.False(t, pdb("webhook.podDisruptionBudget.minAvailable=51%"), "2 replicas, 51%: 2, rounded up")
	assert.False(t, pdb("webhook.replicas=1", "webhook.podDisruptionBudget.minAvailable=50%"), "1 replica, 50%: 1")
	assert.False(t, pdb("webhook.podDisruptionBudget.minAvailable=null"), "no minAvailable: no budget")
	assert.False(t, pdb("webhook.podDisruptionBudget.minAvailable=0"), "a budget of 0 protects nothing")
	assert.False(t, pdb("webhook.podDisruptionBudget.minAvailable=0%"), "a budget of 0 protects nothing")
	assert.False(t, pdb("webhook.podDisruptionBudget.enabled=false"))

	objs := objects(t, render(t, "two-parents.yaml"))
	for _, name := range []string{"tally-webhook", "tally-aggregator"} {
		var d appsv1.Deployment
		require.True(t, find(t, objs, "Deployment", name, &d))
		assert.Equal(t, "system-cluster-critical", d.Spec.Template.Spec.PriorityClassName, name)
		assert.Contains(t, d.Spec.Template.Spec.Containers[0].Args, "--metrics-secure=false", name)
	}
	var webhook appsv1.Deployment
	require.True(t, find(t, objs, "Deployment", "tally-webhook", &webhook))
	assert.Contains(t, webhook.Spec.Template.Spec.Containers[0].Args, "--shutdown-delay=5s")
	assert.Equal(t, int64(15), *webhook.Spec.Template.Spec.TerminationGracePeriodSeconds)

	var aggregator appsv1.Deployment
	require.True(t, find(t, objs, "Deployment", "tally-aggregator", &aggregator))
	assert.Contains(t, aggregator.Spec.Template.Spec.Containers[0].Args, "--leader-election-id=tally-aggregator")
	var lease rbacv1.Role
	require.True(t, find(t, objs, "Role", "tally-aggregator-leader-election", &lease))
	assert.Contains(t, lease.Rules[1].ResourceNames, "tally-aggregator")

	var np networkingv1.NetworkPolicy
	require.True(t, find(t, objs, "NetworkPolicy", "tally-webhook", &np))
	require.Len(t, np.Spec.Ingress, 2)
	assert.Equal(t, "webhook", np.Spec.Ingress[0].Ports[0].Port.String())
	assert.False(t, find(t, objects(t, render(t)), "NetworkPolicy", "tally-webhook", &np), "off by default")
}

// TestAggregatorReplicas: with a kind that keeps totals (totals.yaml), whose finished pods' deletions wait for a running aggregator,
// the chart runs two aggregator replicas with a PodDisruptionBudget unless
// told otherwise; without totals, one and no budget.
func TestAggregatorReplicas(t *testing.T) {
	tests := []struct {
		name     string
		values   []string
		set      []string
		replicas int32
		pdb      bool
	}{
		{name: "counts alone", replicas: 1},
		{name: "totals", values: []string{"totals.yaml"}, replicas: 2, pdb: true},
		{name: "totals, one replica asked for", values: []string{"totals.yaml"}, set: []string{"aggregator.replicas=1"}, replicas: 1},
		{name: "totals, no leader election", values: []string{"totals.yaml"}, set: []string{"aggregator.leaderElect=false"}, replicas: 1},
		{name: "totals, no budget", values: []string{"totals.yaml"}, set: []string{"aggregator.podDisruptionBudget.enabled=false"}, replicas: 2},
		{name: "counts alone, three replicas asked for", set: []string{"aggregator.replicas=3"}, replicas: 3, pdb: true},
		{name: "totals, a percentage a drain cannot satisfy", values: []string{"totals.yaml"}, set: []string{"aggregator.podDisruptionBudget.minAvailable=60%"}, replicas: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := []string{"template", release, helm.Chart(), "--namespace", namespace}
			for _, v := range tt.values {
				args = append(args, "-f", valuesFile(v))
			}
			for _, s := range tt.set {
				args = append(args, "--set", s)
			}
			out, err := helm.Run(args...)
			require.NoError(t, err)
			objs := objects(t, out)
			var d appsv1.Deployment
			require.True(t, find(t, objs, "Deployment", "tally-aggregator", &d))
			assert.Equal(t, tt.replicas, *d.Spec.Replicas)
			var pdb policyv1.PodDisruptionBudget
			require.Equal(t, tt.pdb, find(t, objs, "PodDisruptionBudget", "tally-aggregator", &pdb))
			if tt.pdb {
				assert.Equal(t, 1, pdb.Spec.MinAvailable.IntValue())
				assert.Equal(t, d.Spec.Selector.MatchLabels, pdb.Spec.Selector.MatchLabels)
				assert.Equal(t, policyv1.AlwaysAllow, *pdb.Spec.UnhealthyPodEvictionPolicy, "a replica that is not ready never holds a drain")
			}
		})
	}
}

// TestHooksLeaveNothing: every hook's permissions (the uninstall hook's
// pod-wide RBAC) and objects are deleted whatever the hook's outcome, but
// a failed uninstall Job, kept with its pods for its logs; a failed hook
// Job's log is printed.
func TestHooksLeaveNothing(t *testing.T) {
	hooks := 0
	for _, u := range objects(t, render(t, "totals.yaml")) {
		a := u.GetAnnotations()
		if a["helm.sh/hook"] == "" {
			continue
		}
		hooks++
		policies := strings.Split(a["helm.sh/hook-delete-policy"], ",")
		want := []string{"before-hook-creation", "hook-succeeded", "hook-failed"}
		if u.GetKind() == "Job" && u.GetName() == "tally-uninstall" {
			want = want[:2]
			assert.NotContains(t, policies, "hook-failed", "the failed uninstall Job is kept for its logs")
		}
		for _, p := range want {
			assert.Contains(t, policies, p, "%s %s", u.GetKind(), u.GetName())
		}
		if u.GetKind() == "Job" {
			assert.Equal(t, "hook-failed", a["helm.sh/hook-output-log-policy"], "Job %s", u.GetName())
			var job batchv1.Job
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &job))
			assert.Equal(t, corev1.RestartPolicyNever, job.Spec.Template.Spec.RestartPolicy, "Job %s: its failed pods are kept, with their logs", u.GetName())
		}
	}
	assert.Greater(t, hooks, 8, "the configuration check's and the uninstall hook's objects")
}

// TestSecureMetricsRBAC: with secure metrics (the default) both service
// accounts may review tokens and access, and a reader role exists for the
// scraper; without, neither is rendered.
func TestSecureMetricsRBAC(t *testing.T) {
	objs := objects(t, render(t))
	var auth rbacv1.ClusterRoleBinding
	require.True(t, find(t, objs, "ClusterRoleBinding", "tally-metrics-auth", &auth))
	assert.ElementsMatch(t, []string{"tally-aggregator", "tally-webhook"}, []string{auth.Subjects[0].Name, auth.Subjects[1].Name})
	var reader rbacv1.ClusterRole
	require.True(t, find(t, objs, "ClusterRole", "tally-metrics-reader", &reader))
	assert.Equal(t, []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}, reader.Rules)

	var binding rbacv1.ClusterRoleBinding
	assert.False(t, find(t, objs, "ClusterRoleBinding", "tally-metrics-reader", &binding), "no scraper named, no binding")

	insecure := objects(t, render(t, "two-parents.yaml"))
	assert.False(t, find(t, insecure, "ClusterRole", "tally-metrics-reader", &reader))

	// The scraper named: bound.
	bound, err := helm.Run("template", release, helm.Chart(), "--namespace", namespace,
		"--set", "metrics.reader.name=prometheus-k8s", "--set", "metrics.reader.namespace=monitoring")
	require.NoError(t, err)
	require.True(t, find(t, objects(t, bound), "ClusterRoleBinding", "tally-metrics-reader", &binding))
	assert.Equal(t, "tally-metrics-reader", binding.RoleRef.Name)
	assert.Equal(t, []rbacv1.Subject{{Kind: "ServiceAccount", Name: "prometheus-k8s", Namespace: "monitoring"}}, binding.Subjects)
	_, err = helm.Run("template", release, helm.Chart(), "--namespace", namespace, "--set", "metrics.reader.name=prometheus-k8s")
	assert.ErrorContains(t, err, "metrics.reader.namespace")

	// No scraper bound: the notes say scrapes get 403.
	admin, err := env.AddUser(envtest.User{Name: "chart-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, controlplane.WriteKubeconfig(admin, kubeconfig))
	notes := func(set ...string) string {
		args := []string{"install", release, helm.Chart(), "--namespace", namespace, "--dry-run=client", "--kubeconfig", kubeconfig}
		for _, v := range set {
			args = append(args, "--set", v)
		}
		out, err := helm.Run(args...)
		require.NoError(t, err)
		return out
	}
	assert.Contains(t, notes(), "every scrape gets 403")
	assert.NotContains(t, notes("metrics.reader.name=prometheus-k8s", "metrics.reader.namespace=monitoring"), "every scrape gets 403")
	assert.NotContains(t, notes("metrics.secure=false"), "every scrape gets 403")
}

// TestSecretCertificatesAreStableUnderGitOps: certificates.mode=secret
// renders the same objects on every offline rendering (helm mode cannot:
// without the cluster to read its Secret from, it generates a new CA), mounts
// the user's Secret and registers the user's CA.
func TestSecretCertificatesAreStableUnderGitOps(t *testing.T) {
	template := func(set ...string) (string, error) {
		args := []string{"template", release, helm.Chart(), "--namespace", namespace}
		for _, s := range set {
			args = append(args, "--set", s)
		}
		return helm.Run(args...)
	}
	secret := []string{"certificates.mode=secret", "certificates.secret.name=my-webhook-tls", "certificates.secret.caBundle=Y2E="}
	first, err := template(secret...)
	require.NoError(t, err)
	second, err := template(secret...)
	require.NoError(t, err)
	assert.Equal(t, first, second, "two offline renderings differ")
	helmFirst, err := template("certificates.mode=helm")
	require.NoError(t, err)
	helmSecond, err := template("certificates.mode=helm")
	require.NoError(t, err)
	assert.NotEqual(t, helmFirst, helmSecond, "helm mode renders a new CA offline (why secret mode exists)")

	objs := objects(t, first)
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.True(t, find(t, objs, "MutatingWebhookConfiguration", "tally", &mwc))
	assert.Equal(t, "ca", string(mwc.Webhooks[0].ClientConfig.CABundle))
	assert.Empty(t, mwc.Annotations)
	var webhook appsv1.Deployment
	require.True(t, find(t, objs, "Deployment", "tally-webhook", &webhook))
	assert.Equal(t, "my-webhook-tls", webhook.Spec.Template.Spec.Volumes[1].Secret.SecretName)
	for _, o := range objs {
		assert.NotContains(t, []string{"Certificate", "Issuer", "Secret"}, o.GetKind(), "secret mode creates no certificate objects")
	}

	_, err = template("certificates.mode=secret")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "at '/certificates/secret/name': minLength")
}

// TestImageReference: the image runs by tag (the appVersion by default), by
// digest when image.digest is set (a released chart), and by the user's tag
// when both are set; the uninstall hook runs the same image.
func TestImageReference(t *testing.T) {
	const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	tests := []struct {
		name string
		set  []string
		want string
	}{
		{name: "default", want: "tally.local/tally:" + chartAppVersion(t)},
		{name: "tag", set: []string{"image.tag=1.2.3"}, want: "tally.local/tally:1.2.3"},
		{name: "digest", set: []string{"image.repository=registry.example/team/tally", "image.digest=" + digest}, want: "registry.example/team/tally@" + digest},
		{name: "a tag overrides the digest", set: []string{"image.digest=" + digest, "image.tag=1.2.3"}, want: "tally.local/tally:1.2.3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := []string{"template", release, helm.Chart(), "--namespace", namespace}
			for _, s := range tt.set {
				args = append(args, "--set", s)
			}
			out, err := helm.Run(args...)
			require.NoError(t, err)
			var images []string
			for _, u := range objects(t, out) {
				containers, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
				for _, c := range containers {
					images = append(images, c.(map[string]any)["image"].(string))
				}
			}
			require.Len(t, images, 4, "the webhook, the aggregator, the configuration check and the uninstall hook")
			for _, image := range images {
				assert.Equal(t, tt.want, image)
			}
		})
	}
}

// chartAppVersion is the chart's appVersion.
func chartAppVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(helm.Chart(), "Chart.yaml"))
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^appVersion:\s*"?([^"\s]+)"?`).FindSubmatch(data)
	require.NotNil(t, m, "Chart.yaml has no appVersion")
	return string(m[1])
}
