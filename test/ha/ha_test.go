// Package ha runs tally's binaries the way the chart deploys them, as
// separate processes against a real kube-apiserver: two aggregators with
// leader election (readiness of the standby, fail-over after the leader is
// killed, a leader paused past its lease that must not write when it
// resumes), and two webhook replicas of which one is stopped under load.
package ha

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/certs/devcert"
	aggregatorapp "tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	// bin holds the built binaries; dir the config file and kubeconfigs.
	bin, dir string
)

func TestMain(m *testing.M) {
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	var err error
	if dir, err = os.MkdirTemp("", "tally-ha-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "bin")
	code := framework.Main(m, controlplane.Options{}, &env, func(e *framework.Env) error {
		if err := framework.BuildBinaries(bin, "webhook", "aggregator"); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(configFile), 0o600); err != nil {
			return err
		}
		user, err := e.AggregatorIdentity()
		if err != nil {
			return err
		}
		if err := controlplane.WriteKubeconfig(user, filepath.Join(dir, "aggregator.kubeconfig")); err != nil {
			return err
		}
		admin, err := e.AddUser(envtest.User{Name: "ha-admin", Groups: []string{"system:masters"}}, nil)
		if err != nil {
			return err
		}
		return controlplane.WriteKubeconfig(admin, filepath.Join(dir, "admin.kubeconfig"))
	})
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

const configFile = `parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    counts:
      completing: status.completing
      active: status.active
`

// aggregator is one aggregator process with leader election.
type aggregator struct {
	*process.Process
	probe string
}

func startAggregator(t *testing.T, name, leaseNS string) *aggregator {
	t.Helper()
	return startAggregatorWith(t, name, leaseNS, filepath.Join(dir, "aggregator.kubeconfig"))
}

// startAggregatorWith starts an aggregator that reaches the API server
// through kubeconfig.
func startAggregatorWith(t *testing.T, name, leaseNS, kubeconfig string) *aggregator {
	t.Helper()
	port, err := process.FreePort()
	require.NoError(t, err)
	probe := fmt.Sprintf("127.0.0.1:%d", port)
	p, err := process.Start(name, filepath.Join(bin, "aggregator"), t.TempDir(),
		"--config", filepath.Join(dir, "config.yaml"), "--kubeconfig", kubeconfig,
		"--leader-elect", "--leader-election-namespace", leaseNS, "--leader-election-id", "tally-aggregator",
		"--metrics-bind-address", "0", "--health-probe-bind-address", probe, "--backfill-interval", "1h")
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Signal(syscall.SIGCONT)
		_ = p.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(p.LogPath())
			t.Logf("%s's log:\n%s", name, log)
		}
	})
	return &aggregator{Process: p, probe: probe}
}

// leads reports whether the process has logged that it acquired the lease.
func (a *aggregator) leads() bool {
	log, err := os.ReadFile(a.LogPath())
	return err == nil && strings.Contains(strings.ToLower(string(log)), "successfully acquired lease")
}

func (a *aggregator) waitReady(t *testing.T) {
	t.Helper()
	require.NoError(t, a.WaitReady(context.Background(), "http://"+a.probe+"/readyz"), "%s never became ready", a.LogPath())
}

// holder returns the lease's holder identity.
func holder(t *testing.T, leaseNS string) string {
	var lease coordinationv1.Lease
	if err := env.Client.Get(context.Background(), client.ObjectKey{Namespace: leaseNS, Name: "tally-aggregator"}, &lease); err != nil {
		return ""
	}
	return ptr.Deref(lease.Spec.HolderIdentity, "")
}

// pool creates a WorkerPool with n running pods, labelled as the webhook
// would.
func pool(t *testing.T, ns string, n int) (types.UID, []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	p := operator.Pool(ns, "pool", int64(n))
	require.NoError(t, env.Client.Create(ctx, p))
	var pods []*corev1.Pod
	for i := range n {
		pod := builder.Pod(ns, fmt.Sprintf("pool-%02d", i)).ControlledBy(operator.GVK, "pool", p.GetUID()).
			Label(keys.ParentUID, string(p.GetUID())).Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		pods = append(pods, pod)
	}
	return p.GetUID(), pods
}

func markIntent(t *testing.T, pods []*corev1.Pod) {
	t.Helper()
	for _, p := range pods {
		patch := client.MergeFrom(p.DeepCopy())
		p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
		require.NoError(t, env.Client.Patch(context.Background(), p, patch))
	}
}

// completing reads the pool's status.completing; -1 when absent.
func completing(t *testing.T, ns string) int64 {
	t.Helper()
	v, err := env.StatusCount(context.Background(), operator.GVK, ns, "pool", "status", "completing")
	require.NoError(t, err)
	return v
}

func waitCompleting(t *testing.T, ns string, want int64, timeout time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	require.Eventually(t, func() bool { return completing(t, ns) == want }, timeout, 50*time.Millisecond,
		"status.completing never became %d", want)
	return time.Since(start)
}

// replicas creates a pool of n pods, starts aggregator a, waits until it
// leads and wrote the counts, then starts aggregator b and waits until it is
// ready: the standby is ready while a holds the lease.
func replicas(t *testing.T, n int) (ns, leaseNS string, pods []*corev1.Pod, a, b *aggregator) {
	t.Helper()
	var err error
	ns, err = env.Namespace(context.Background(), "ha")
	require.NoError(t, err)
	leaseNS, err = env.Namespace(context.Background(), "lease")
	require.NoError(t, err)
	_, pods = pool(t, ns, n)

	a = startAggregator(t, "a", leaseNS)
	a.waitReady(t)
	require.Eventually(t, a.leads, 30*time.Second, 100*time.Millisecond)
	waitCompleting(t, ns, 0, 30*time.Second)
	b = startAggregator(t, "b", leaseNS)
	b.waitReady(t)
	require.False(t, b.leads())
	return ns, leaseNS, pods, a, b
}

// TestStandbyIsReadyAndTakesOver: with leader election both replicas report
// ready (a rollout can complete), and when the leader is killed the
// standby writes within the lease duration.
func TestStandbyIsReadyAndTakesOver(t *testing.T) {
	ns, _, pods, a, b := replicas(t, 12)

	require.NoError(t, a.Signal(syscall.SIGKILL))
	killed := time.Now()
	markIntent(t, pods[:4])
	waitCompleting(t, ns, 4, aggregatorapp.LeaseDuration+2*aggregatorapp.RetryPeriod+15*time.Second)
	failover := time.Since(killed)
	t.Logf("fail-over: the standby wrote %.1fs after the leader was killed (lease duration %s, retry period %s)",
		failover.Seconds(), aggregatorapp.LeaseDuration, aggregatorapp.RetryPeriod)
	require.True(t, b.leads())
}

// TestDeposedLeaderCannotWrite: a leader paused past its lease (SIGSTOP)
// resumes after a standby took over and the pods changed: none of the
// values it computed from its stale caches reaches the parent, and it starts
// again in its process, as a standby (it does not exit: a restart by the
// kubelet would add its back-off).
func TestDeposedLeaderCannotWrite(t *testing.T) {
	framework.Long(t)
	ctx := context.Background()
	ns, leaseNS, pods, a, _ := replicas(t, 20)
	first := holder(t, leaseNS)

	require.NoError(t, a.Signal(syscall.SIGSTOP))
	require.Eventually(t, func() bool { h := holder(t, leaseNS); return h != "" && h != first }, 40*time.Second, 100*time.Millisecond,
		"the standby never took the lease over")
	markIntent(t, pods[:10])
	waitCompleting(t, ns, 10, 30*time.Second)

	dyn, err := dynamic.NewForConfig(env.Config)
	require.NoError(t, err)
	w, err := dyn.Resource(operator.GVK.GroupVersion().WithResource("workerpools")).Namespace(ns).
		Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=pool"})
	require.NoError(t, err)
	defer w.Stop()
	var mu sync.Mutex
	var seen []int64
	go func() {
		for ev := range w.ResultChan() {
			if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Deleted {
				v, _, _ := unstructured.NestedInt64(u.Object, "status", "completing")
				mu.Lock()
				seen = append(seen, v)
				mu.Unlock()
			}
		}
	}()

	require.NoError(t, a.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool {
		log, err := os.ReadFile(a.LogPath())
		return err == nil && strings.Contains(string(log), "starting again in this process")
	}, 30*time.Second, 100*time.Millisecond, "the deposed leader did not stop its manager after it lost the lease")
	exited, _ := a.Exited()
	require.False(t, exited, "the deposed leader exited")
	time.Sleep(2 * time.Second)
	mu.Lock()
	defer mu.Unlock()
	for i, v := range seen {
		require.Equal(t, int64(10), v, "status.completing written after the old leader resumed, change %d of %v", i, seen)
	}
	require.Equal(t, int64(10), completing(t, ns))
}

// TestAPauseCostsNoRelist: a process paused for 3 s (SIGSTOP) while three
// intents are set is in doubt when it runs again, and its view is fresh
// once its cache holds a version read after the pause: its pod watch stays
// open and goes on from what it held, so the pause costs no relist; a
// relist under way when the pause came goes on too, and is the only one.
// The counts are right soon after the process runs again.
func TestAPauseCostsNoRelist(t *testing.T) {
	for _, tc := range []struct {
		name string
		// relist: the pause comes while a relist, delayed so long, is
		// under way.
		relist time.Duration
	}{
		{name: "idle"},
		{name: "during a relist", relist: 6 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns, err := env.Namespace(ctx, "pause")
			require.NoError(t, err)
			leaseNS, err := env.Namespace(ctx, "lease")
			require.NoError(t, err)
			_, pods := pool(t, ns, 6)

			cfg, relists := countingRelists(env.Config)
			var breaker framework.WatchBreaker
			breaker.Wrap(cfg)
			a := startAggregatorWith(t, "paused", leaseNS, framework.ProxiedKubeconfig(t, cfg))
			a.waitReady(t)
			waitCompleting(t, ns, 0, 30*time.Second)
			before := relists.Load()

			if tc.relist > 0 {
				// The watch cannot resume (410 Gone): client-go relists,
				// and the relist's events come tc.relist after its headers.
				breaker.SlowRelists(tc.relist)
				breaker.EndWatches()
				require.Eventually(t, func() bool { return relists.Load() > before }, 10*time.Second, 10*time.Millisecond, "no relist after the watch broke")
				time.Sleep(time.Second)
			}
			require.NoError(t, a.Signal(syscall.SIGSTOP))
			markIntent(t, pods[:3])
			time.Sleep(3 * time.Second)
			require.NoError(t, a.Signal(syscall.SIGCONT))
			right := waitCompleting(t, ns, 3, 30*time.Second)
			t.Logf("paused 3 s%s: counts right %s after the process ran again", map[bool]string{true: " during a relist", false: ""}[tc.relist > 0], right.Round(10*time.Millisecond))
			time.Sleep(2 * time.Second)
			want := before
			if tc.relist > 0 {
				want++
			}
			assert.Equal(t, want, relists.Load(), "relists after the pause")
			log, err := os.ReadFile(a.LogPath())
			require.NoError(t, err)
			assert.NotContains(t, string(log), "starting again in this process", "the pause cost a new manager")
		})
	}
}

// countingRelists returns a copy of cfg that counts the pod informer's
// relists (a first page of its LIST, or a watch-list) answered 200.
func countingRelists(cfg *rest.Config) (*rest.Config, *atomic.Int64) {
	cfg = rest.CopyConfig(cfg)
	var n atomic.Int64
	selector := aggregate.PodSelector().String()
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			q := req.URL.Query()
			relist := req.URL.Path == "/api/v1/pods" && q.Get("labelSelector") == selector &&
				!strings.Contains(req.Header.Get("Accept"), "as=PartialObjectMetadata") &&
				((q.Get("watch") != "true" && q.Get("continue") == "") || q.Get("sendInitialEvents") == "true")
			resp, err := rt.RoundTrip(req)
			if relist && err == nil && resp.StatusCode == http.StatusOK {
				n.Add(1)
			}
			return resp, err
		})
	})
	return cfg, &n
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// webhookReplica starts one webhook process serving certDir's certificate
// on a free port; it returns the process and its address.
func webhookReplica(t *testing.T, name, certDir string) (*process.Process, string) {
	t.Helper()
	port, err := process.FreePort()
	require.NoError(t, err)
	probe, err := process.FreePort()
	require.NoError(t, err)
	p, err := process.Start(name, filepath.Join(bin, "webhook"), t.TempDir(),
		"--config", filepath.Join(dir, "config.yaml"), "--kubeconfig", filepath.Join(dir, "admin.kubeconfig"),
		"--cert-dir", certDir, "--host", "127.0.0.1", "--port", fmt.Sprint(port), "--shutdown-delay", "3s",
		"--metrics-bind-address", "0", "--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", probe))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(p.LogPath())
			t.Logf("%s's log:\n%s", name, log)
		}
	})
	require.NoError(t, p.WaitReady(context.Background(), fmt.Sprintf("http://127.0.0.1:%d/readyz", probe)))
	return p, fmt.Sprintf("127.0.0.1:%d", port)
}

// TestWebhookRolloutRefusesNothing: two webhook replicas behind one
// address, as behind a Service; pods are created without pause under
// failurePolicy Fail while one replica gets SIGTERM and its endpoint is
// removed a second later. No pod is refused, and every pod is stamped.
func TestWebhookRolloutRefusesNothing(t *testing.T) {
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "rollout-", Labels: map[string]string{"tally.dev/test": "rollout"}}}
	require.NoError(t, env.Client.Create(ctx, ns))
	parent := operator.Pool(ns.Name, "pool", 0)
	require.NoError(t, env.Client.Create(ctx, parent))

	ca, err := devcert.NewCA("tally ha CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	certDir := t.TempDir()
	require.NoError(t, pair.WriteDir(certDir))
	first, firstAddr := webhookReplica(t, "webhook-0", certDir)
	_, secondAddr := webhookReplica(t, "webhook-1", certDir)
	service, err := framework.NewProxy(firstAddr, secondAddr)
	require.NoError(t, err)
	t.Cleanup(service.Close)

	wh := mutate.Webhook(&config.Config{Parents: []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}}}, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To("https://" + service.Addr() + mutate.Path), CABundle: ca.CertPEM,
	}, helm.AggregatorUser)
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"tally.dev/test": "rollout"}}
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "tally-rollout"}, Webhooks: []admissionregistrationv1.MutatingWebhook{wh}}
	require.NoError(t, env.Client.Create(ctx, mwc))
	t.Cleanup(func() { _ = env.Client.Delete(ctx, mwc) })
	time.Sleep(2 * time.Second)

	var created, failed int
	var failures []string
	deadline := time.Now().Add(10 * time.Second)
	stopAt, dropAt := time.Now().Add(3*time.Second), time.Now().Add(4*time.Second)
	stopped, dropped := false, false
	for i := 0; time.Now().Before(deadline); i++ {
		if !stopped && time.Now().After(stopAt) {
			require.NoError(t, first.Signal(syscall.SIGTERM))
			stopped = true
		}
		if !dropped && time.Now().After(dropAt) {
			service.SetBackends(secondAddr) // the endpoint is removed, late
			dropped = true
		}
		pod := builder.Pod(ns.Name, fmt.Sprintf("pod-%04d", i)).ControlledBy(operator.GVK, "pool", parent.GetUID()).Build()
		if err := env.Client.Create(ctx, pod); err != nil {
			failed++
			failures = append(failures, err.Error())
			continue
		}
		created++
		require.Equal(t, string(parent.GetUID()), pod.Labels[keys.ParentUID], "pod %s not stamped", pod.Name)
	}
	t.Logf("%d pods created while a replica shut down, %d refused", created, failed)
	require.Zero(t, failed, "refused: %v", failures)
	exited, _ := first.Exited()
	require.True(t, exited, "the stopped replica is still running after its shutdown delay")
}
