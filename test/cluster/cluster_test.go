// Package cluster runs tally on a real two-node cluster (`make e2e-cluster`):
// the chart installed with helm, its Deployments run by the kubelets, the
// example operator as a Deployment, and workers that are real processes. A
// worker marked for completion is stopped and exits 0 on SIGTERM, some crash
// by themselves, some are deleted unexpectedly: the kubelet sets every
// terminal phase, and the garbage collector deletes a deleted pool's pods.
// The second node is lost for good once and drained once (nodes_test.go).
//
// It runs only when TALLY_CLUSTER_DIR names the state directory of a running
// cluster (make cluster-up); `make test` skips it. The two-node scenarios
// skip on a one-node cluster, unless CI is set.
package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

const ns = "e2e"

// figures are printed at the end of the run.
type figures struct{ lines []string }

func (f *figures) add(format string, args ...any) {
	f.lines = append(f.lines, fmt.Sprintf(format, args...))
}

func TestRealCluster(t *testing.T) {
	dir := os.Getenv("TALLY_CLUSTER_DIR")
	if dir == "" {
		t.Skip("TALLY_CLUSTER_DIR is not set: run make e2e-cluster (root, Linux)")
	}
	ctx := context.Background()
	kubeconfig, cfg, c, cs := connect(t, dir)

	// Installed with two counts; the upgrade maps all four and the totals
	// (the aggregator then gives the running pods the tracking finalizer).
	valuesDir := t.TempDir()
	values, err := demo.WriteClusterValues(valuesDir, []config.Count{config.Completing, config.Active})
	require.NoError(t, err)
	cluster := &demo.Cluster{Kubeconfig: kubeconfig, Client: c, Values: values,
		OperatorImage: demo.OperatorImage, WorkerImage: demo.WorkerImage, WorkerEnv: []string{"WORKER_CRASH_PERCENT=20"}}
	fig := &figures{}
	defer func() {
		t.Log("figures:\n  " + strings.Join(fig.lines, "\n  "))
	}()

	start := time.Now()
	require.NoError(t, cluster.Install(ctx))
	fig.add("helm install --wait + operator ready: %v", time.Since(start).Round(100*time.Millisecond))

	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	pools := []string{"alpha", "beta", "gamma"}
	for _, p := range pools {
		require.NoError(t, c.Create(ctx, operator.Pool(ns, p, 6)))
	}
	// burst's pods are created by the test while a webhook pod goes away;
	// with no replicas wanted, the operator marks and stops each one.
	require.NoError(t, c.Create(ctx, operator.Pool(ns, "burst", 0)))

	scenario := time.Now()
	stopChurn := churn(ctx, t, c, pools)

	t.Run("webhook pod deleted while pods are created", func(t *testing.T) {
		webhookPodDeleted(ctx, t, c, fig)
	})
	t.Run("aggregator leader killed with SIGKILL", func(t *testing.T) {
		aggregatorKilled(ctx, t, c, fig)
	})
	t.Run("helm upgrade with a changed config", func(t *testing.T) {
		start := time.Now()
		_, err := demo.WriteClusterValues(valuesDir, nil, map[string]any{"logLevel": "debug"})
		require.NoError(t, err)
		_, err = cluster.Helm("upgrade", helm.Release, helm.Chart(), "--namespace", helm.Namespace,
			"-f", values, "--wait", "--timeout", "3m")
		require.NoError(t, err)
		for _, d := range []string{"webhook", "aggregator"} {
			waitReady(ctx, t, c, helm.Release+"-"+d)
		}
		fig.add("helm upgrade (config changed, both Deployments rolled): %v", time.Since(start).Round(100*time.Millisecond))
	})
	stopChurn()
	fig.add("scenario (churn, webhook pod deleted, aggregator killed, upgrade): %v", time.Since(scenario).Round(100*time.Millisecond))

	t.Run("counts equal a fresh List at quiescence", func(t *testing.T) {
		start := time.Now()
		var last string
		ok := poll(3*time.Minute, func() bool {
			var settled bool
			settled, last = allSettled(ctx, c, append(pools, "burst"))
			return settled
		})
		require.True(t, ok, "the pools did not settle with tally's counts equal to a fresh List:%s", last)
		t.Logf("settled:%s", last)
		fig.add("quiescence after the scenario: %v", time.Since(start).Round(100*time.Millisecond))
	})

	t.Run("the totals were opted in by the upgrade: live pods tracked, ledgers folded", func(t *testing.T) {
		ok := poll(time.Minute, func() bool {
			var pods corev1.PodList
			if c.List(ctx, &pods, client.InNamespace(ns)) != nil {
				return false
			}
			for _, p := range pods.Items {
				live := p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed
				if live && !slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
					return false
				}
			}
			for _, name := range append(pools, "burst") {
				pool := operator.Pool(ns, name, 0)
				if c.Get(ctx, client.ObjectKeyFromObject(pool), pool) != nil {
					return false
				}
				for _, list := range []string{"completed", "unexpected"} {
					if l, _, _ := unstructured.NestedSlice(pool.Object, "status", "tallyLedger", list); len(l) > 0 {
						return false
					}
				}
				total, _, _ := unstructured.NestedInt64(pool.Object, "status", "unexpectedTotal")
				t.Logf("%s: unexpectedTotal %d (pods that crashed or were deleted since the upgrade)", name, total)
			}
			return true
		})
		require.True(t, ok, "live pods without %s, or a ledger not folded, a minute after quiescence", keys.TrackingFinalizer)
	})

	t.Run("totals equal the pods seen finishing, on real pods", func(t *testing.T) {
		const totalsNS = "e2e-totals"
		seen := watchedNamespace(ctx, t, c, cfg, totalsNS)
		pool := operator.Pool(totalsNS, "delta", 6)
		require.NoError(t, c.Create(ctx, pool))
		running := func() []corev1.Pod {
			var pods corev1.PodList
			require.NoError(t, c.List(ctx, &pods, client.InNamespace(totalsNS)))
			var out []corev1.Pod
			for _, p := range pods.Items {
				if _, marked := p.Annotations[keys.CompletionIntent]; !marked && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
					out = append(out, p)
				}
			}
			return out
		}
		require.True(t, poll(2*time.Minute, func() bool { return len(running()) >= 6 }), "delta never ran 6 pods")
		// Three deleted by hand (unexpected); once their replacements run,
		// a scale-down marks three (completed); crashing workers add to
		// unexpected. Scaling down before the operator has seen the
		// deletions would leave it no surplus to mark.
		for _, p := range running()[:3] {
			require.NoError(t, client.IgnoreNotFound(c.Delete(ctx, &p)))
		}
		// running() leaves out pods being deleted.
		require.True(t, poll(2*time.Minute, func() bool { return len(running()) >= 6 }), "delta did not replace the deleted pods")
		require.NoError(t, c.Patch(ctx, pool, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"replicas":3}}`))))
		var last string
		ok := poll(3*time.Minute, func() bool {
			var completed, unexpected int64
			var settled bool
			settled, completed, unexpected, last = totalsSettled(ctx, c, pool, seen)
			return settled && completed >= 1 && unexpected >= 3
		})
		require.True(t, ok, "the totals never equalled the pods seen finishing: %s", last)
		t.Log(last)
		require.NoError(t, c.Delete(ctx, pool))
	})

	t.Run("a custom count that does not compile: helm upgrade refuses it, a ConfigMap edited into it stops nothing", func(t *testing.T) {
		customCountTypo(ctx, t, c, cluster, valuesDir, fig)
	})

	t.Run("kubectl tally doctor and explain on a healthy install", func(t *testing.T) {
		// doctor connects to a webhook pod through a port-forward, as the
		// API server would through the Service.
		var out, errOut bytes.Buffer
		streams := genericiooptions.IOStreams{Out: &out, ErrOut: &errOut}
		code := app.Main([]string{"--kubeconfig", kubeconfig, "--tally-namespace", helm.Namespace, "doctor"}, streams)
		t.Logf("kubectl tally doctor:\n%s%s", out.String(), errOut.String())
		assert.Equal(t, app.ExitOK, code)
		assert.Contains(t, out.String(), "OK    webhook certificate: the caBundle verifies the certificate served for tally-webhook.tally-system.svc")
		assert.Contains(t, out.String(), "OK    tracking finalizers: ")
		out.Reset()
		code = app.Main([]string{"--kubeconfig", kubeconfig, "--tally-namespace", helm.Namespace, "-n", ns, "explain", "workerpool/alpha"}, streams)
		t.Logf("kubectl tally explain workerpool/alpha:\n%s%s", out.String(), errOut.String())
		assert.Equal(t, app.ExitOK, code)
	})

	t.Run("the garbage collector deletes a deleted pool's pods", func(t *testing.T) {
		pool := operator.Pool(ns, "gamma", 0)
		require.NoError(t, c.Get(ctx, client.ObjectKeyFromObject(pool), pool))
		uid := pool.GetUID()
		start := time.Now()
		require.NoError(t, c.Delete(ctx, pool))
		var left int
		ok := poll(2*time.Minute, func() bool {
			var pods corev1.PodList
			if err := c.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels{keys.ParentUID: string(uid)}); err != nil {
				return false
			}
			left = len(pods.Items)
			return left == 0
		})
		require.True(t, ok, "%d pods of the deleted pool left", left)
		fig.add("pool deleted -> its pods gone (garbage collector, kubelet): %v", time.Since(start).Round(100*time.Millisecond))
	})

	t.Run("a node lost for good: its pods leave the API, counts and totals exact", func(t *testing.T) {
		nodeLost(ctx, t, c, cfg, dir, fig)
	})
	t.Run("kubectl drain of the leader's node: no admission failure, the lease moves", func(t *testing.T) {
		drain(ctx, t, c, cfg, fig)
	})

	t.Run("kube-apiserver stopped for 2 minutes: no crash loop, counts right within seconds", func(t *testing.T) {
		apiServerOutage(ctx, t, c, cs, dir, fig)
	})

	memory(ctx, t, cs, fig)

	t.Run("helm uninstall leaves nothing, no finalizer either", func(t *testing.T) {
		start := time.Now()
		require.NoError(t, cluster.Uninstall(ctx))
		fig.add("helm uninstall, its pre-delete hook releasing every tracked pod: %v", time.Since(start).Round(100*time.Millisecond))
		for _, gvk := range framework.ChartKinds {
			list := &unstructured.UnstructuredList{}
			list.SetGroupVersionKind(gvk)
			require.NoError(t, c.List(ctx, list, client.MatchingLabels{"app.kubernetes.io/instance": helm.Release}))
			assert.Empty(t, list.Items, "%s left after helm uninstall", gvk.Kind)
		}
		ok := poll(time.Minute, func() bool {
			var pods corev1.PodList
			return c.List(ctx, &pods, client.InNamespace(helm.Namespace)) == nil && len(pods.Items) == 0
		})
		assert.True(t, ok, "tally's pods still run after helm uninstall")

		// The chart's pre-delete hook released every pod: no manual step.
		var pods corev1.PodList
		require.NoError(t, c.List(ctx, &pods))
		for _, p := range pods.Items {
			assert.NotContains(t, p.Finalizers, keys.TrackingFinalizer, "pod %s/%s", p.Namespace, p.Name)
		}
	})
}

// apiServerOutage stops kube-apiserver for 2 minutes (TALLY_CLUSTER_BIN's
// outage command), marks a running pod of beta the moment the API server
// answers again, and measures how long tally's counts then take to equal a
// fresh List; no tally container may have restarted.
func apiServerOutage(ctx context.Context, t *testing.T, c client.Client, cs *kubernetes.Clientset, dir string, fig *figures) {
	restarts := func() map[string]string {
		var pods corev1.PodList
		require.NoError(t, c.List(ctx, &pods, client.InNamespace(helm.Namespace)))
		out := map[string]string{}
		for _, p := range pods.Items {
			for _, s := range p.Status.ContainerStatuses {
				state := fmt.Sprint(s.RestartCount)
				if w := s.State.Waiting; w != nil {
					state += " " + w.Reason
				}
				out[p.Name] = state
			}
		}
		return out
	}
	before := restarts()
	clusterCommand(t, dir, "outage", "--for", "2m")
	apiBack := time.Now()
	// Pods reach the API server through the kubernetes Service, which
	// kube-proxy, itself in client-go's back-off after the outage, programs
	// again a while later: tally is measured from then.
	svc := rest.CopyConfig(cfgOf(t, dir))
	svc.Host, svc.CAData, svc.CAFile, svc.Insecure = "https://10.96.0.1:443", nil, "", true
	probe, err := kubernetes.NewForConfig(svc)
	require.NoError(t, err)
	serviceBack := poll(3*time.Minute, func() bool {
		_, err := probe.Discovery().ServerVersion()
		return err == nil
	})
	require.True(t, serviceBack, "the kubernetes Service never answered again after the outage")
	back := time.Now()
	fig.add("kube-apiserver stopped 2 min: the kubernetes Service (kube-proxy) answered again on the first node %v after the API server", back.Sub(apiBack).Round(100*time.Millisecond))
	// Each further node has its own kube-proxy, in its own back-off: the
	// Service must answer from every node's network namespace.
	var nodes corev1.NodeList
	require.NoError(t, c.List(ctx, &nodes))
	for _, node := range nodes.Items {
		if node.Name == firstNode {
			continue
		}
		var err error
		require.True(t, poll(3*time.Minute, func() bool {
			err = dialFrom(node.Name, "10.96.0.1:443")
			return err == nil
		}), "the kubernetes Service never answered again on %s after the outage: %v", node.Name, err)
		back = time.Now()
		fig.add("kube-apiserver stopped 2 min: the kubernetes Service (kube-proxy) answered again on %s %v after the API server", node.Name, back.Sub(apiBack).Round(100*time.Millisecond))
	}

	var pods corev1.PodList
	require.NoError(t, c.List(ctx, &pods, client.InNamespace(ns)))
	var marked string
	for _, p := range pods.Items {
		if ref := metav1.GetControllerOf(&p); ref != nil && ref.Name == "beta" && p.Status.Phase == corev1.PodRunning &&
			p.DeletionTimestamp == nil && p.Annotations[keys.CompletionIntent] == "" {
			// The webhook's own Service may still have no ready endpoint:
			// the node's status went stale during the outage, and the
			// controller manager marks its pods not ready until the kubelet
			// reports again. Under failurePolicy Fail the API server refuses
			// the patch meanwhile; that is the cluster, not tally.
			patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"`+keys.CompletionIntent+`":"outage-test"}}}`))
			var err error
			ok := poll(2*time.Minute, func() bool {
				err = c.Patch(ctx, p.DeepCopy(), patch)
				return err == nil
			})
			require.True(t, ok, "marking a pod through the webhook after the outage: %v", err)
			fig.add("kube-apiserver stopped 2 min: the webhook admitted a pod update %v after the kubernetes Service answered", time.Since(back).Round(100*time.Millisecond))
			back = time.Now()
			marked = p.Name
			break
		}
	}
	require.NotEmpty(t, marked, "no running pod of beta to mark")
	var last string
	ok := poll(time.Minute, func() bool {
		equal, line, err := countsEqual(ctx, c, "beta")
		last = line
		return err == nil && equal
	})
	require.True(t, ok, "beta's counts not equal to a fresh List a minute after the outage: %s", last)
	fig.add("kube-apiserver stopped 2 min: a pod marked the moment pods could reach it again, tally's counts equal a fresh List %v later (%s)",
		time.Since(back).Round(100*time.Millisecond), last)
	// What the aggregators did meanwhile, for the record.
	var aggs corev1.PodList
	require.NoError(t, c.List(ctx, &aggs, client.InNamespace(helm.Namespace), client.MatchingLabels{"app.kubernetes.io/component": "aggregator"}))
	for _, p := range aggs.Items {
		raw, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{SinceSeconds: ptr.To[int64](200)}).DoRaw(ctx)
		if err != nil {
			t.Logf("logs of %s: %v", p.Name, err)
			continue
		}
		var lines []string
		for line := range strings.Lines(string(raw)) {
			for _, key := range []string{"Aggregator stopped", "acquired lease", "Pod watch", "giving up", "Starting aggregator", "Caches synced", "leader election lost"} {
				if strings.Contains(line, key) {
					lines = append(lines, strings.TrimSpace(line))
					break
				}
			}
		}
		t.Logf("%s during and after the outage:\n  %s", p.Name, strings.Join(lines, "\n  "))
	}
	after := restarts()
	for pod, state := range after {
		assert.NotContains(t, state, "CrashLoopBackOff", "pod %s", pod)
	}
	assert.Equal(t, before, after, "tally's containers restarted during the outage (restart counts and waiting reasons)")
}

// connect returns the cluster's admin kubeconfig, a config read from it and
// clients built from that. The pod creates measure the API server and the
// webhook, not client-go's default limit of 5 requests a second.
func connect(t *testing.T, dir string) (string, *rest.Config, client.Client, *kubernetes.Clientset) {
	t.Helper()
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	cfg := cfgOf(t, dir)
	cfg.QPS, cfg.Burst = 200, 400
	c, err := client.New(cfg, client.Options{})
	require.NoError(t, err)
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return kubeconfig, cfg, c, cs
}

// cfgOf is the cluster's admin config.
func cfgOf(t *testing.T, dir string) *rest.Config {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "admin.kubeconfig"))
	require.NoError(t, err)
	return cfg
}

// countsEqual reports whether every count the pool name shows equals a
// fresh List of its pods, quiescent or not.
func countsEqual(ctx context.Context, c client.Client, name string) (bool, string, error) {
	r, err := read(ctx, c, ns, name)
	if err != nil {
		return false, "", err
	}
	return r.equal, name + " tally/list: " + r.counts, nil
}

// churn scales the pools at random and deletes running pods without intent
// (a node drain, a user) until the returned func is called.
func churn(ctx context.Context, t *testing.T, c client.Client, pools []string) func() {
	ctx, cancel := context.WithCancel(ctx)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(1500 * time.Millisecond):
			}
			pool := pools[rng.IntN(len(pools))]
			if rng.IntN(2) == 0 {
				patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, 2+rng.IntN(9))
				_ = c.Patch(ctx, operator.Pool(ns, pool, 0), client.RawPatch("application/merge-patch+json", []byte(patch)))
				continue
			}
			var pods corev1.PodList
			if err := c.List(ctx, &pods, client.InNamespace(ns)); err != nil {
				continue
			}
			var running []corev1.Pod
			for _, p := range pods.Items {
				_, marked := p.Annotations[keys.CompletionIntent]
				if !marked && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && strings.HasPrefix(p.Name, pool+"-") {
					running = append(running, p)
				}
			}
			if len(running) > 0 {
				_ = c.Delete(ctx, &running[rng.IntN(len(running))])
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
		for _, p := range pools {
			require.NoError(t, c.Patch(context.Background(), operator.Pool(ns, p, 0), client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"replicas":5}}`))))
		}
	}
}

// webhookPodDeleted creates burst's pods from 4 clients for 15 s and deletes
// one webhook pod 3 s in: no create may fail.
//
// The pods carry a scheduling gate: what is measured is admission, and the
// nodes must stay free to start the webhook's replacement pod. Run by
// the kubelet, the 250-odd pods of the burst kept a 2-core node busy for
// minutes (load average near 50) and the replacement in ContainerCreating
// past the rollout's deadline. The operator deletes them as surplus.
func webhookPodDeleted(ctx context.Context, t *testing.T, c client.Client, fig *figures) {
	burst := operator.Pool(ns, "burst", 0)
	require.NoError(t, c.Get(ctx, client.ObjectKeyFromObject(burst), burst))
	var created, failed atomic.Int64
	var firstErr atomic.Value
	var mu sync.Mutex
	var latencies []time.Duration
	deadline := time.Now().Add(15 * time.Second)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				pod := burstPod(burst)
				start := time.Now()
				err := c.Create(ctx, pod)
				mu.Lock()
				latencies = append(latencies, time.Since(start))
				mu.Unlock()
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				} else {
					created.Add(1)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
	time.Sleep(3 * time.Second)
	var pods corev1.PodList
	require.NoError(t, c.List(ctx, &pods, client.InNamespace(helm.Namespace), client.MatchingLabels{"app.kubernetes.io/component": "webhook"}))
	require.NotEmpty(t, pods.Items, "no webhook pod found")
	victim := pods.Items[0]
	require.NoError(t, c.Delete(ctx, &victim))
	wg.Wait()
	slices.Sort(latencies)
	fig.add("webhook pod %s deleted during creates from 4 clients: %d of %d creates failed; create p50 %v, p99 %v",
		victim.Name, failed.Load(), created.Load()+failed.Load(),
		latencies[len(latencies)/2].Round(time.Millisecond), latencies[len(latencies)*99/100].Round(time.Millisecond))
	waitReady(ctx, t, c, helm.Release+"-webhook")
	assert.Zero(t, failed.Load(), "pod creates failed while a webhook pod went away (first: %v)", firstErr.Load())
	assert.Positive(t, created.Load())
}

// burstPod is a pod of the pool burst with a scheduling gate: it goes
// through admission and no node runs it (the operator deletes it as
// surplus).
func burstPod(burst *unstructured.Unstructured) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: "burst-", OwnerReferences: []metav1.OwnerReference{{
			APIVersion: operator.GVK.GroupVersion().String(), Kind: operator.GVK.Kind,
			Name: burst.GetName(), UID: burst.GetUID(), Controller: ptr.To(true),
		}}},
		Spec: corev1.PodSpec{
			RestartPolicy:   corev1.RestartPolicyNever,
			SchedulingGates: []corev1.PodSchedulingGate{{Name: "tally.dev/e2e-admission-only"}},
			Containers:      []corev1.Container{{Name: "worker", Image: demo.WorkerImage}},
		},
	}
}

// aggregatorKilled kills the process holding the aggregator's lease with
// SIGKILL, from the host (the test runs as root on the node): the lease is
// not released, the kubelet restarts the container, and another replica
// takes over once the lease expires.
func aggregatorKilled(ctx context.Context, t *testing.T, c client.Client, fig *figures) {
	var lease coordinationv1.Lease
	key := client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release + "-aggregator"}
	require.True(t, poll(time.Minute, func() bool {
		return c.Get(ctx, key, &lease) == nil && ptr.Deref(lease.Spec.HolderIdentity, "") != ""
	}), "no aggregator holds the lease")
	holder := *lease.Spec.HolderIdentity
	podName, _, _ := strings.Cut(holder, "_")
	var pod corev1.Pod
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: podName}, &pod))
	restarts := restartCount(&pod)
	pid, err := containerPID(pod.UID, "/aggregator")
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL), "killing the leader %s (pid %d)", podName, pid)
	require.True(t, poll(2*time.Minute, func() bool {
		return c.Get(ctx, key, &lease) == nil && ptr.Deref(lease.Spec.HolderIdentity, "") != "" && *lease.Spec.HolderIdentity != holder
	}), "no new aggregator leader after %s was killed", podName)
	fig.add("aggregator leader %s SIGKILLed -> lease held by %s after %v", podName, *lease.Spec.HolderIdentity, time.Since(start).Round(100*time.Millisecond))
	require.True(t, poll(2*time.Minute, func() bool {
		return c.Get(ctx, client.ObjectKeyFromObject(&pod), &pod) == nil && restartCount(&pod) > restarts && podReady(&pod)
	}), "the killed aggregator was not restarted")
	waitReady(ctx, t, c, helm.Release+"-aggregator")
}

// waitReady waits until one of tally's Deployments is rolled out; when it is
// not, it fails with what its pods wait for and how busy the node is.
func waitReady(ctx context.Context, t *testing.T, c client.Client, name string) {
	t.Helper()
	err := demo.WaitDeploymentReady(ctx, c, helm.Namespace, name, 2*time.Minute)
	if err == nil {
		return
	}
	var lines []string
	var pods corev1.PodList
	if c.List(ctx, &pods, client.InNamespace(helm.Namespace)) == nil {
		for _, p := range pods.Items {
			if strings.HasPrefix(p.Name, name+"-") {
				lines = append(lines, describePod(&p))
			}
		}
	}
	var events corev1.EventList
	if c.List(ctx, &events, client.InNamespace(helm.Namespace)) == nil {
		for _, e := range events.Items {
			if e.Type == corev1.EventTypeWarning && strings.HasPrefix(e.InvolvedObject.Name, name+"-") {
				lines = append(lines, fmt.Sprintf("event %s %s: %s", e.InvolvedObject.Name, e.Reason, e.Message))
			}
		}
	}
	phases := map[corev1.PodPhase]int{}
	if c.List(ctx, &pods) == nil {
		for _, p := range pods.Items {
			phases[p.Status.Phase]++
		}
	}
	lines = append(lines, fmt.Sprintf("pods on the node by phase: %v", phases))
	require.NoError(t, err, "%s", strings.Join(lines, "\n"))
}

// describePod says where a pod is in its start: phase, conditions not
// true, and why each container waits or ended.
func describePod(p *corev1.Pod) string {
	parts := []string{fmt.Sprintf("pod %s: %s node=%q deleting=%t", p.Name, p.Status.Phase, p.Spec.NodeName, p.DeletionTimestamp != nil)}
	for _, cond := range p.Status.Conditions {
		if cond.Status != corev1.ConditionTrue {
			parts = append(parts, fmt.Sprintf("%s=%s (%s %s)", cond.Type, cond.Status, cond.Reason, cond.Message))
		}
	}
	for _, s := range p.Status.ContainerStatuses {
		switch {
		case s.State.Waiting != nil:
			parts = append(parts, fmt.Sprintf("%s waiting: %s %s", s.Name, s.State.Waiting.Reason, s.State.Waiting.Message))
		case s.State.Terminated != nil:
			parts = append(parts, fmt.Sprintf("%s terminated: %s exit %d", s.Name, s.State.Terminated.Reason, s.State.Terminated.ExitCode))
		}
		if s.RestartCount > 0 {
			parts = append(parts, fmt.Sprintf("%s restarts %d", s.Name, s.RestartCount))
		}
	}
	return strings.Join(parts, "; ")
}

func restartCount(pod *corev1.Pod) int32 {
	var n int32
	for _, s := range pod.Status.ContainerStatuses {
		n += s.RestartCount
	}
	return n
}

func podReady(pod *corev1.Pod) bool {
	for _, cond := range pod.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

// containerPID finds the process running exe in the pod: the kubelet puts
// it in a cgroup named after the pod's UID.
func containerPID(uid types.UID, exe string) (int, error) {
	procs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return 0, err
	}
	for _, p := range procs {
		cgroup, _ := os.ReadFile(p + "/cgroup")
		cmdline, _ := os.ReadFile(p + "/cmdline")
		if strings.Contains(string(cgroup), "pod"+string(uid)) && strings.HasPrefix(string(cmdline), exe+"\x00") {
			return strconv.Atoi(filepath.Base(p))
		}
	}
	return 0, fmt.Errorf("no process %s in pod %s", exe, uid)
}

// snapshot compares a pool's status with a fresh List: settled means the
// pool runs what it wants, nothing is starting or finishing, and every
// count equals the truth.
func snapshot(ctx context.Context, c client.Client, name string) (bool, string, error) {
	return snapshotIn(ctx, c, ns, name)
}

// snapshotIn is snapshot for the pool name of namespace ns.
func snapshotIn(ctx context.Context, c client.Client, ns, name string) (bool, string, error) {
	r, err := read(ctx, c, ns, name)
	if err != nil {
		return false, "", err
	}
	desired, _, _ := unstructured.NestedInt64(r.pool.Object, "spec", "replicas")
	settled := r.equal && r.truth[config.Active] == desired && r.truth[config.Completing] == 0 && r.truth[config.Completed] == 0 && r.truth[config.Unexpected] == 0
	for _, p := range r.pods {
		if ref := metav1.GetControllerOf(&p); ref != nil && ref.UID == r.pool.GetUID() && p.Status.Phase == corev1.PodPending {
			settled = false
		}
	}
	return settled, fmt.Sprintf("%s desired %d, tally/list: %s", name, desired, r.counts), nil
}

// allSettled reports whether every pool of ns named in names is settled
// (snapshot), with a line per pool.
func allSettled(ctx context.Context, c client.Client, names []string) (bool, string) {
	settled, lines := true, ""
	for _, name := range names {
		s, line, err := snapshot(ctx, c, name)
		if err != nil {
			return false, lines + "\n  " + err.Error()
		}
		lines += "\n  " + line
		settled = settled && s
	}
	return settled, lines
}

// totalsSettled reports whether pool is settled (snapshotIn) with both
// totals equal to the pods seen finishing in its namespace, and returns the
// totals and a line that shows both sides.
func totalsSettled(ctx context.Context, c client.Client, pool *unstructured.Unstructured, seen *demo.Finished) (bool, int64, int64, string) {
	if err := c.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
		return false, 0, 0, err.Error()
	}
	want := seen.Totals()
	completed, _, _ := unstructured.NestedInt64(pool.Object, "status", "completedTotal")
	unexpected, _, _ := unstructured.NestedInt64(pool.Object, "status", "unexpectedTotal")
	settled, line, err := snapshotIn(ctx, c, pool.GetNamespace(), pool.GetName())
	line = fmt.Sprintf("%s; tally: completedTotal %d unexpectedTotal %d; seen finishing: %d and %d", line, completed, unexpected,
		want[config.CompletedTotal], want[config.UnexpectedTotal])
	ok := err == nil && settled && completed == want[config.CompletedTotal] && unexpected == want[config.UnexpectedTotal]
	return ok, completed, unexpected, line
}

// reading is a pool, its namespace's pods and a fresh count of the pool's.
type reading struct {
	pool  *unstructured.Unstructured
	pods  []corev1.Pod
	truth map[config.Count]int64
	// equal reports that every count the pool shows equals truth; counts
	// shows both, as "count tally/fresh".
	equal  bool
	counts string
}

// read reads the pool name of namespace ns and counts its pods afresh.
func read(ctx context.Context, c client.Client, ns, name string) (reading, error) {
	pool := operator.Pool(ns, name, 0)
	if err := c.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
		return reading{}, err
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(ns)); err != nil {
		return reading{}, err
	}
	r := reading{pool: pool, pods: pods.Items, truth: truth.Counts(pods.Items, ns, pool.GetUID()), equal: true}
	var parts []string
	for _, count := range config.Counts {
		v, found, _ := unstructured.NestedInt64(pool.Object, "status", string(count))
		if !found {
			v = -1
		}
		r.equal = r.equal && v == r.truth[count]
		parts = append(parts, fmt.Sprintf("%s %d/%d", count, v, r.truth[count]))
	}
	r.counts = strings.Join(parts, ", ")
	return r, nil
}

// memory reads tally's pods' working sets from each kubelet's summary API.
func memory(ctx context.Context, t *testing.T, cs *kubernetes.Clientset, fig *figures) {
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var lines, nodeLines []string
	for _, node := range nodes.Items {
		raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes/" + node.Name + "/proxy/stats/summary").DoRaw(ctx)
		require.NoError(t, err)
		var summary struct {
			Node struct {
				Memory struct {
					WorkingSetBytes uint64 `json:"workingSetBytes"`
				} `json:"memory"`
			} `json:"node"`
			Pods []struct {
				PodRef     struct{ Name, Namespace string } `json:"podRef"`
				Containers []struct {
					Memory struct {
						WorkingSetBytes uint64 `json:"workingSetBytes"`
					} `json:"memory"`
				} `json:"containers"`
			} `json:"pods"`
		}
		require.NoError(t, json.Unmarshal(raw, &summary))
		for _, p := range summary.Pods {
			if p.PodRef.Namespace != helm.Namespace && p.PodRef.Namespace != demo.OperatorNamespace {
				continue
			}
			var ws uint64
			for _, c := range p.Containers {
				ws += c.Memory.WorkingSetBytes
			}
			lines = append(lines, fmt.Sprintf("%s %.1f MiB", p.PodRef.Name, float64(ws)/(1<<20)))
		}
		// Both nodes are the same host: each reports the host's memory.
		nodeLines = append(nodeLines, fmt.Sprintf("%s %.0f MiB", node.Name, float64(summary.Node.Memory.WorkingSetBytes)/(1<<20)))
	}
	slices.Sort(lines)
	fig.add("memory (working set, kubelet summary): %s; nodes %s", strings.Join(lines, ", "), strings.Join(nodeLines, ", "))
}

func poll(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); ; time.Sleep(250 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}
