package install

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

// TestNamespacedInstall installs the chart with a fixed list of namespaces
// (values `namespaces`, with verifyOwner and a total) and runs both binaries
// as the chart's ServiceAccounts, with only the RBAC the chart renders: no
// ClusterRole on pods or parents. The webhook stamps (owner verified) and
// tracks the pods of the namespaces listed, the aggregator counts them, and
// neither is refused anything. Then the pre-delete hook's command, as the
// hook's ServiceAccount, releases the tracking finalizer in those
// namespaces and leaves the pods of others alone.
func TestNamespacedInstall(t *testing.T) {
	ctx := context.Background()
	const nsRelease, nsNamespace = "nsmode", "nsmode-system"
	dir := t.TempDir()
	var listed []string
	for range 2 {
		n, err := env.Namespace(ctx, "listed")
		require.NoError(t, err)
		listed = append(listed, n)
	}
	other, err := env.Namespace(ctx, "unlisted")
	require.NoError(t, err)

	admin, err := env.AddUser(envtest.User{Name: "nsmode-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, adminConfig, 0o600))
	counts := map[config.Count]string{config.Active: "status.active", config.UnexpectedTotal: "status.unexpectedTotal"}
	parent := helm.WorkerPool(config.Active, config.UnexpectedTotal)
	valuesFile, err := helm.WriteValues(dir, []config.Parent{parent}, helm.LocalCertificates,
		map[string]any{"namespaces": listed, "verifyOwner": true})
	require.NoError(t, err)
	_, err = helm.Run("install", nsRelease, helm.Chart(), "--namespace", nsNamespace, "--create-namespace", "-f", valuesFile, "--no-hooks", "--kubeconfig", kubeconfig)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = helm.Run("uninstall", nsRelease, "--namespace", nsNamespace, "--no-hooks", "--kubeconfig", kubeconfig)
	})

	// Both binaries, as the chart's ServiceAccounts, on the installed
	// config and certificates.
	tally := runInstalled(t, ctx, dir, adminConfig, nsNamespace, nsRelease+"-tally")
	webhook, aggregator := tally.webhook, tally.aggregator

	// A pool and a pod of it in each namespace, the pods created by their
	// operator (here, the admin). Elsewhere the webhook is never called:
	// that pod carries the finalizer as if left by an earlier install.
	uids := map[string]types.UID{}
	for _, n := range append(slices.Clone(listed), other) {
		pool := operator.Pool(n, "pool", 1)
		require.NoError(t, env.Client.Create(ctx, pool))
		uids[n] = pool.GetUID()
		b := builder.Pod(n, "worker").ControlledBy(operator.GVK, "pool", pool.GetUID())
		if n == other {
			b = b.Finalizer(keys.TrackingFinalizer)
		}
		require.NoError(t, env.Client.Create(ctx, b.Build()))
	}
	t.Cleanup(func() {
		pod := &corev1.Pod{}
		if env.Client.Get(context.Background(), client.ObjectKey{Namespace: other, Name: "worker"}, pod) == nil {
			_ = env.Client.Patch(context.Background(), pod, client.RawPatch(types.JSONPatchType, []byte(`[{"op":"remove","path":"/metadata/finalizers"}]`)))
		}
	})
	for _, n := range listed {
		var pod corev1.Pod
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: n, Name: "worker"}, &pod))
		assert.Equal(t, string(uids[n]), pod.Labels[keys.ParentUID], "the webhook stamped the pod of %s, its owner verified", n)
		assert.Contains(t, pod.Finalizers, keys.TrackingFinalizer, "the webhook tracks the pod of %s", n)
		require.Eventually(t, func() bool {
			active, err := env.StatusCount(ctx, operator.GVK, n, "pool", strings.Split(counts[config.Active], ".")...)
			return err == nil && active == 1
		}, 30*time.Second, 100*time.Millisecond, "the aggregator counts the pool of %s", n)
	}
	pool := &unstructured.Unstructured{}
	pool.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: other, Name: "pool"}, pool))
	assert.NotContains(t, pool.Object, "status", "a pool of a namespace not listed")
	var pod corev1.Pod
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: other, Name: "worker"}, &pod))
	assert.NotContains(t, pod.Labels, keys.ParentUID, "a pod of a namespace not listed")
	require.NoError(t, webhook.Stop())
	require.NoError(t, aggregator.Stop())
	for name, p := range map[string]*process.Process{"webhook": webhook, "aggregator": aggregator} {
		log, err := os.ReadFile(p.LogPath())
		require.NoError(t, err)
		assert.NotContains(t, string(log), "forbidden", "the %s was refused something", name)
	}

	// The pre-delete hook, as helm uninstall would run it.
	job, _, hook := uninstallHook(t, ctx, dir, adminConfig, nsRelease, nsNamespace, valuesFile, 1)
	assert.Contains(t, job.Spec.Template.Spec.Containers[0].Args, "--namespaces="+strings.Join(listed, ","))
	out, err := hook(ctx).CombinedOutput()
	require.NoError(t, err, "the hook:\n%s", out)
	assert.NotContains(t, string(out), "forbidden")
	for _, n := range append(slices.Clone(listed), other) {
		var pod metav1.PartialObjectMetadata
		pod.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Pod"))
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: n, Name: "worker"}, &pod))
		assert.Equal(t, n == other, slices.Contains(pod.Finalizers, keys.TrackingFinalizer), "the pod of namespace %s carries the finalizer", n)
	}
}
