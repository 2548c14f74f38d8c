// Package install installs the chart for real (`helm install`, not
// `helm template`) on a local control plane, in certificates.mode=helm, and
// runs the real binaries as the chart's ServiceAccounts, with the installed
// config and certificates and the installed registration: the demo scenario
// passes, so the chart's RBAC is enough, and the service accounts hold
// exactly the documented permissions, no more. Then `helm upgrade` and
// `helm uninstall`.
package install

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/framework"
)

const (
	release = helm.Release
	ns      = helm.Namespace
)

var (
	env *framework.Env
	bin string
)

func TestMain(m *testing.M) {
	os.Exit(framework.MainWithBinaries(m, controlplane.Options{}, &env, &bin, "webhook", "aggregator", "kubectl-tally"))
}

// parents are the example WorkerPool, with a custom count, and a kind held
// back (its CRD is not installed): the aggregator serves the one and reports
// the other.
var parents = []config.Parent{
	withReady(helm.WorkerPool(append(config.Counts, config.Totals...)...)),
	{Group: "held.tally.dev", Version: "v1", Kind: "HeldBackPool", Resource: "heldbackpools"},
}

func withReady(p config.Parent) config.Parent {
	p.CustomCounts = []config.CustomCount{{Name: "ready", Path: "status.ready",
		Expression: `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`}}
	return p
}

func TestInstallUpgradeUninstall(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	admin, err := env.AddUser(envtest.User{Name: "install-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, adminConfig, 0o600))
	valuesFile, err := helm.WriteValues(dir, parents, helm.LocalCertificates)
	require.NoError(t, err)
	helmRun := func(args ...string) string {
		out, err := helm.Run(append(args, "--kubeconfig", kubeconfig)...)
		require.NoError(t, err)
		return out
	}
	// No Job controller runs here: the chart's configuration check hook
	// runs as a process (runConfigCheck), then helm without hooks.
	out, err := runConfigCheck(t, adminConfig, valuesFile)
	require.NoError(t, err, out)
	assert.Contains(t, out, "is valid: parent kinds WorkerPool.example.tally.dev, HeldBackPool.held.tally.dev; the parent kinds the API server serves are namespaced")
	// A cluster-scoped kind, which both binaries refuse at start.
	_, err = helm.WriteValues(dir, []config.Parent{parents[0], {Version: "v1", Kind: "Namespace", Resource: "namespaces"}}, helm.LocalCertificates)
	require.NoError(t, err)
	out, err = runConfigCheck(t, adminConfig, valuesFile)
	require.Error(t, err, out)
	assert.Contains(t, out, "parents[1] (/v1, Kind=Namespace): the kind is cluster-scoped")
	_, err = helm.WriteValues(dir, parents, helm.LocalCertificates)
	require.NoError(t, err)
	helmRun("install", release, helm.Chart(), "--namespace", ns, "--create-namespace", "-f", valuesFile, "--no-hooks")

	tally := runInstalled(t, ctx, dir, adminConfig, ns, release,
		"--leader-elect", "--leader-election-namespace", ns, "--leader-election-id", release+"-aggregator")
	configFile, metricsAddr, webhookMetricsAddr, webhook, aggregator := tally.configFile, tally.aggregatorMetrics, tally.webhookMetrics, tally.webhook, tally.aggregator

	d, err := demo.Start(ctx, demo.Options{
		Dir: filepath.Join(dir, "demo"), ConfigFile: configFile, Duration: 12 * time.Second, Seed: 42, Out: t.Output(),
		Installed: &demo.Installed{Env: env.Env, AggregatorMetrics: metricsAddr},
	})
	require.NoError(t, err)
	require.NoError(t, d.Run(ctx), "the demo scenario with tally running as the chart installed it")
	require.NoError(t, d.Stop())

	assertMonitoringReadsExportedMetrics(t, ctx, scrape(t, webhookMetricsAddr)+scrape(t, metricsAddr))

	assertPermissions(t, ctx)

	// Back to the Service, as installed, before Helm's three-way merge.
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: release}, &mwc))
	mwc.Webhooks[0].ClientConfig = tally.installed
	require.NoError(t, env.Client.Update(ctx, &mwc))

	// helm upgrade: new parents and log level roll the Deployments, keep the
	// certificates, and register the webhook for the new parents.
	var before appsv1.Deployment
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: release + "-aggregator"}, &before))
	upgraded := []config.Parent{parents[0], {Group: "held.tally.dev", Version: "v1", Kind: "BatchPool", Resource: "batchpools"}}
	// A custom count whose expression does not compile: the check the
	// upgrade runs first refuses it, with the binary's message.
	badCount := parents[0]
	badCount.CustomCounts = []config.CustomCount{{Name: "ready", Path: "status.ready", Expression: `pod.status.ready`}}
	_, err = helm.WriteValues(dir, []config.Parent{badCount}, helm.LocalCertificates)
	require.NoError(t, err)
	out, err = runConfigCheck(t, adminConfig, valuesFile)
	require.Error(t, err, out)
	assert.Contains(t, out, `aggregator: config /etc/tally/config.yaml: parents[0].customCounts[0].expression: the expression of WorkerPool.example.tally.dev's count "ready" does not compile`)
	assert.Contains(t, out, "ERROR: parents[0].customCounts[0].expression:1:11: undefined field 'ready'")

	_, err = helm.WriteValues(dir, upgraded, helm.LocalCertificates, map[string]any{"logLevel": "debug"})
	require.NoError(t, err)
	out, err = runConfigCheck(t, adminConfig, valuesFile)
	require.NoError(t, err, out)
	helmRun("upgrade", release, helm.Chart(), "--namespace", ns, "-f", valuesFile, "--no-hooks")
	var after appsv1.Deployment
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: release + "-aggregator"}, &after))
	assert.NotEqual(t, before.Spec.Template.Annotations["checksum/config"], after.Spec.Template.Annotations["checksum/config"], "the config change does not roll the aggregator")
	assert.Contains(t, after.Spec.Template.Spec.Containers[0].Args, "--zap-log-level=debug")
	var kept corev1.Secret
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: release + "-webhook-tls"}, &kept))
	assert.Equal(t, tally.certificates, kept.Data, "the upgrade replaced the certificates")
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: release}, &mwc))
	var cm corev1.ConfigMap
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: release + "-config"}, &cm))
	cfg, err := config.Parse([]byte(cm.Data["config.yaml"]))
	require.NoError(t, err)
	assert.Equal(t, "BatchPool", cfg.Parents[1].Kind)
	assert.Equal(t, mutate.MatchConditions(cfg), mwc.Webhooks[0].MatchConditions[:2])

	// helm uninstall runs the pre-delete hook, which no Job controller runs
	// here: run its command as a process, as its service account, then
	// uninstall without hooks. The Deployment it scales to zero runs no pod
	// here: stop the processes as the scale-down would.
	require.NoError(t, webhook.Stop())
	require.NoError(t, aggregator.Stop())
	runUninstallHook(t, ctx, dir, adminConfig, valuesFile)
	helmRun("uninstall", release, "--namespace", ns, "--wait", "--no-hooks")
	for _, gvk := range framework.ChartKinds {
		list := &unstructured.UnstructuredList{}
		list.SetGroupVersionKind(gvk)
		require.NoError(t, env.Client.List(ctx, list, client.MatchingLabels{"app.kubernetes.io/instance": release}))
		assert.Empty(t, list.Items, "%s left after helm uninstall", gvk.Kind)
	}
}

// installed is tally as the chart installed it, its binaries running here.
type installed struct {
	configFile                        string
	certificates                      map[string][]byte
	webhook, aggregator               *process.Process
	webhookMetrics, aggregatorMetrics string
	// installed is the registration's clientConfig as installed, before
	// it was pointed at the local webhook.
	installed admissionregistrationv1.WebhookClientConfig
}

// runInstalled runs both binaries, as the chart's ServiceAccounts of the
// release whose objects are named fullname in namespace, on its installed
// config and certificates (the aggregator with more arguments), and points
// its webhook registration at the local webhook: only its clientConfig
// changes.
func runInstalled(t *testing.T, ctx context.Context, dir string, adminConfig []byte, namespace, fullname string, aggregatorArgs ...string) installed {
	t.Helper()
	in := installed{configFile: filepath.Join(dir, "config.yaml")}
	var cm corev1.ConfigMap
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: fullname + "-config"}, &cm))
	require.NoError(t, os.WriteFile(in.configFile, []byte(cm.Data["config.yaml"]), 0o600))
	var secret corev1.Secret
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: fullname + "-webhook-tls"}, &secret))
	in.certificates = secret.Data
	certDir := filepath.Join(dir, "tls")
	require.NoError(t, os.MkdirAll(certDir, 0o700))
	for _, f := range []string{"tls.crt", "tls.key"} {
		require.NoError(t, os.WriteFile(filepath.Join(certDir, f), secret.Data[f], 0o600))
	}
	for _, sa := range []string{"webhook", "aggregator"} {
		require.NoError(t, framework.KubeconfigAs(adminConfig, namespace, fullname+"-"+sa, filepath.Join(dir, sa+".kubeconfig")))
	}
	addr := func() string {
		port, err := process.FreePort()
		require.NoError(t, err)
		return fmt.Sprintf("127.0.0.1:%d", port)
	}
	serving := addr()
	in.webhookMetrics, in.aggregatorMetrics = addr(), addr()
	host, port, _ := strings.Cut(serving, ":")
	in.webhook, _ = framework.StartProcess(t, bin, "webhook", "--config", in.configFile, "--kubeconfig", filepath.Join(dir, "webhook.kubeconfig"), "--cert-dir", certDir,
		"--host", host, "--port", port, "--metrics-bind-address", in.webhookMetrics, "--shutdown-delay", "0s")
	in.aggregator, _ = framework.StartProcess(t, bin, "aggregator", append([]string{"--config", in.configFile, "--kubeconfig", filepath.Join(dir, "aggregator.kubeconfig"),
		"--metrics-bind-address", in.aggregatorMetrics}, aggregatorArgs...)...)

	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: fullname}, &mwc))
	in.installed = *mwc.Webhooks[0].ClientConfig.DeepCopy()
	mwc.Webhooks[0].ClientConfig.Service = nil
	mwc.Webhooks[0].ClientConfig.URL = ptr.To("https://" + serving + mutate.Path)
	require.NoError(t, env.Client.Update(ctx, &mwc))
	time.Sleep(2 * time.Second) // the API server picks the registration up asynchronously
	return in
}

// runConfigCheck runs the command of the chart's configuration check hook
// (its pre-install, pre-upgrade and pre-rollback Job) on the values in
// valuesFile, as a process, as the hook's ServiceAccount (which no RBAC
// binding names: created only for the API server to know it), with the
// ConfigMap the hook mounts at the path it mounts it (a file here); it
// returns the command's output, and an error when it fails (helm then
// stops, and prints that output).
func runConfigCheck(t *testing.T, adminConfig []byte, valuesFile string) (string, error) {
	t.Helper()
	manifest, err := helm.Run("template", release, helm.Chart(), "--namespace", ns, "-f", valuesFile,
		"--show-only", "templates/check-config-hook.yaml")
	require.NoError(t, err)
	objs, err := helm.Objects(manifest)
	require.NoError(t, err)
	var job batchv1.Job
	var cm corev1.ConfigMap
	var sa string
	for _, obj := range objs {
		switch obj.GetKind() {
		case "Job":
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &job))
		case "ConfigMap":
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &cm))
		case "ServiceAccount":
			sa = obj.GetName()
		}
	}
	require.Equal(t, sa, job.Spec.Template.Spec.ServiceAccountName, "the Job runs as the hook's ServiceAccount")
	require.Len(t, job.Spec.Template.Spec.Containers, 1, "the hook's Job")
	container := job.Spec.Template.Spec.Containers[0]
	require.Len(t, container.Command, 1)
	require.Len(t, container.VolumeMounts, 1)
	require.Equal(t, cm.Name, job.Spec.Template.Spec.Volumes[0].ConfigMap.Name, "the Job mounts the hook's ConfigMap")
	// The ConfigMap's files where the Job's container reads them, and the
	// ServiceAccount's identity as its in-cluster token would give it.
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(cm.Data["config.yaml"]), 0o600))
	kubeconfig := filepath.Join(dir, "hook.kubeconfig")
	require.NoError(t, framework.KubeconfigAs(adminConfig, ns, sa, kubeconfig))
	args := []string{"--kubeconfig", kubeconfig}
	for _, a := range container.Args {
		args = append(args, strings.ReplaceAll(a, container.VolumeMounts[0].MountPath, dir))
	}
	out, err := exec.Command(filepath.Join(bin, filepath.Base(container.Command[0])), args...).CombinedOutput()
	return strings.ReplaceAll(string(out), dir, container.VolumeMounts[0].MountPath), err
}

// trackedPods is how many pods carry the tracking finalizer when the
// uninstall hook runs: the count its deadline is sized for
// (docs/operating.md, "Uninstalling"); under -short (make test), a tenth.
func trackedPods() int {
	if testing.Short() {
		return 1_000
	}
	return 10_000
}

// runUninstallHook creates the chart's pre-delete hook's service account and
// RBAC and runs its Job's command as a process with that identity while
// trackedPods() pods carry the tracking finalizer. The first run is stopped
// half-way by SIGTERM, as the Job's deadline stops it: it puts tally back as
// it found it. The second is killed half-way by SIGKILL, which nothing can
// undo: tally is left stopped. The third, bounded by the Job's
// activeDeadlineSeconds, releases what is left and leaves tally stopped.
// Then it deletes what it created.
func runUninstallHook(t *testing.T, ctx context.Context, dir string, adminConfig []byte, valuesFile string) {
	t.Helper()
	// No other webhook here: the pods' CREATEs end within the webhook's
	// own timeout.
	job, objs, hook := uninstallHook(t, ctx, dir, adminConfig, release, ns, valuesFile, 10)
	args := job.Spec.Template.Spec.Containers[0].Args
	deadline := time.Duration(*job.Spec.ActiveDeadlineSeconds) * time.Second

	held := env.WebhookNamespace(t, "uninstall")
	many, err := env.Namespace(ctx, "uninstall-many")
	require.NoError(t, err)
	created := time.Now()
	asTally, err := env.AsTally()
	require.NoError(t, err)
	var creates errgroup.Group
	creates.SetLimit(32)
	for i := range trackedPods() {
		namespace, name := many, fmt.Sprintf("p%05d", i)
		if i < 3 {
			namespace, name = held, fmt.Sprintf("held-%d", i)
		}
		creates.Go(func() error { return asTally.Create(ctx, heldPod(namespace, name)) })
	}
	require.NoError(t, creates.Wait())
	t.Logf("%d pods carrying %s created in %s", trackedPods(), keys.TrackingFinalizer, time.Since(created).Round(time.Second))
	t.Cleanup(func() {
		_ = env.Client.DeleteAllOf(context.Background(), &corev1.Pod{}, client.InNamespace(many))
	})
	carrying := func() int {
		n := 0
		for _, namespace := range []string{held, many} {
			var list metav1.PartialObjectMetadataList
			list.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("PodList"))
			require.NoError(t, env.Client.List(ctx, &list, client.InNamespace(namespace)))
			for _, p := range list.Items {
				if slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
					n++
				}
			}
		}
		return n
	}
	var dep appsv1.Deployment
	aggregatorKey := client.ObjectKey{Namespace: ns, Name: release + "-aggregator"}
	require.NoError(t, env.Client.Get(ctx, aggregatorKey, &dep))
	replicas := *dep.Spec.Replicas
	require.Positive(t, replicas)
	// stopped reports whether the registration is paused and the
	// aggregator at zero replicas, failing on any mix of the two.
	stopped := func() bool {
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: release}, &mwc))
		conds := mwc.Webhooks[0].MatchConditions
		i := slices.IndexFunc(conds, func(c admissionregistrationv1.MatchCondition) bool { return c.Name == app.PauseCondition })
		require.NoError(t, env.Client.Get(ctx, aggregatorKey, &dep))
		if i < 0 {
			require.Equal(t, replicas, *dep.Spec.Replicas, "the registration runs but the aggregator does not")
			return false
		}
		assert.Equal(t, "false", conds[i].Expression)
		require.Zero(t, *dep.Spec.Replicas, "the registration is paused but the aggregator runs")
		return true
	}
	require.False(t, stopped())

	// Stopped half-way, gracefully and then not.
	for _, sig := range []os.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		before := carrying()
		started := time.Now()
		out := stopHalfWay(t, hook(ctx), before/2, sig)
		t.Logf("the uninstall hook, stopped by %v after releasing %d pods, exited after %s:\n%s",
			sig, before/2, time.Since(started).Round(100*time.Millisecond), tail(out, 4))
		left := carrying()
		require.Greater(t, left, 0, "the hook finished before it was stopped")
		require.Less(t, left, before, "the hook released nothing before it was stopped")
		if sig == syscall.SIGTERM {
			assert.False(t, stopped(), "a hook stopped by SIGTERM puts tally back as it was")
			assert.Contains(t, out, "resumed")
			assert.Contains(t, out, fmt.Sprintf("scaled back to %d", replicas))
		} else {
			assert.True(t, stopped(), "a hook killed by SIGKILL leaves tally stopped, for the next run to finish")
		}
	}

	// The next run, as helm uninstall runs it again, within the Job's
	// deadline.
	left := carrying()
	runCtx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	started := time.Now()
	out, err := hook(runCtx).CombinedOutput()
	took := time.Since(started)
	t.Logf("the uninstall hook (kubectl-tally %s) released %d pods in %s (deadline %s):\n%s",
		strings.Join(args, " "), left, took.Round(100*time.Millisecond), deadline, tail(string(out), 5))
	require.NoError(t, err)
	assert.Contains(t, string(out), fmt.Sprintf("%d pod(s) released", left), "the run releases what the others left, and only that")
	assert.Zero(t, carrying())
	assert.True(t, stopped(), "tally is stopped at the end")

	for _, obj := range objs {
		if obj.GetKind() != "Job" {
			require.NoError(t, env.Client.Delete(ctx, obj))
		}
	}
}

// uninstallHook creates the objects of the chart's pre-delete hook as
// valuesFile (and settle seconds) renders them for release in namespace,
// deleted when the test ends, and returns its Job, those objects, and a
// func that builds the Job's command, run as the hook's ServiceAccount.
func uninstallHook(t *testing.T, ctx context.Context, dir string, adminConfig []byte, release, namespace, valuesFile string, settle int) (batchv1.Job, []*unstructured.Unstructured, func(context.Context) *exec.Cmd) {
	t.Helper()
	manifest, err := helm.Run("template", release, helm.Chart(), "--namespace", namespace, "-f", valuesFile,
		"--set", fmt.Sprintf("uninstallHook.settleSeconds=%d", settle), "--show-only", "templates/uninstall-hook.yaml")
	require.NoError(t, err)
	objs, err := helm.Objects(manifest)
	require.NoError(t, err)
	var job batchv1.Job
	for _, obj := range objs {
		if obj.GetKind() == "Job" {
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &job))
			continue
		}
		require.NoError(t, env.Client.Create(ctx, obj), "%s %s/%s", obj.GetKind(), obj.GetNamespace(), obj.GetName())
		t.Cleanup(func() { _ = env.Client.Delete(context.Background(), obj) })
	}
	require.NotEmpty(t, job.Spec.Template.Spec.Containers, "the hook's Job")
	kubeconfig := filepath.Join(dir, "uninstall.kubeconfig")
	require.NoError(t, framework.KubeconfigAs(adminConfig, namespace, job.Spec.Template.Spec.ServiceAccountName, kubeconfig))
	return job, objs, func(ctx context.Context) *exec.Cmd {
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "kubectl-tally"), append([]string{"--kubeconfig", kubeconfig}, job.Spec.Template.Spec.Containers[0].Args...)...)
		cmd.Env = append(os.Environ(), "HOME="+dir)
		return cmd
	}
}

// heldPod is a pod carrying the tracking finalizer, to be created as tally
// (framework.Env.AsTally): the webhook removes it from any other client's.
func heldPod(namespace, name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Finalizers: []string{keys.TrackingFinalizer}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "worker:1"}}},
	}
}

// stopHalfWay starts cmd, sends it sig once it has released n pods, and
// returns everything it printed.
func stopHalfWay(t *testing.T, cmd *exec.Cmd, n int, sig os.Signal) string {
	t.Helper()
	var out, stderr strings.Builder
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(stdout)
	released := 0
	for lines.Scan() {
		out.WriteString(lines.Text() + "\n")
		if strings.HasSuffix(lines.Text(), keys.TrackingFinalizer+" removed") {
			if released++; released == n {
				require.NoError(t, cmd.Process.Signal(sig))
			}
		}
	}
	err = cmd.Wait()
	out.WriteString(stderr.String())
	require.Error(t, err, "the hook exits with an error when stopped:\n%s", tail(out.String(), 8))
	return out.String()
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// permission is one verb on one resource (or non-resource URL), in a
// namespace ("" for cluster-wide).
type permission struct{ namespace, group, resource, name, verb string }

// assertPermissions checks that the chart's service accounts hold exactly
// the permissions docs/operating.md documents, through every binding that
// names them.
func assertPermissions(t *testing.T, ctx context.Context) {
	t.Helper()
	held := map[string][]permission{}
	add := func(sa, namespace string, rules []rbacv1.PolicyRule) {
		for _, r := range rules {
			for _, v := range r.Verbs {
				for _, g := range r.APIGroups {
					for _, res := range r.Resources {
						names := r.ResourceNames
						if len(names) == 0 {
							names = []string{""}
						}
						for _, n := range names {
							held[sa] = append(held[sa], permission{namespace, g, res, n, v})
						}
					}
				}
				for _, u := range r.NonResourceURLs {
					held[sa] = append(held[sa], permission{namespace, "", u, "", v})
				}
			}
		}
	}
	subjectOf := func(subjects []rbacv1.Subject) []string {
		var out []string
		for _, s := range subjects {
			if s.Kind == "ServiceAccount" && s.Namespace == ns {
				out = append(out, s.Name)
			}
		}
		return out
	}
	var crbs rbacv1.ClusterRoleBindingList
	require.NoError(t, env.Client.List(ctx, &crbs))
	for _, b := range crbs.Items {
		for _, sa := range subjectOf(b.Subjects) {
			var role rbacv1.ClusterRole
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: b.RoleRef.Name}, &role))
			add(sa, "", role.Rules)
		}
	}
	var rbs rbacv1.RoleBindingList
	require.NoError(t, env.Client.List(ctx, &rbs, client.InNamespace(ns)))
	for _, b := range rbs.Items {
		for _, sa := range subjectOf(b.Subjects) {
			var role rbacv1.Role
			require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: b.RoleRef.Name}, &role))
			add(sa, ns, role.Rules)
		}
	}
	metricsAuth := []permission{
		{"", "authentication.k8s.io", "tokenreviews", "", "create"},
		{"", "authorization.k8s.io", "subjectaccessreviews", "", "create"},
	}
	want := map[string][]permission{
		release + "-aggregator": append([]permission{
			{"", "", "pods", "", "get"}, {"", "", "pods", "", "list"}, {"", "", "pods", "", "watch"}, {"", "", "pods", "", "patch"},
			{"", "", "namespaces", "", "list"}, {"", "", "namespaces", "", "watch"},
			{"", "example.tally.dev", "workerpools", "", "get"}, {"", "example.tally.dev", "workerpools", "", "list"}, {"", "example.tally.dev", "workerpools", "", "watch"},
			{"", "example.tally.dev", "workerpools/status", "", "patch"},
			{"", "held.tally.dev", "heldbackpools", "", "get"}, {"", "held.tally.dev", "heldbackpools", "", "list"}, {"", "held.tally.dev", "heldbackpools", "", "watch"},
			{"", "held.tally.dev", "heldbackpools/status", "", "patch"},
			{"", "events.k8s.io", "events", "", "create"}, {"", "events.k8s.io", "events", "", "patch"},
			{"", "", "events", "", "create"}, {"", "", "events", "", "patch"},
			{ns, "coordination.k8s.io", "leases", "", "create"},
			{ns, "coordination.k8s.io", "leases", release + "-aggregator", "get"},
			{ns, "coordination.k8s.io", "leases", release + "-aggregator", "update"},
			{ns, "coordination.k8s.io", "leases", release + "-aggregator", "patch"},
		}, metricsAuth...),
		release + "-webhook": metricsAuth,
	}
	for sa, perms := range want {
		got := held[sa]
		sortPermissions(got)
		sortPermissions(perms)
		assert.Equal(t, perms, got, "permissions of %s", sa)
	}
	assert.Len(t, held, len(want), "service accounts with permissions: %v", held)
}

func sortPermissions(p []permission) {
	slices.SortFunc(p, func(a, b permission) int {
		return strings.Compare(fmt.Sprint(a), fmt.Sprint(b))
	})
}
