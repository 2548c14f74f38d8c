// Package completeness runs the webhook and the aggregator together against
// a real kube-apiserver, the way a live cluster meets them: pods that
// existed before tally was installed, pods admitted while the webhook was
// down, and the aggregator running as the service account that the webhook
// registration exempts and the chart's policy fences.
package completeness

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
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
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/certs/devcert"
	aggregatorapp "tally.dev/tally/cmd/aggregator/app"
	webhookapp "tally.dev/tally/cmd/webhook/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	// aggregatorConfig reaches the API server as helm.AggregatorUser.
	aggregatorConfig *rest.Config
)

var allCounts = map[config.Count]string{
	config.Completing: "status.completing", config.Completed: "status.completed",
	config.Active: "status.active", config.Unexpected: "status.unexpected",
}

var workerPools = []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Resource: "workerpools", Counts: allCounts}}

func TestMain(m *testing.M) {
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	os.Exit(framework.Main(m, controlplane.Options{}, &env, func(e *framework.Env) error {
		user, err := e.AggregatorIdentity()
		if err != nil {
			return err
		}
		aggregatorConfig = user.Config()
		return helm.InstallPolicies(context.Background(), e.Client)
	}))
}

// namespace creates a namespace that only this test's webhook registration
// selects.
func namespace(t *testing.T) string { return env.WebhookNamespace(t, "c") }

// webhook is one webhook process serving TLS on a fixed port, which can be
// stopped and started again.
type webhook struct {
	port    int
	certDir string
	ca      *devcert.CA
	cancel  context.CancelFunc
	done    chan struct{}
	// parents are the kinds it tracks: workerPools unless set.
	parents []config.Parent
}

func newWebhook(t *testing.T) *webhook {
	t.Helper()
	ca, err := devcert.NewCA("tally completeness CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	w := &webhook{ca: ca, certDir: t.TempDir()}
	require.NoError(t, pair.WriteDir(w.certDir))
	w.port, err = process.FreePort()
	require.NoError(t, err)
	t.Cleanup(w.stop)
	return w
}

func (w *webhook) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel, w.done = cancel, make(chan struct{})
	go func() {
		defer close(w.done)
		parents := w.parents
		if parents == nil {
			parents = workerPools
		}
		err := webhookapp.Run(ctx, &config.Config{Parents: parents}, env.Config,
			webhookapp.Options{Host: "127.0.0.1", Port: w.port, CertDir: w.certDir, MetricsAddr: "0", ProbeAddr: "0"})
		if err != nil && ctx.Err() == nil {
			t.Errorf("webhook stopped: %v", err)
		}
	}()
	wait, cancelWait := context.WithTimeout(ctx, 30*time.Second)
	defer cancelWait()
	require.NoError(t, framework.WaitForTLS(wait, "127.0.0.1", w.port, w.ca.CertPEM))
}

func (w *webhook) stop() {
	if w.cancel == nil {
		return
	}
	w.cancel()
	<-w.done
	w.cancel = nil
}

// register registers w for the namespace ns, as the chart does.
func (w *webhook) register(t *testing.T, ns string, policy admissionregistrationv1.FailurePolicyType) {
	t.Helper()
	env.RegisterWebhook(t, &config.Config{Parents: workerPools}, admissionregistrationv1.WebhookClientConfig{
		URL:      ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", w.port, mutate.Path)),
		CABundle: w.ca.CertPEM,
	}, ns, policy)
	// The API server picks registrations up asynchronously.
	time.Sleep(2 * time.Second)
}

// startAggregator runs the aggregator as helm.AggregatorUser until the
// test ends.
func startAggregator(t *testing.T, ns string, backfill time.Duration, verifyOwner bool) {
	t.Helper()
	runAggregator(t, &config.Config{Parents: workerPools, VerifyOwner: verifyOwner, NamespaceSelector: only(ns)},
		aggregatorapp.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: backfill, QPS: 50, Burst: 100})
}

// only selects namespace ns: an aggregator of one test sweeps and tracks
// its pods alone, not the pods the package's other tests left, which its
// config may stamp differently (its sweep would take their time).
func only(ns string) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
		{Key: corev1.LabelMetadataName, Operator: metav1.LabelSelectorOpIn, Values: []string{ns}},
	}}
}

// runAggregator runs the aggregator with cfg and opts as
// helm.AggregatorUser until the test ends.
func runAggregator(t *testing.T, cfg *config.Config, opts aggregatorapp.Options) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := aggregatorapp.Run(ctx, cfg, aggregatorConfig, opts)
		if err != nil {
			t.Errorf("aggregator stopped: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

func createPool(t *testing.T, ns, name string) types.UID {
	t.Helper()
	pool := operator.Pool(ns, name, 1)
	require.NoError(t, env.Client.Create(context.Background(), pool))
	return pool.GetUID()
}

// podsOf returns n pods of a parent in every state the counts tell apart,
// carrying no tally label: as an operator creates them.
func podsOf(ns, parent string, uid types.UID, from, n int) []*corev1.Pod {
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = builder.Pod(ns, fmt.Sprintf("%s-%03d", parent, from+i)).ControlledBy(operator.GVK, parent, uid).Mixed(i).Build()
	}
	return pods
}

// createAll creates pods, with c, four at a time, and sets the phases they
// carry as the kubelet would.
func createAll(t *testing.T, c client.Client, pods []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, len(pods))
	work := make(chan *corev1.Pod)
	for range 4 {
		wg.Go(func() {
			for p := range work {
				phase := p.Status.Phase
				p = p.DeepCopy()
				if err := c.Create(ctx, p); err != nil {
					errs <- err
					continue
				}
				if phase != "" {
					p.Status.Phase = phase
					if err := c.Status().Update(ctx, p); err != nil {
						errs <- err
					}
				}
			}
		})
	}
	for _, p := range pods {
		work <- p
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

func listTruth(t *testing.T, ns string, uid types.UID) map[config.Count]int64 {
	t.Helper()
	var pods corev1.PodList
	require.NoError(t, env.Client.List(context.Background(), &pods, client.InNamespace(ns)))
	return truth.Counts(pods.Items, ns, uid)
}

func shown(t *testing.T, ns, name string) map[config.Count]int64 {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, u))
	return fieldsOf(u)
}

func fieldsOf(u *unstructured.Unstructured) map[config.Count]int64 {
	got := map[config.Count]int64{}
	for c, path := range allCounts {
		v, found, err := unstructured.NestedInt64(u.Object, strings.Split(path, ".")...)
		if !found || err != nil {
			v = -1
		}
		got[c] = v
	}
	return got
}

// converges waits up to timeout until the parent shows its true counts.
func converges(t *testing.T, ns, name string, uid types.UID, timeout time.Duration) {
	t.Helper()
	var want, got map[config.Count]int64
	deadline := time.Now().Add(timeout)
	for {
		want, got = listTruth(t, ns, uid), shown(t, ns, name)
		if fmt.Sprint(want) == fmt.Sprint(got) {
			return
		}
		require.True(t, time.Now().Before(deadline), "status of %s/%s: got %v, want %v", ns, name, got, want)
		time.Sleep(100 * time.Millisecond)
	}
}

// unstamped returns the pods of ns whose parent UID label does not carry
// their controller's UID.
func unstamped(t *testing.T, ns string) []string {
	t.Helper()
	var pods corev1.PodList
	require.NoError(t, env.Client.List(context.Background(), &pods, client.InNamespace(ns)))
	var out []string
	for _, p := range pods.Items {
		if ref := metav1.GetControllerOf(&p); ref != nil && p.Labels[keys.ParentUID] != string(ref.UID) {
			out = append(out, p.Name)
		}
	}
	return out
}

// stamps waits until every pod of ns carries its controller's identity:
// the counts come first, the stamps follow at the client's rate.
func stamps(t *testing.T, ns string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(unstamped(t, ns)) == 0 }, 60*time.Second, 100*time.Millisecond,
		"pods left unstamped")
}

// recorder records every status a namespace's parents show, as watched.
type recorder struct {
	mu      sync.Mutex
	written map[string][]map[config.Count]int64
}

func record(t *testing.T, ns string) *recorder {
	t.Helper()
	dyn, err := dynamic.NewForConfig(env.Config)
	require.NoError(t, err)
	w, err := dyn.Resource(operator.GVK.GroupVersion().WithResource("workerpools")).Namespace(ns).Watch(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	r := &recorder{written: map[string][]map[config.Count]int64{}}
	go func() {
		for ev := range w.ResultChan() {
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			if _, found, _ := unstructured.NestedMap(u.Object, "status"); !found {
				continue
			}
			r.mu.Lock()
			r.written[u.GetName()] = append(r.written[u.GetName()], fieldsOf(u))
			r.mu.Unlock()
		}
	}()
	return r
}

// allTrue checks that each parent in uids (by name) was written at least
// once, and that every value written is its true count now.
func (r *recorder) allTrue(t *testing.T, ns string, uids map[string]types.UID) {
	t.Helper()
	for name, uid := range uids {
		want := listTruth(t, ns, uid)
		got := r.of(name)
		require.NotEmpty(t, got, name)
		for i, g := range got {
			assert.Equal(t, want, g, "status write %d of %s", i, name)
		}
	}
}

func (r *recorder) of(name string) []map[config.Count]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]map[config.Count]int64(nil), r.written[name]...)
}
