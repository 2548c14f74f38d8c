// Package kubectltally runs `kubectl tally` against the chart installed with
// helm and the real webhook and aggregator binaries running as the chart's
// service accounts: explain on pools in each interesting state (golden
// outputs, JSON parsed back), and doctor green on a healthy install, then
// turned red by breaking exactly one thing at a time.
package kubectltally

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/explain"
	"tally.dev/tally/pkg/intent"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	bin string
)

const (
	ns   = helm.Namespace
	pool = "pools"
)

func TestMain(m *testing.M) {
	os.Exit(framework.MainWithBinaries(m, controlplane.Options{}, &env, &bin, "webhook", "aggregator"))
}

// install is the chart installed and its two binaries running.
type install struct {
	dir, kubeconfig, certDir string
	webhook, aggregator      *process.Process
	webhookArgs              []string
}

func setup(t *testing.T) *install {
	ctx := context.Background()
	in := &install{dir: t.TempDir()}
	admin, err := env.AddUser(envtest.User{Name: "kubectl-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	in.kubeconfig = filepath.Join(in.dir, "admin.kubeconfig")
	require.NoError(t, os.WriteFile(in.kubeconfig, adminConfig, 0o600))
	valuesFile, err := helm.WriteValues(in.dir, []config.Parent{helm.WorkerPool(config.Counts...)}, helm.LocalCertificates)
	require.NoError(t, err)
	// No Job controller runs here to run the chart's configuration check
	// (test/install runs its command).
	_, err = helm.Run("install", helm.Release, helm.Chart(), "--namespace", ns, "--create-namespace", "-f", valuesFile, "--kubeconfig", in.kubeconfig, "--no-hooks")
	require.NoError(t, err)

	var cm corev1.ConfigMap
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: helm.Release + "-config"}, &cm))
	configFile := filepath.Join(in.dir, "config.yaml")
	require.NoError(t, os.WriteFile(configFile, []byte(cm.Data["config.yaml"]), 0o600))
	var secret corev1.Secret
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: helm.Release + "-webhook-tls"}, &secret))
	in.certDir = filepath.Join(in.dir, "tls")
	require.NoError(t, os.MkdirAll(in.certDir, 0o700))
	for _, f := range []string{"tls.crt", "tls.key"} {
		require.NoError(t, os.WriteFile(filepath.Join(in.certDir, f), secret.Data[f], 0o600))
	}
	for _, sa := range []string{"webhook", "aggregator"} {
		require.NoError(t, framework.KubeconfigAs(adminConfig, ns, helm.Release+"-"+sa, filepath.Join(in.dir, sa+".kubeconfig")))
	}
	port, err := process.FreePort()
	require.NoError(t, err)
	in.webhookArgs = []string{"--config", configFile, "--kubeconfig", filepath.Join(in.dir, "webhook.kubeconfig"), "--cert-dir", in.certDir,
		"--host", "127.0.0.1", "--port", fmt.Sprint(port), "--metrics-bind-address", "0", "--shutdown-delay", "0s"}
	in.webhook, _ = framework.StartProcess(t, bin, "webhook", in.webhookArgs...)
	in.aggregator, _ = framework.StartProcess(t, bin, "aggregator", "--config", configFile, "--kubeconfig", filepath.Join(in.dir, "aggregator.kubeconfig"),
		"--leader-elect", "--leader-election-namespace", ns, "--leader-election-id", helm.Release+"-aggregator",
		"--metrics-bind-address", "0", "--backfill-interval", "1h")

	// The installed registration, pointed at the local webhook.
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
	mwc.Webhooks[0].ClientConfig.Service = nil
	mwc.Webhooks[0].ClientConfig.URL = ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path))
	require.NoError(t, env.Client.Update(ctx, &mwc))
	time.Sleep(2 * time.Second) // the API server picks the registration up asynchronously
	return in
}

// run runs kubectl tally in-process and returns its exit code and output.
func (in *install) run(args ...string) (int, string) {
	var out, errOut bytes.Buffer
	code := app.Main(append([]string{"--kubeconfig", in.kubeconfig}, args...), genericiooptions.IOStreams{Out: &out, ErrOut: &errOut})
	return code, out.String() + errOut.String()
}

var (
	uidRE  = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)
	timeRE = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`)
	agoRE  = regexp.MustCompile(`[0-9][0-9a-zµ.]* ago`)
)

// golden compares explain's output, its UIDs, times and ages replaced,
// with testdata/<name>.golden; UPDATE_GOLDEN=true (make golden) rewrites it.
func golden(t *testing.T, name, got string) {
	t.Helper()
	got = agoRE.ReplaceAllString(timeRE.ReplaceAllString(uidRE.ReplaceAllString(got, "<uid>"), "<time>"), "<age> ago")
	path := repo.Path("test", "kubectltally", "testdata", name+".golden")
	if os.Getenv("UPDATE_GOLDEN") == "true" {
		require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "run `make golden` to create it")
	assert.Equal(t, string(want), got, "output differs from %s; run `make golden` if the change is intended", filepath.Base(path))
}

// newPool creates a pool with one pod in each class, through the webhook.
func newPool(t *testing.T, name string) *unstructured.Unstructured {
	ctx := context.Background()
	p := operator.Pool(pool, name, 4)
	require.NoError(t, env.Client.Create(ctx, p))
	states := []struct {
		suffix string
		intent bool
		phase  corev1.PodPhase
	}{{"active", false, corev1.PodRunning}, {"completing", true, corev1.PodRunning}, {"completed", true, corev1.PodSucceeded}, {"unexpected", false, corev1.PodFailed}}
	for _, s := range states {
		pod := builder.Pod(pool, name+"-"+s.suffix).ControlledBy(operator.GVK, name, p.GetUID()).Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		if s.intent {
			require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))
		}
		patch := client.MergeFrom(pod.DeepCopy())
		pod.Status.Phase = s.phase
		require.NoError(t, env.Client.Status().Patch(ctx, pod, patch))
	}
	return p
}

// settled waits until explain finds the pool's counts equal.
func (in *install) settled(t *testing.T, name string) string {
	t.Helper()
	var out string
	require.Eventually(t, func() bool {
		var code int
		code, out = in.run("-n", pool, "--tally-namespace", ns, "explain", "workerpool/"+name)
		return code == app.ExitOK
	}, 30*time.Second, 200*time.Millisecond, "explain never found the counts equal:\n%s", out)
	return out
}

func TestExplainAndDoctor(t *testing.T) {
	ctx := context.Background()
	in := setup(t)
	require.NoError(t, env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: pool}}))

	t.Run("explain: all equal", func(t *testing.T) {
		newPool(t, "equal")
		golden(t, "explain-equal", in.settled(t, "equal"))
	})

	t.Run("explain: unstamped and forged pods", func(t *testing.T) {
		p := newPool(t, "unstamped")
		in.settled(t, "unstamped")
		// Pods the webhook never saw: created while it is not registered.
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
		require.NoError(t, env.Client.Delete(ctx, &mwc))
		time.Sleep(2 * time.Second)
		require.NoError(t, env.Client.Create(ctx, builder.Pod(pool, "unstamped-missed").ControlledBy(operator.GVK, p.GetName(), p.GetUID()).Build()))
		forged := builder.Pod(pool, "unstamped-forged").Build()
		forged.Labels = map[string]string{keys.ParentUID: string(p.GetUID())}
		require.NoError(t, env.Client.Create(ctx, forged))
		mwc.ResourceVersion = ""
		require.NoError(t, env.Client.Create(ctx, &mwc))
		time.Sleep(2 * time.Second)

		code, out := in.run("-n", pool, "--tally-namespace", ns, "explain", "workerpools.example.tally.dev/unstamped")
		assert.Equal(t, app.ExitProblem, code, "the unstamped pod is in the fresh count only")
		golden(t, "explain-unstamped", out)

		code, out = in.run("-n", pool, "--tally-namespace", ns, "explain", "workerpool", "unstamped", "-o", "json")
		assert.Equal(t, app.ExitProblem, code)
		var r explain.Report
		require.NoError(t, json.Unmarshal([]byte(out), &r), out)
		assert.Equal(t, []string{"unstamped-missed"}, r.Unstamped)
		require.Len(t, r.NotCounted, 1)
		assert.Equal(t, "unstamped-forged", r.NotCounted[0].Name)
		assert.False(t, r.Equal)
		assert.NotNil(t, r.LastWrite)
	})

	t.Run("doctor: healthy", func(t *testing.T) {
		code, out := in.run("--tally-namespace", ns, "doctor")
		assert.Equal(t, app.ExitOK, code, out)
		assert.NotContains(t, out, "FAIL")
		for _, check := range []string{"Kubernetes version", "config", "webhook registration", "webhook endpoints", "webhook certificate", "aggregator lease",
			"parent kind WorkerPool.example.tally.dev", "tracking finalizers", "admission policies", "permissions"} {
			assert.Contains(t, out, "OK    "+check+": ")
		}
		assert.Contains(t, out, "none finished more than 2m0s (the aggregator's --tracking-grace) ago", "the grace read from the chart's Deployment")
	})

	t.Run("doctor --config: a custom count that does not compile, and a comparison of a total", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "config.yaml")
		require.NoError(t, os.WriteFile(file, []byte(`parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    customCounts:
      - name: ready
        path: status.ready
        expression: 'pod.status.conditions.exists(c, c.type == "Ready") && pod.stauts.phase == "Running"'
    compare:
      unexpectedTotal: status.restarts
`), 0o600))
		code, out := in.run("--tally-namespace", ns, "doctor", "--config", file)
		assert.Equal(t, app.ExitProblem, code, out)
		assert.Contains(t, out, "FAIL  config: ")
		assert.Contains(t, out, `parents[0].customCounts[0].expression: the expression of WorkerPool.example.tally.dev's count "ready" does not compile`)
		assert.Contains(t, out, "ERROR: parents[0].customCounts[0].expression:1:58: undefined field 'stauts'")
		assert.Contains(t, out, "parents[0].compare.unexpectedTotal: a total cannot be compared")
		assert.Contains(t, out, "the aggregator leaves these custom counts unwritten and these comparisons out, and serves everything else")
		assert.Contains(t, out, "fix these custom counts and comparisons (helm install and upgrade refuse them)")
		assert.Contains(t, out, "OK    webhook registration", "the other checks run on the rest of the configuration")
	})

	// Each case breaks one thing, expects exactly that check to fail, and
	// repairs it.
	breaks := []struct {
		name, check string
		breakIt     func(t *testing.T) (repair func())
	}{
		{"wrong caBundle", "webhook certificate", func(t *testing.T) func() {
			other, err := devcert.NewCA("another CA", time.Hour)
			require.NoError(t, err)
			var mwc admissionregistrationv1.MutatingWebhookConfiguration
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
			good := mwc.Webhooks[0].ClientConfig.CABundle
			mwc.Webhooks[0].ClientConfig.CABundle = other.CertPEM
			require.NoError(t, env.Client.Update(ctx, &mwc))
			return func() {
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
				mwc.Webhooks[0].ClientConfig.CABundle = good
				require.NoError(t, env.Client.Update(ctx, &mwc))
			}
		}},
		{"expired certificate", "webhook certificate", func(t *testing.T) func() {
			var mwc admissionregistrationv1.MutatingWebhookConfiguration
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
			good := map[string][]byte{}
			for _, f := range []string{"tls.crt", "tls.key"} {
				b, err := os.ReadFile(filepath.Join(in.certDir, f))
				require.NoError(t, err)
				good[f] = b
			}
			// An expired certificate from a CA the caBundle trusts: the
			// registration's CA signs it (the chart's Secret holds ca.crt
			// but not its key), so the bundle is switched to that CA too.
			ca, err := devcert.NewCA("tally test CA", time.Hour)
			require.NoError(t, err)
			expired, err := ca.Issue([]string{"127.0.0.1"}, -30*time.Second)
			require.NoError(t, err)
			goodBundle := mwc.Webhooks[0].ClientConfig.CABundle
			mwc.Webhooks[0].ClientConfig.CABundle = ca.CertPEM
			require.NoError(t, env.Client.Update(ctx, &mwc))
			require.NoError(t, expired.WriteDir(in.certDir))
			return func() {
				for f, b := range good {
					require.NoError(t, os.WriteFile(filepath.Join(in.certDir, f), b, 0o600))
				}
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
				mwc.Webhooks[0].ClientConfig.CABundle = goodBundle
				require.NoError(t, env.Client.Update(ctx, &mwc))
			}
		}},
		{"a match condition of an older release", "webhook registration", func(t *testing.T) func() {
			var mwc admissionregistrationv1.MutatingWebhookConfiguration
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
			good := mwc.Webhooks[0].MatchConditions
			mwc.Webhooks[0].MatchConditions = slices.DeleteFunc(slices.Clone(good), func(c admissionregistrationv1.MatchCondition) bool {
				return c.Name == mutate.ChangeConditionName
			})
			require.NoError(t, env.Client.Update(ctx, &mwc))
			return func() {
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
				mwc.Webhooks[0].MatchConditions = good
				require.NoError(t, env.Client.Update(ctx, &mwc))
			}
		}},
		{"registration left paused by a killed uninstall", "webhook registration", func(t *testing.T) func() {
			var mwc admissionregistrationv1.MutatingWebhookConfiguration
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
			good := mwc.Webhooks[0].MatchConditions
			mwc.Webhooks[0].MatchConditions = append(slices.Clone(good), admissionregistrationv1.MatchCondition{Name: app.PauseCondition, Expression: "false"})
			require.NoError(t, env.Client.Update(ctx, &mwc))
			return func() {
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: helm.Release}, &mwc))
				mwc.Webhooks[0].MatchConditions = good
				require.NoError(t, env.Client.Update(ctx, &mwc))
			}
		}},
		{"field missing from the CRD", "parent kind WorkerPool.example.tally.dev", func(t *testing.T) func() {
			var crd apiextensionsv1.CustomResourceDefinition
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: "workerpools.example.tally.dev"}, &crd))
			good := crd.DeepCopy()
			delete(crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties, "unexpected")
			require.NoError(t, env.Client.Update(ctx, &crd))
			return func() {
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: crd.Name}, &crd))
				crd.Spec.Versions = good.Spec.Versions
				require.NoError(t, env.Client.Update(ctx, &crd))
			}
		}},
		{"count declared as a string in the CRD", "parent kind WorkerPool.example.tally.dev", func(t *testing.T) func() {
			var crd apiextensionsv1.CustomResourceDefinition
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: "workerpools.example.tally.dev"}, &crd))
			good := crd.DeepCopy()
			crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"].Properties["completing"] = apiextensionsv1.JSONSchemaProps{Type: "string"}
			require.NoError(t, env.Client.Update(ctx, &crd))
			return func() {
				require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: crd.Name}, &crd))
				crd.Spec.Versions = good.Spec.Versions
				require.NoError(t, env.Client.Update(ctx, &crd))
			}
		}},
		{"pod finished long ago still held by the tracking finalizer", "tracking finalizers", func(t *testing.T) func() {
			// Carrying the finalizer without tally's labels, it is no pod
			// the aggregator watches: nothing releases it.
			pod := builder.Pod(pool, "stuck").Finalizer(keys.TrackingFinalizer).Build()
			asTally, err := env.AsTally()
			require.NoError(t, err)
			require.NoError(t, asTally.Create(ctx, pod), "only tally creates a pod with the finalizer")
			pod.Status = corev1.PodStatus{Phase: corev1.PodSucceeded, ContainerStatuses: []corev1.ContainerStatus{{
				Name: "worker", Image: pod.Spec.Containers[0].Image,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					FinishedAt: metav1.NewTime(time.Now().Add(-10 * time.Minute)), StartedAt: metav1.NewTime(time.Now().Add(-time.Hour)),
				}},
			}}}
			require.NoError(t, env.Client.Status().Update(ctx, pod))
			return func() {
				require.NoError(t, env.Client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`))))
				require.NoError(t, env.Client.Delete(ctx, pod))
			}
		}},
		{"aggregator stopped", "aggregator lease", func(t *testing.T) func() {
			require.NoError(t, in.aggregator.Stop())
			return nil // the last case: the aggregator stays stopped for the stale explain below
		}},
	}
	for _, b := range breaks {
		t.Run("doctor: "+b.name, func(t *testing.T) {
			repair := b.breakIt(t)
			var out string
			require.Eventually(t, func() bool {
				var code int
				code, out = in.run("--tally-namespace", ns, "doctor")
				return code == app.ExitProblem && strings.Contains(out, "FAIL  "+b.check+": ")
			}, 45*time.Second, 500*time.Millisecond, "doctor did not find %q:\n%s", b.check, out)
			t.Logf("kubectl tally doctor:\n%s", out)
			assert.Equal(t, 1, strings.Count(out, "FAIL  "), "only %q should fail", b.check)
			assert.Contains(t, out, "      fix: ")
			if repair != nil {
				repair()
				require.Eventually(t, func() bool {
					code, o := in.run("--tally-namespace", ns, "doctor")
					out = o
					return code == app.ExitOK
				}, 30*time.Second, 500*time.Millisecond, "doctor did not recover after the repair:\n%s", out)
			}
		})
	}

	t.Run("explain: status stale, the aggregator stopped", func(t *testing.T) {
		var pod corev1.Pod
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: pool, Name: "equal-active"}, &pod))
		patch := client.MergeFrom(pod.DeepCopy())
		pod.Status.Phase = corev1.PodFailed
		require.NoError(t, env.Client.Status().Patch(ctx, &pod, patch))
		code, out := in.run("-n", pool, "--tally-namespace", ns, "explain", "wp/equal")
		assert.Equal(t, app.ExitProblem, code)
		golden(t, "explain-stale", out)
	})

	t.Run("explain: bad input", func(t *testing.T) {
		for args, want := range map[string]string{
			"explain pods/x":                   "Pod is not a kind tally tracks",
			"explain workerpool/missing":       `"missing" not found`,
			"explain nosuchkind/x":             `the server doesn't have a resource type "nosuchkind"`,
			"explain workerpool/equal -o wide": `--output "wide": use table, json or yaml`,
		} {
			code, out := in.run(append([]string{"-n", pool, "--tally-namespace", ns}, strings.Fields(args)...)...)
			assert.Equal(t, app.ExitError, code, args)
			assert.Contains(t, out, want, args)
		}
		code, out := in.run("-n", pool, "--tally-namespace", "nowhere", "explain", "workerpool/equal")
		assert.Equal(t, app.ExitError, code)
		assert.Contains(t, out, "ConfigMap nowhere/tally-config not found: is tally installed?")
	})
}

// TestFinalizersRemove: `finalizers remove` lists (--dry-run) and then
// removes the tracking finalizer from every pod of a namespace, leaving
// other finalizers and other namespaces alone.
func TestFinalizersRemove(t *testing.T) {
	ctx := context.Background()
	in := &install{kubeconfig: adminKubeconfig(t)}
	asTally, err := env.AsTally()
	require.NoError(t, err)
	var namespaces []string
	for range 2 {
		ns, err := env.Namespace(ctx, "released")
		require.NoError(t, err)
		namespaces = append(namespaces, ns)
		for i, finalizers := range [][]string{{keys.TrackingFinalizer}, {"example.com/keep", keys.TrackingFinalizer}, {"example.com/keep"}, nil} {
			pod := builder.Pod(ns, fmt.Sprintf("p%d", i)).Build()
			pod.Finalizers = finalizers
			require.NoError(t, asTally.Create(ctx, pod))
		}
	}
	finalizersOf := func(ns string) map[string][]string {
		var pods corev1.PodList
		require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(ns)))
		out := map[string][]string{}
		for _, p := range pods.Items {
			out[p.Name] = p.Finalizers
		}
		return out
	}
	before := finalizersOf(namespaces[0])

	code, out := in.run("-n", namespaces[0], "finalizers", "remove", "--dry-run")
	require.Equal(t, app.ExitOK, code, out)
	assert.Contains(t, out, "pod/p0 -n "+namespaces[0]+" carries tally.dev/tracking")
	assert.Contains(t, out, "2 pod(s) carry tally.dev/tracking (dry run: nothing changed)")
	assert.Equal(t, before, finalizersOf(namespaces[0]))

	code, out = in.run("-n", namespaces[0], "finalizers", "remove")
	require.Equal(t, app.ExitOK, code, out)
	assert.Contains(t, out, "2 pod(s) released")
	assert.Equal(t, map[string][]string{"p0": nil, "p1": {"example.com/keep"}, "p2": {"example.com/keep"}, "p3": nil}, finalizersOf(namespaces[0]))
	assert.Len(t, finalizersOf(namespaces[1])["p0"], 1, "another namespace is left alone")

	code, out = in.run("finalizers", "remove", "--all-namespaces")
	require.Equal(t, app.ExitOK, code, out)
	assert.Equal(t, []string{"example.com/keep"}, finalizersOf(namespaces[1])["p1"])
	assert.Empty(t, finalizersOf(namespaces[1])["p0"])
	for _, ns := range namespaces {
		for _, name := range []string{"p1", "p2"} {
			pod := builder.Pod(ns, name).Build()
			require.NoError(t, env.Client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`))))
		}
	}
}

func adminKubeconfig(t *testing.T) string {
	t.Helper()
	admin, err := env.AddUser(envtest.User{Name: "finalizers-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "admin.kubeconfig")
	require.NoError(t, controlplane.WriteKubeconfig(admin, path))
	return path
}

// TestFinalizersRemoveKilledAndRunAgain: `finalizers remove`, as the
// uninstall hook runs it (parallel patches at a set rate), killed part-way:
// a second run releases every pod the first left, and only those.
func TestFinalizersRemoveKilledAndRunAgain(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "killed")
	require.NoError(t, err)
	asTally, err := env.AsTally()
	require.NoError(t, err)
	const n = 300
	for i := range n {
		require.NoError(t, asTally.Create(ctx, builder.Pod(ns, fmt.Sprintf("p%03d", i)).Finalizer(keys.TrackingFinalizer).Build()))
	}
	carrying := func() int {
		var pods corev1.PodList
		require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(ns)))
		c := 0
		for _, p := range pods.Items {
			if slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
				c++
			}
		}
		return c
	}
	kubeconfig := adminKubeconfig(t)
	plugin := filepath.Join(t.TempDir(), "kubectl-tally")
	build := exec.Command("go", "build", "-o", plugin, "./cmd/kubectl-tally")
	build.Dir = repo.Root()
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building kubectl-tally: %s", out)

	first := exec.Command(plugin, "--kubeconfig", kubeconfig, "-n", ns, "finalizers", "remove", "--qps", "50", "--parallel", "4")
	stdout, err := first.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, first.Start())
	lines := bufio.NewScanner(stdout)
	released := 0
	for released < n/3 && lines.Scan() {
		if strings.HasSuffix(lines.Text(), keys.TrackingFinalizer+" removed") {
			released++
		}
	}
	require.NoError(t, first.Process.Kill())
	_ = first.Wait()
	// A patch the killed run had sent may still land: count once two
	// readings a second apart agree.
	left := carrying()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		time.Sleep(time.Second)
		now := carrying()
		if now == left {
			break
		}
		left = now
	}
	require.Greater(t, left, 0, "the first run finished before it was killed")
	require.Less(t, left, n)

	in := &install{kubeconfig: kubeconfig}
	code, output := in.run("-n", ns, "finalizers", "remove", "--qps", "50", "--parallel", "4")
	require.Equal(t, app.ExitOK, code, output)
	assert.Contains(t, output, fmt.Sprintf("%d pod(s) released", left), "the second run releases what the first left, and only that")
	assert.Zero(t, carrying())
}
