package cluster

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
)

// badCustomCount is a configuration error only the aggregator's counting
// reads: restartCount is a field of a container's status, not the pod's.
var badCustomCount = config.CustomCount{Name: "restarted", Path: "status.restarted", Expression: `pod.status.restartCount > 0`}

// customCountTypo gives the installation, whose values are at values in
// valuesDir, one valid custom count and one whose expression does not
// compile. helm upgrade refuses it with the binary's message and changes
// nothing. Then the ConfigMap is edited into that state by hand and both
// Deployments restarted on it while pods are created, marked and deleted
// through the webhook: no admission fails, every pool settles (the marked
// pods finished and deleted, which the totals' finalizer waits on), the
// valid count is written, the other is not and is reported by a Warning
// Event. Last, the installation is put back as it was.
func customCountTypo(ctx context.Context, t *testing.T, c client.Client, cluster *demo.Cluster, valuesDir string, fig *figures) {
	ready := config.CustomCount{Name: "ready", Path: "status.ready",
		Expression: `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`}
	installed := helm.WorkerPool(append(config.Counts, config.Totals...)...)
	typo := installed
	typo.CustomCounts = []config.CustomCount{ready, badCustomCount}
	debug := map[string]any{"logLevel": "debug"}

	cm := &corev1.ConfigMap{}
	cmKey := client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release + "-config"}
	require.NoError(t, c.Get(ctx, cmKey, cm))
	before := cm.Data["config.yaml"]
	generations := deploymentGenerations(ctx, t, c)

	values, err := demo.WriteClusterParents(valuesDir, []config.Parent{typo}, debug)
	require.NoError(t, err)
	start := time.Now()
	_, err = cluster.Helm("upgrade", helm.Release, helm.Chart(), "--namespace", helm.Namespace, "-f", values, "--wait", "--timeout", "3m")
	require.Error(t, err, "helm upgrade took a custom count that does not compile")
	t.Logf("helm upgrade refused it in %v: %v", time.Since(start).Round(100*time.Millisecond), err)
	fig.add("helm upgrade with a custom count that does not compile: refused by the configuration check in %v", time.Since(start).Round(100*time.Millisecond))
	assert.Contains(t, err.Error(), `parents[0].customCounts[1].expression: the expression of WorkerPool.example.tally.dev's count "restarted" does not compile`,
		"helm prints the check's message from its Job's log")
	require.NoError(t, c.Get(ctx, cmKey, cm))
	assert.Equal(t, before, cm.Data["config.yaml"], "the refused upgrade changed the ConfigMap")
	assert.Equal(t, generations, deploymentGenerations(ctx, t, c), "the refused upgrade changed a Deployment")

	// The same configuration edited into the ConfigMap by hand, both
	// Deployments restarted on it, while pods are created, marked and
	// deleted through the webhook.
	manifest, err := cluster.Helm("template", helm.Release, helm.Chart(), "--namespace", helm.Namespace, "-f", values,
		"--show-only", "templates/configmap.yaml")
	require.NoError(t, err)
	objs, err := helm.Objects(manifest)
	require.NoError(t, err)
	require.Len(t, objs, 1)
	edited, _, _ := unstructured.NestedString(objs[0].Object, "data", "config.yaml")
	require.Contains(t, edited, "restartCount")
	load := admissionLoad(ctx, t, c)
	start = time.Now()
	cm.Data["config.yaml"] = edited
	require.NoError(t, c.Update(ctx, cm))
	restart(ctx, t, c)
	took := time.Since(start)
	time.Sleep(5 * time.Second) // pods created and marked by the new replicas too
	creates, failedCreates, marks, failedMarks, firstErr := load()
	fig.add("ConfigMap edited into a custom count that does not compile, both Deployments restarted on it: %v; meanwhile %d of %d pod creates and %d of %d intent marks failed",
		took.Round(100*time.Millisecond), failedCreates, creates, failedMarks, marks)
	assert.Zero(t, failedCreates+failedMarks, "admission failed (first: %s)", firstErr)
	assert.Positive(t, creates)
	assert.Positive(t, marks)

	var last string
	ok := poll(3*time.Minute, func() bool {
		var settled bool
		settled, last = allSettled(ctx, c, []string{"alpha", "beta", "gamma", "burst"})
		return settled
	})
	require.True(t, ok, "on the edited ConfigMap, the pools did not settle with tally's counts equal to a fresh List (burst's pods deleted):%s", last)
	for _, name := range []string{"alpha", "beta"} {
		pool := operator.Pool(ns, name, 0)
		ok := poll(time.Minute, func() bool {
			var pods corev1.PodList
			if c.Get(ctx, client.ObjectKeyFromObject(pool), pool) != nil || c.List(ctx, &pods, client.InNamespace(ns)) != nil {
				return false
			}
			shown, found, _ := unstructured.NestedInt64(pool.Object, "status", "ready")
			last = fmt.Sprintf("status.ready %d (written: %t), %d pods ready", shown, found, readyPods(pods.Items, pool.GetUID()))
			return found && shown == readyPods(pods.Items, pool.GetUID())
		})
		assert.True(t, ok, "%s: the valid custom count is not right: %s", name, last)
		_, found, _ := unstructured.NestedFieldNoCopy(pool.Object, "status", "restarted")
		assert.False(t, found, "%s: the custom count that does not compile was written", name)
	}
	var events corev1.EventList
	require.NoError(t, c.List(ctx, &events, client.InNamespace(ns)))
	warned := false
	for _, e := range events.Items {
		warned = warned || (e.Reason == "CustomCountInvalid" && e.Type == corev1.EventTypeWarning && strings.Contains(e.Message, `"restarted"`))
	}
	assert.True(t, warned, "no Warning Event CustomCountInvalid on a pool")

	// Back as installed: the ConfigMap from the release, the pods on it.
	values, err = demo.WriteClusterValues(valuesDir, nil, debug)
	require.NoError(t, err)
	_, err = cluster.Helm("upgrade", helm.Release, helm.Chart(), "--namespace", helm.Namespace, "-f", values, "--wait", "--timeout", "3m")
	require.NoError(t, err)
	require.NoError(t, c.Get(ctx, cmKey, cm))
	require.Equal(t, before, cm.Data["config.yaml"], "helm upgrade did not put the ConfigMap back")
	restart(ctx, t, c)
	ok = poll(3*time.Minute, func() bool {
		var settled bool
		settled, last = allSettled(ctx, c, []string{"alpha", "beta", "gamma", "burst"})
		return settled
	})
	require.True(t, ok, "back as installed, the pools did not settle:%s", last)
}

// deploymentGenerations returns the generation of tally's two Deployments.
func deploymentGenerations(ctx context.Context, t *testing.T, c client.Client) map[string]int64 {
	out := map[string]int64{}
	for _, d := range []string{"webhook", "aggregator"} {
		var dep appsv1.Deployment
		require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release + "-" + d}, &dep))
		out[d] = dep.Generation
	}
	return out
}

// restart rolls tally's two Deployments, as kubectl rollout restart does,
// and waits until both are ready and an aggregator of the new ones holds
// the lease.
func restart(ctx context.Context, t *testing.T, c client.Client) {
	at := time.Now().Format(time.RFC3339Nano)
	for _, d := range []string{"webhook", "aggregator"} {
		dep := &appsv1.Deployment{}
		dep.Namespace, dep.Name = helm.Namespace, helm.Release+"-"+d
		patch := `{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":"` + at + `"}}}}}`
		require.NoError(t, c.Patch(ctx, dep, client.RawPatch(types.StrategicMergePatchType, []byte(patch))))
	}
	for _, d := range []string{"webhook", "aggregator"} {
		waitReady(ctx, t, c, helm.Release+"-"+d)
	}
	var holder string
	ok := poll(time.Minute, func() bool {
		var lease coordinationv1.Lease
		if c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release + "-aggregator"}, &lease) != nil {
			return false
		}
		holder, _, _ = strings.Cut(ptr.Deref(lease.Spec.HolderIdentity, ""), "_")
		var pod corev1.Pod
		return holder != "" && c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: holder}, &pod) == nil &&
			pod.DeletionTimestamp == nil && pod.Annotations["kubectl.kubernetes.io/restartedAt"] == at
	})
	require.True(t, ok, "no restarted aggregator holds the lease (holder: %q)", holder)
}

// readyPods counts the pods of the pool with UID uid whose Ready condition
// is True: the valid custom count's truth.
func readyPods(pods []corev1.Pod, uid types.UID) int64 {
	var n int64
	for _, p := range pods {
		if len(p.OwnerReferences) == 0 || p.OwnerReferences[0].UID != uid {
			continue
		}
		if podReady(&p) {
			n++
		}
	}
	return n
}
