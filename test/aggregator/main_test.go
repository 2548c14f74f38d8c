// Package aggregator runs tally's aggregator in the test process against a
// real kube-apiserver. Pods are created with the identity label directly, so
// these tests do not need the webhook.
package aggregator

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

// allCounts maps every count of the WorkerPool example.
var allCounts = map[config.Count]string{
	config.Completing: "status.completing", config.Completed: "status.completed",
	config.Active: "status.active", config.Unexpected: "status.unexpected",
}

var workerPools = config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: allCounts}

// TestMain fails the suite when the aggregator logged a write conflict: it
// owns its fields through server-side apply and must never meet one.
func TestMain(m *testing.M) {
	conflicts := framework.NewConflictLog(zap.New(zap.WriteTo(os.Stderr)))
	ctrl.SetLogger(conflicts.Logger())
	code := framework.Main(m, controlplane.Options{CRDPaths: []string{repo.Path("test", "testdata", "crds")}}, &env)
	if c := conflicts.Conflicts(); len(c) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: the aggregator logged %d write conflicts:\n%s\n", len(c), strings.Join(c, "\n"))
		code = 1
	}
	os.Exit(code)
}

// aggregator is one running aggregator process.
type aggregator struct {
	cancel context.CancelFunc
	done   chan error
}

// startAggregator runs the aggregator as cmd/aggregator does, with restCfg
// (env.Config when nil), until the test ends or stop is called. with
// changes the options.
func startAggregator(t *testing.T, parents []config.Parent, restCfg *rest.Config, with ...func(*app.Options)) *aggregator {
	t.Helper()
	if restCfg == nil {
		restCfg = env.Config
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := &aggregator{cancel: cancel, done: make(chan error, 1)}
	opts := app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4}
	for _, w := range with {
		w(&opts)
	}
	go func() {
		a.done <- app.Run(ctx, &config.Config{Parents: parents}, restCfg, opts)
	}()
	t.Cleanup(a.stop)
	return a
}

func (a *aggregator) stop() {
	if a.cancel == nil {
		return
	}
	a.cancel()
	<-a.done
	a.cancel = nil
}

// requestCounter counts the requests sent through a rest.Config.
type requestCounter struct {
	mu    sync.Mutex
	count map[string]int
}

// counting returns a copy of env.Config whose requests are counted by
// "<METHOD> <path>[ watch]".
func counting() (*rest.Config, *requestCounter) {
	rc := &requestCounter{count: map[string]int{}}
	cfg := rest.CopyConfig(env.Config)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			key := req.Method + " " + req.URL.Path
			if req.URL.Query().Get("watch") == "true" {
				key += " watch"
			}
			// The freshness barrier's watches last seconds; an
			// informer's, minutes.
			if s, err := strconv.Atoi(req.URL.Query().Get("timeoutSeconds")); err == nil && s < 60 {
				key += " short"
			}
			rc.mu.Lock()
			rc.count[key]++
			rc.mu.Unlock()
			return rt.RoundTrip(req)
		})
	})
	return cfg, rc
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// matching sums the counts of the keys that contain every substring.
func (rc *requestCounter) matching(substrings ...string) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	n := 0
	for k, v := range rc.count {
		all := true
		for _, s := range substrings {
			all = all && strings.Contains(k, s)
		}
		if all {
			n += v
		}
	}
	return n
}

func newNamespace(t *testing.T) string {
	t.Helper()
	ns, err := env.Namespace(context.Background(), "agg")
	require.NoError(t, err)
	return ns
}

func createParent(t *testing.T, gvk schema.GroupVersionKind, ns, name string) types.UID {
	t.Helper()
	u := operator.Pool(ns, name, 0)
	u.SetGroupVersionKind(gvk)
	require.NoError(t, env.Client.Create(context.Background(), u))
	return u.GetUID()
}

// member returns a pod of the parent, labelled as the webhook would.
func member(gvk schema.GroupVersionKind, ns, parent string, uid types.UID, name string) *builder.PodBuilder {
	return builder.Pod(ns, name).ControlledBy(gvk, parent, uid).Label(keys.ParentUID, string(uid))
}

// createAll creates pods with a few workers in parallel.
func createAll(t *testing.T, pods []*corev1.Pod) {
	t.Helper()
	var wg sync.WaitGroup
	var failed atomic.Value
	next := make(chan *corev1.Pod)
	for range 8 {
		wg.Go(func() {
			for pod := range next {
				if err := env.Client.Create(context.Background(), pod); err != nil {
					failed.Store(err)
				}
			}
		})
	}
	for _, p := range pods {
		next <- p
	}
	close(next)
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		require.NoError(t, err)
	}
}

// setPhase moves a pod to phase, as the kubelet would.
func setPhase(ctx context.Context, c client.Client, pod *corev1.Pod, phase corev1.PodPhase) error {
	patch := client.MergeFrom(pod.DeepCopy())
	pod.Status.Phase = phase
	return c.Status().Patch(ctx, pod, patch)
}

// listTruth computes the counts of a parent from a fresh List, straight from the
// specification's definitions.
func listTruth(t *testing.T, ns string, uid types.UID) map[config.Count]int64 {
	t.Helper()
	var pods corev1.PodList
	require.NoError(t, env.Client.List(context.Background(), &pods, client.InNamespace(ns)))
	return truth.Counts(pods.Items, ns, uid)
}

// shown reads the mapped fields a parent shows; a missing field reads -1.
func shown(t *testing.T, gvk schema.GroupVersionKind, ns, name string, counts map[config.Count]string) map[config.Count]int64 {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(gvk)
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, u))
	return fieldsOf(u, counts)
}

func fieldsOf(u *unstructured.Unstructured, counts map[config.Count]string) map[config.Count]int64 {
	got := map[config.Count]int64{}
	for c, path := range counts {
		v, found, err := unstructured.NestedInt64(u.Object, strings.Split(path, ".")...)
		if !found || err != nil {
			v = -1
		}
		got[c] = v
	}
	return got
}

// watchPools watches the WorkerPools of ns (every status written) until
// the test ends.
func watchPools(t *testing.T, ns string) watch.Interface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(env.Config)
	require.NoError(t, err)
	w, err := dyn.Resource(schema.GroupVersionResource{Group: "example.tally.dev", Version: "v1", Resource: "workerpools"}).
		Namespace(ns).Watch(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	return w
}

// converges waits until the parent shows its true counts.
func converges(t *testing.T, ns, name string, uid types.UID) {
	t.Helper()
	var want, got map[config.Count]int64
	ok := waitFor(60*time.Second, func() bool {
		want = listTruth(t, ns, uid)
		got = shown(t, operator.GVK, ns, name, allCounts)
		return equal(want, got)
	})
	require.True(t, ok, "status of %s/%s: got %v, want %v", ns, name, got, want)
}

func equal(a, b map[config.Count]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}
