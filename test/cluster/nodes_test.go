package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// The cluster make e2e-cluster starts has two nodes: the first runs the
// control plane and is never lost.
const (
	firstNode  = "tally-node"
	secondNode = "tally-node-2"
)

// Bounds the two-node scenarios hold, stated in docs/operating.md.
const (
	// lostNodeBound is how long after a node is lost every pod it ran may
	// still be in the API: the node controller's grace (50 s), the pods'
	// tolerations (the test sets 5 s), the test deleting the Node, PodGC's
	// quarantine of orphaned pods (40 s) and its period (20 s), with room.
	lostNodeBound = 4 * time.Minute
	// drainBound is how long kubectl drain may take (its --timeout).
	drainBound = 5 * time.Minute
)

// requireTwoNodes skips the two-node scenarios on a one-node cluster (make
// cluster-up without NODES=2); make e2e-cluster always starts two.
func requireTwoNodes(ctx context.Context, t *testing.T, c client.Client) {
	t.Helper()
	var nodes corev1.NodeList
	require.NoError(t, c.List(ctx, &nodes))
	var names []string
	for _, n := range nodes.Items {
		names = append(names, n.Name)
	}
	if !slices.Contains(names, secondNode) {
		if os.Getenv("CI") != "" {
			t.Fatalf("the cluster has nodes %v, not %s: make e2e-cluster starts two", names, secondNode)
		}
		t.Skipf("the cluster has nodes %v, not %s: run make e2e-cluster, or make cluster-up NODES=2", names, secondNode)
	}
}

// spread makes sure each of tally's Deployments has a ready pod on both
// nodes, as the chart's spread constraint places them. The constraint is
// ScheduleAnyway, and the scenarios before this one deleted, killed and
// rolled tally's pods: when both replicas of a Deployment share a node, one
// is deleted once so that the scheduler places its replacement; the figure
// says whether that was needed.
func spread(ctx context.Context, t *testing.T, c client.Client, fig *figures) {
	t.Helper()
	for _, component := range []string{"webhook", "aggregator"} {
		rescheduled := 0
		var byNode map[string][]corev1.Pod
		ok := poll(3*time.Minute, func() bool {
			byNode = tallyPods(ctx, t, c, component)
			if len(byNode[firstNode])+len(byNode[secondNode]) < 2 {
				return false
			}
			if len(byNode[firstNode]) > 0 && len(byNode[secondNode]) > 0 {
				return true
			}
			if rescheduled < 2 {
				for _, pods := range byNode {
					if len(pods) > 1 && c.Delete(ctx, &pods[0]) == nil {
						rescheduled++
					}
				}
			}
			return false
		})
		require.True(t, ok, "tally's %s pods not on both nodes (%d deleted to reschedule): %v", component, rescheduled, byNode)
		waitReady(ctx, t, c, helm.Release+"-"+component)
		fig.add("tally's %s replicas on both nodes (%d rescheduled by the test)", component, rescheduled)
	}
}

// tallyPods returns the running, not deleted pods of one of tally's
// components by node.
func tallyPods(ctx context.Context, t *testing.T, c client.Client, component string) map[string][]corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	require.NoError(t, c.List(ctx, &pods, client.InNamespace(helm.Namespace), client.MatchingLabels{"app.kubernetes.io/component": component}))
	out := map[string][]corev1.Pod{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			out[p.Spec.NodeName] = append(out[p.Spec.NodeName], p)
		}
	}
	return out
}

// podsOn lists the pods bound to node, of every namespace.
func podsOn(ctx context.Context, c client.Client, node string) ([]corev1.Pod, error) {
	var pods corev1.PodList
	err := c.List(ctx, &pods, client.MatchingFieldsSelector{Selector: fields.OneTermEqualSelector("spec.nodeName", node)})
	return pods.Items, err
}

// poolOn creates a pool of n replicas whose pods all run on node: the other
// node is cordoned until they run.
func poolOn(ctx context.Context, t *testing.T, c client.Client, ns, name string, n int, node string) *unstructured.Unstructured {
	t.Helper()
	other := firstNode
	if node == firstNode {
		other = secondNode
	}
	cordon(ctx, t, c, other, true)
	defer cordon(ctx, t, c, other, false)
	pool := operator.Pool(ns, name, int64(n))
	require.NoError(t, c.Create(ctx, pool))
	var running []corev1.Pod
	ok := poll(2*time.Minute, func() bool {
		running = running[:0]
		var pods corev1.PodList
		if c.List(ctx, &pods, client.InNamespace(ns)) != nil {
			return false
		}
		for _, p := range pods.Items {
			if ref := metav1.GetControllerOf(&p); ref != nil && ref.Name == name && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				running = append(running, p)
			}
		}
		return len(running) >= n
	})
	require.True(t, ok, "pool %s/%s never ran %d pods on %s", ns, name, n, node)
	for _, p := range running {
		require.Equal(t, node, p.Spec.NodeName, "pod %s", p.Name)
	}
	return pool
}

func cordon(ctx context.Context, t *testing.T, c client.Client, node string, unschedulable bool) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%t}}`, unschedulable)
	require.NoError(t, c.Patch(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, client.RawPatch(types.MergePatchType, []byte(patch))))
}

// shortTolerations puts tolerations of d for a not-ready and an
// unreachable node first among the pod's: the taint manager evicts after
// the first toleration that matches, and an update may change only
// tolerationSeconds of those the pod has (the API server's
// DefaultTolerationSeconds gave it 300 s).
func shortTolerations(ctx context.Context, c client.Client, pod *corev1.Pod, d time.Duration) error {
	secs := ptr.To(int64(d.Seconds()))
	tolerations := []corev1.Toleration{
		{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: secs},
		{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: secs},
	}
	// A merge patch replaces the list; nothing but this test changes it.
	patch, err := json.Marshal(map[string]any{"spec": map[string]any{"tolerations": append(tolerations, pod.Spec.Tolerations...)}})
	if err != nil {
		return err
	}
	return c.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch))
}

// watchedNamespace creates namespace name and records its pods' ends
// (demo.WatchFinished) until the test ends.
func watchedNamespace(ctx context.Context, t *testing.T, c client.Client, cfg *rest.Config, name string) *demo.Finished {
	t.Helper()
	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}))
	wctx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	seen, err := demo.WatchFinished(wctx, cfg, name)
	require.NoError(t, err)
	return seen
}

// clusterCommand runs the cluster command (TALLY_CLUSTER_BIN) with args
// on the test's cluster.
func clusterCommand(t *testing.T, dir string, args ...string) {
	t.Helper()
	bin := os.Getenv("TALLY_CLUSTER_BIN")
	if bin == "" {
		t.Skip("TALLY_CLUSTER_BIN is not set: run make e2e-cluster")
	}
	cmd := exec.Command(bin, append(args[:1:1], append([]string{"--dir", dir}, args[1:]...)...)...)
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	require.NoError(t, cmd.Run(), "cluster %s", strings.Join(args, " "))
}

// nodeLost loses the second node for good while a pool runs six pods on
// it, two of them marked with an intent, and one replica of each of
// tally's Deployments runs there too: its kubelet, containerd and every
// container are killed and its link cut. The node goes NotReady, the taint
// manager evicts its pods after the 5 s tolerations the test gives them,
// the test deletes the Node and PodGC force-deletes what is left. Every pod
// of the node must leave the API within lostNodeBound (none held by
// tally's finalizer), tally's counts must equal a fresh List, and the totals
// must count each lost pod exactly once: the two marked as completed, the
// others as unexpected. The node then joins again. When it fails, the
// aggregators' lease, logs and metrics are kept in the test's output.
func nodeLost(ctx context.Context, t *testing.T, c client.Client, cfg *rest.Config, dir string, fig *figures) {
	requireTwoNodes(ctx, t, c)
	keepAggregatorsOnFailure(t, cfg)
	spread(ctx, t, c, fig)
	const lostNS = "e2e-lost"
	seen := watchedNamespace(ctx, t, c, cfg, lostNS)
	pool := poolOn(ctx, t, c, lostNS, "lost", 6, secondNode)

	onNode, err := podsOn(ctx, c, secondNode)
	require.NoError(t, err)
	want := map[types.UID]config.Count{}
	marked := 0
	for _, p := range onNode {
		if p.Namespace != lostNS || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
			continue
		}
		want[p.UID] = config.UnexpectedTotal
		if marked < 2 {
			patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"`+keys.CompletionIntent+`":"node-lost-test"}}}`))
			require.NoError(t, c.Patch(ctx, p.DeepCopy(), patch), "marking %s", p.Name)
			want[p.UID] = config.CompletedTotal
			marked++
		}
	}
	require.Equal(t, 2, marked)
	// Read again: the tolerations below replace the list as the API has it now.
	onNode, err = podsOn(ctx, c, secondNode)
	require.NoError(t, err)
	var names []string
	for i := range onNode {
		require.NoError(t, shortTolerations(ctx, c, &onNode[i], 5*time.Second), "pod %s/%s", onNode[i].Namespace, onNode[i].Name)
		names = append(names, onNode[i].Namespace+"/"+onNode[i].Name)
	}
	t.Logf("pods on %s before it is lost: %s", secondNode, strings.Join(names, ", "))

	start := time.Now()
	clusterCommand(t, dir, "lose-node", "--node", secondNode)
	var node corev1.Node
	require.True(t, poll(3*time.Minute, func() bool {
		if c.Get(ctx, client.ObjectKey{Name: secondNode}, &node) != nil {
			return false
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status != corev1.ConditionTrue
			}
		}
		return false
	}), "%s never went NotReady", secondNode)
	notReady := time.Since(start)
	var left []corev1.Pod
	require.True(t, poll(2*time.Minute, func() bool {
		left, err = podsOn(ctx, c, secondNode)
		if err != nil {
			return false
		}
		for _, p := range left {
			if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
				return false
			}
		}
		return true
	}), "the taint manager did not evict the pods of %s: %s", secondNode, describePods(left))
	evicted := time.Since(start)
	require.NoError(t, c.Delete(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: secondNode}}))
	ok := poll(lostNodeBound-time.Since(start), func() bool {
		left, err = podsOn(ctx, c, secondNode)
		return err == nil && len(left) == 0
	})
	require.True(t, ok, "pods of the lost node still in the API %v after it was lost: %s", lostNodeBound, describePods(left))
	gone := time.Since(start)
	fig.add("%s lost: NotReady after %v, its pods evicted after %v, all %d gone from the API after %v (Node deleted at %v; bound %v)",
		secondNode, notReady.Round(time.Second), evicted.Round(time.Second), len(onNode), gone.Round(time.Second), evicted.Round(time.Second), lostNodeBound)

	for _, d := range []string{"webhook", "aggregator"} {
		waitReady(ctx, t, c, helm.Release+"-"+d)
	}
	var last string
	ok = poll(3*time.Minute, func() bool {
		var settled bool
		settled, _, _, last = totalsSettled(ctx, c, pool, seen)
		return settled
	})
	require.True(t, ok, "after the node was lost, the counts or totals never equalled the truth: %s", last)
	for uid, total := range want {
		got, finished := seen.Of(uid)
		assert.True(t, finished, "lost pod %s never seen finishing", uid)
		assert.Equal(t, total, got, "lost pod %s", uid)
	}
	t.Log(last)
	fig.add("%s lost: counts equal a fresh List and totals equal the pods seen finishing (%s); %v after the node was lost",
		secondNode, last, time.Since(start).Round(time.Second))

	start = time.Now()
	clusterCommand(t, dir, "join-node", "--node", secondNode)
	fig.add("%s joined again (containerd, kubelet, kube-proxy started, Node Ready): %v", secondNode, time.Since(start).Round(100*time.Millisecond))
	require.NoError(t, c.Delete(ctx, pool))
}

// describePods says where each pod is: namespace, name, phase, deletion,
// finalizers.
func describePods(pods []corev1.Pod) string {
	var parts []string
	for _, p := range pods {
		parts = append(parts, fmt.Sprintf("%s/%s %s deleting=%t finalizers=%v", p.Namespace, p.Name, p.Status.Phase, p.DeletionTimestamp != nil, p.Finalizers))
	}
	return strings.Join(parts, "; ")
}

// drain runs kubectl drain on the node of the aggregator's leader, which
// also runs a webhook replica and a pool's six pods, while two clients
// create pods and mark them with an intent through the webhook: the drain
// must complete (the chart's PodDisruptionBudgets let it), no create or
// mark may fail, the lease must move to the other node, and the counts and
// totals must stay exact.
func drain(ctx context.Context, t *testing.T, c client.Client, cfg *rest.Config, fig *figures) {
	requireTwoNodes(ctx, t, c)
	keepAggregatorsOnFailure(t, cfg)
	kubectl := os.Getenv("KUBECTL")
	if kubectl == "" {
		t.Skip("KUBECTL is not set: run make e2e-cluster")
	}
	spread(ctx, t, c, fig)
	leader := func() (corev1.Pod, error) {
		var lease coordinationv1.Lease
		var pod corev1.Pod
		if err := c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release + "-aggregator"}, &lease); err != nil {
			return pod, err
		}
		name, _, _ := strings.Cut(ptr.Deref(lease.Spec.HolderIdentity, ""), "_")
		err := c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: name}, &pod)
		return pod, err
	}
	var lead corev1.Pod
	require.True(t, poll(time.Minute, func() bool {
		var err error
		lead, err = leader()
		return err == nil
	}), "no aggregator holds the lease")
	drained := lead.Spec.NodeName
	require.NotEmpty(t, tallyPods(ctx, t, c, "webhook")[drained], "no webhook replica on %s, the leader's node", drained)

	const drainNS = "e2e-drain"
	seen := watchedNamespace(ctx, t, c, cfg, drainNS)
	pool := poolOn(ctx, t, c, drainNS, "drained", 6, drained)

	load := admissionLoad(ctx, t, c)
	start := time.Now()
	cmd := exec.CommandContext(ctx, kubectl, "drain", drained, "--ignore-daemonsets", "--delete-emptydir-data",
		"--timeout", drainBound.String())
	cmd.Env = append(os.Environ(), "KUBECONFIG="+os.Getenv("TALLY_CLUSTER_DIR")+"/admin.kubeconfig")
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	drainErr := cmd.Run()
	took := time.Since(start)
	creates, failedCreates, marks, failedMarks, firstErr := load()
	cordon(ctx, t, c, drained, false)
	require.NoError(t, drainErr, "kubectl drain %s", drained)
	fig.add("kubectl drain of %s (aggregator leader, a webhook replica, 6 pool pods): %v; during it %d of %d pod creates and %d of %d intent marks failed",
		drained, took.Round(100*time.Millisecond), failedCreates, creates, failedMarks, marks)
	assert.Zero(t, failedCreates+failedMarks, "admission failed during the drain (first: %s)", firstErr)
	assert.Positive(t, creates)
	assert.Positive(t, marks)

	var now corev1.Pod
	require.True(t, poll(time.Minute, func() bool {
		var err error
		now, err = leader()
		return err == nil && now.Spec.NodeName != "" && now.Spec.NodeName != drained
	}), "the aggregator's lease did not move off %s (held by %s on %s)", drained, now.Name, now.Spec.NodeName)
	fig.add("kubectl drain of %s: the lease moved from %s to %s on %s", drained, lead.Name, now.Name, now.Spec.NodeName)

	var last string
	ok := poll(3*time.Minute, func() bool {
		var settled bool
		var unexpected int64
		settled, _, unexpected, last = totalsSettled(ctx, c, pool, seen)
		return settled && unexpected >= 6
	})
	require.True(t, ok, "after the drain, the counts or totals never equalled the truth: %s", last)
	t.Log(last)
	ok = poll(3*time.Minute, func() bool {
		var settled bool
		settled, last = allSettled(ctx, c, []string{"alpha", "beta", "burst"})
		return settled
	})
	require.True(t, ok, "after the drain, the pools did not settle with tally's counts equal to a fresh List:%s", last)
	require.NoError(t, c.Delete(ctx, pool))
}

// admissionLoad creates burst's pods from two clients and marks each one it
// created with the operator's intent, both through tally's webhook, until
// the returned func is called; that returns how many creates and marks were
// made and failed, and the first failure. A pod the operator deleted first
// (it marks burst's pods too) is not a failed mark.
func admissionLoad(ctx context.Context, t *testing.T, c client.Client) func() (creates, failedCreates, marks, failedMarks int64, first string) {
	burst := operator.Pool(ns, "burst", 0)
	require.NoError(t, c.Get(ctx, client.ObjectKeyFromObject(burst), burst))
	var created, createFailed, marked, markFailed atomic.Int64
	var firstErr atomic.Value
	fail := func(err error) { firstErr.CompareAndSwap(nil, err.Error()) }
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
				pod := burstPod(burst)
				if err := c.Create(ctx, pod); err != nil {
					createFailed.Add(1)
					fail(err)
					continue
				}
				created.Add(1)
				patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"`+keys.CompletionIntent+`":"`+operator.ScaleDown+`"}}}`))
				err := c.Patch(ctx, pod, patch)
				switch {
				case apierrors.IsNotFound(err):
				case err != nil:
					markFailed.Add(1)
					fail(err)
				default:
					marked.Add(1)
				}
			}
		})
	}
	return func() (int64, int64, int64, int64, string) {
		close(stop)
		wg.Wait()
		first, _ := firstErr.Load().(string)
		return created.Load(), createFailed.Load(), marked.Load(), markFailed.Load(), first
	}
}
