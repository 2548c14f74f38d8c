package install

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// TestNamespacedUninstallHook installs the chart with a fixed list of
// namespaces (values `namespaces`) and runs its pre-delete hook's command
// as the hook's ServiceAccount, with the RBAC the chart renders for it: it
// releases the tracking finalizer in the namespaces listed, with no
// permission on pods elsewhere, and leaves the pods of other namespaces
// alone.
func TestNamespacedUninstallHook(t *testing.T) {
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
	// Created before the release: no webhook of it is registered yet.
	asTally, err := env.AsTally()
	require.NoError(t, err)
	for _, n := range append(slices.Clone(listed), other) {
		require.NoError(t, asTally.Create(ctx, heldPod(n, "held")))
	}
	t.Cleanup(func() {
		pod := &corev1.Pod{}
		if env.Client.Get(context.Background(), client.ObjectKey{Namespace: other, Name: "held"}, pod) == nil {
			_ = env.Client.Patch(context.Background(), pod, client.RawPatch(types.JSONPatchType, []byte(`[{"op":"remove","path":"/metadata/finalizers"}]`)))
		}
	})

	admin, err := env.AddUser(envtest.User{Name: "nsmode-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, adminConfig, 0o600))
	valuesFile, err := helm.WriteValues(dir, []config.Parent{helm.WorkerPool(config.Completing, config.UnexpectedTotal)}, helm.LocalCertificates,
		map[string]any{"namespaces": listed})
	require.NoError(t, err)
	_, err = helm.Run("install", nsRelease, helm.Chart(), "--namespace", nsNamespace, "--create-namespace", "-f", valuesFile, "--no-hooks", "--kubeconfig", kubeconfig)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = helm.Run("uninstall", nsRelease, "--namespace", nsNamespace, "--no-hooks", "--kubeconfig", kubeconfig)
	})

	// The hook, as helm uninstall would run it.
	manifest, err := helm.Run("template", nsRelease, helm.Chart(), "--namespace", nsNamespace, "-f", valuesFile,
		"--set", "uninstallHook.settleSeconds=1", "--show-only", "templates/uninstall-hook.yaml")
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
	args := job.Spec.Template.Spec.Containers[0].Args
	assert.Contains(t, args, "--namespaces="+strings.Join(listed, ","))
	hookConfig := filepath.Join(dir, "uninstall.kubeconfig")
	require.NoError(t, framework.KubeconfigAs(adminConfig, nsNamespace, job.Spec.Template.Spec.ServiceAccountName, hookConfig))
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "kubectl-tally"), append([]string{"--kubeconfig", hookConfig}, args...)...)
	cmd.Env = append(os.Environ(), "HOME="+dir)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the hook:\n%s", out)
	assert.NotContains(t, string(out), "forbidden")

	for _, n := range append(slices.Clone(listed), other) {
		var pod metav1.PartialObjectMetadata
		pod.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Pod"))
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: n, Name: "held"}, &pod))
		assert.Equal(t, n == other, slices.Contains(pod.Finalizers, keys.TrackingFinalizer), "the pod of namespace %s carries the finalizer", n)
	}
}
