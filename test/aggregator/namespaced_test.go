package aggregator

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/freshness"
	"tally.dev/tally/pkg/keys"
)

// TestNamespacedMode runs the aggregator as the chart's ServiceAccount with
// the permissions the chart grants it for a fixed list of namespaces
// (values `namespaces`), and nothing more: Roles on pods, parents and
// Events in those namespaces, a ClusterRole on namespaces only. Its counts
// must be exact in the namespaces listed; it must send no request for a pod
// or a parent elsewhere, and none may be refused.
func TestNamespacedMode(t *testing.T) {
	ctx := context.Background()
	in := []string{newNamespace(t), newNamespace(t)}
	slices.Sort(in)
	out := newNamespace(t)

	cfg, user := installNamespaced(t, in)
	require.Equal(t, in, cfg.FixedNamespaces(), "the chart's config lists the namespaces by name")
	type pool struct {
		ns, name string
		uid      types.UID
	}
	var pools []pool
	for i, ns := range append(slices.Clone(in), out) {
		p := pool{ns: ns, name: fmt.Sprintf("pool-%d", i)}
		p.uid = createParent(t, operator.GVK, p.ns, p.name)
		pools = append(pools, p)
		var pods []*corev1.Pod
		for j := range 4 {
			pods = append(pods, member(operator.GVK, ns, p.name, p.uid, fmt.Sprintf("%s-%d", p.name, j)).Build())
		}
		// One the webhook never saw (created before tally starts): the
		// sweep stamps it where tally works, and never elsewhere.
		pods = append(pods, newUnstamped(ns, p.name, p.uid))
		createAll(t, pods)
		for j, phase := range []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed} {
			require.NoError(t, setPhase(ctx, env.Client, pods[j], phase))
		}
	}
	restCfg, requests := recording(user)
	startAggregatorWith(t, cfg, restCfg)
	for _, p := range pools[:len(in)] {
		converges(t, p.ns, p.name, p.uid)
	}
	// Changes after the first sync are followed in each namespace.
	require.NoError(t, env.Client.Delete(ctx, member(operator.GVK, pools[0].ns, pools[0].name, pools[0].uid, pools[0].name+"-3").Build()))
	require.NoError(t, env.Client.Create(ctx, member(operator.GVK, pools[1].ns, pools[1].name, pools[1].uid, pools[1].name+"-4").Build()))
	for _, p := range pools[:len(in)] {
		converges(t, p.ns, p.name, p.uid)
		pod := &corev1.Pod{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: p.ns, Name: p.name + "-unstamped"}, pod))
		assert.Equal(t, string(p.uid), pod.Labels[keys.ParentUID], "the pod the webhook never saw in %s is stamped", p.ns)
	}

	// Outside the list: nothing written, nothing stamped.
	elsewhere := pools[len(in)]
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: elsewhere.ns, Name: elsewhere.name}, u))
	_, written := u.Object["status"]
	assert.False(t, written, "the status of a parent in %s, which is not listed", elsewhere.ns)
	pod := &corev1.Pod{}
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: elsewhere.ns, Name: elsewhere.name + "-unstamped"}, pod))
	assert.NotContains(t, pod.Labels, keys.ParentUID, "a pod in %s, which is not listed", elsewhere.ns)

	refused, outside := requests.check(in)
	assert.Empty(t, refused, "requests the chart's permissions refused")
	assert.Empty(t, outside, "requests for pods or parents outside %v", in)
	assert.Positive(t, requests.matching("/namespaces/"+in[0]+"/pods"), "the pods of %s were read", in[0])
}

// TestARefusedNamespaceStopsNoOther: with a fixed list of namespaces,
// one whose Role the aggregator lacks (deleted, or never created) holds
// back only its own parents. Those of the other namespaces are counted and
// written, each from its own namespace's view, and the aggregator does not
// start new managers over the refusal (a new informer would be refused
// again) while it serves the others. Once the Role is back, the refused
// namespace's parents are written, their first count including the pods the
// webhook never saw there, which only a sweep finds.
func TestARefusedNamespaceStopsNoOther(t *testing.T) {
	ctx := context.Background()
	in := []string{newNamespace(t), newNamespace(t)}
	slices.Sort(in)
	cfg, user := installNamespaced(t, in)
	refused := in[1]
	var bindings rbacv1.RoleBindingList
	require.NoError(t, env.Client.List(ctx, &bindings, client.InNamespace(refused)))
	require.NoError(t, env.Client.DeleteAllOf(ctx, &rbacv1.RoleBinding{}, client.InNamespace(refused)))
	refusedUID := createParent(t, operator.GVK, refused, "pool")
	createAll(t, []*corev1.Pod{newUnstamped(refused, "pool", refusedUID)})
	restarts := counter(t, "tally_aggregator_manager_restarts_total", "stale_view")
	restCfg, requests := recording(user)
	startAggregatorWith(t, cfg, restCfg)
	require.Eventually(t, func() bool { return requests.matching("/namespaces/"+refused+"/pods") > 0 && requests.refused() > 0 },
		30*time.Second, 100*time.Millisecond, "the pods of %s are refused", refused)

	uids := map[string]types.UID{refused: refusedUID}
	for _, ns := range in {
		if ns != refused {
			uids[ns] = createParent(t, operator.GVK, ns, "pool")
		}
		createAll(t, []*corev1.Pod{
			member(operator.GVK, ns, "pool", uids[ns], "a").Build(),
			member(operator.GVK, ns, "pool", uids[ns], "b").Build(),
		})
	}
	converges(t, in[0], "pool", uids[in[0]])
	// Past the watchdog's bound with the view of the refused namespace
	// stale: still counting, no new manager.
	time.Sleep(freshness.StallAfter + 5*time.Second)
	require.NoError(t, env.Client.Delete(ctx, member(operator.GVK, in[0], "pool", uids[in[0]], "a").Build()))
	converges(t, in[0], "pool", uids[in[0]])
	assert.Equal(t, restarts, counter(t, "tally_aggregator_manager_restarts_total", "stale_view"), "managers started again over the refusal")
	assert.Equal(t, map[config.Count]int64{config.Completing: -1, config.Completed: -1, config.Active: -1, config.Unexpected: -1},
		shown(t, operator.GVK, refused, "pool", allCounts), "the pool of the refused namespace")

	// The Role back: the first count written there includes the pod no
	// webhook stamped, which the next sweep finds (30 s after a refused
	// one), as does every count written after it.
	w := watchPools(t, refused)
	for _, b := range bindings.Items {
		b.ResourceVersion = ""
		require.NoError(t, env.Client.Create(ctx, &b))
	}
	var first map[config.Count]int64
	require.Eventually(t, func() bool {
		select {
		case ev := <-w.ResultChan():
			u, ok := ev.Object.(*unstructured.Unstructured)
			if ok && u.Object["status"] != nil {
				first = fieldsOf(u, allCounts)
				return true
			}
		default:
		}
		return false
	}, 150*time.Second, 50*time.Millisecond, "the pool of %s is written once its Role is back", refused)
	assert.Equal(t, int64(3), first[config.Active], "the first count written in %s: its two pods and the one the sweep found", refused)
}

// installNamespaced creates the aggregator's RBAC as the chart renders it
// with `namespaces: in`, and returns the chart's configuration and the
// username of the aggregator's ServiceAccount.
func installNamespaced(t *testing.T, in []string) (*config.Config, string) {
	t.Helper()
	ctx := context.Background()
	parent := helm.WorkerPool(config.Counts...)
	values, err := helm.WriteValues(t.TempDir(), []config.Parent{parent}, map[string]any{"namespaces": in})
	require.NoError(t, err)
	manifest, err := helm.Run("template", "nsmode", helm.Chart(), "--namespace", helm.Namespace, "-f", values,
		"--show-only", "templates/rbac.yaml", "--show-only", "templates/configmap.yaml")
	require.NoError(t, err)
	objs, err := helm.Objects(manifest)
	require.NoError(t, err)
	var cfg *config.Config
	var user string
	for _, obj := range objs {
		switch kind := obj.GetKind(); {
		case kind == "ConfigMap":
			data, _, _ := unstructured.NestedString(obj.Object, "data", "config.yaml")
			cfg, err = config.Parse([]byte(data))
			require.NoError(t, err)
		case kind == "ServiceAccount" && strings.HasSuffix(obj.GetName(), "-aggregator"):
			user = "system:serviceaccount:" + obj.GetNamespace() + ":" + obj.GetName()
		case strings.HasPrefix(kind, "Cluster") || slices.Contains(in, obj.GetNamespace()):
			// The bindings and roles the aggregator holds; those in the
			// release's namespace (leader election) it does not use here.
			require.NoError(t, env.Client.Create(ctx, obj), "%s %s/%s", kind, obj.GetNamespace(), obj.GetName())
			t.Cleanup(func() { _ = env.Client.Delete(context.Background(), obj) })
		}
	}
	require.NotNil(t, cfg, "the chart renders the configuration")
	require.NotEmpty(t, user, "the chart renders the aggregator's ServiceAccount")
	return cfg, user
}

// newUnstamped returns a pod the parent controls, as the webhook would
// have left it had it not been called: without tally's label.
func newUnstamped(ns, parent string, uid types.UID) *corev1.Pod {
	pod := member(operator.GVK, ns, parent, uid, parent+"-unstamped").Build()
	delete(pod.Labels, keys.ParentUID)
	return pod
}

// startAggregatorWith runs the aggregator as cmd/aggregator does, on cfg,
// until the test ends.
func startAggregatorWith(t *testing.T, cfg *config.Config, restCfg *rest.Config) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- app.Run(ctx, cfg, restCfg, app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4})
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// requestLog records every request sent through a rest.Config, with the
// status of its answer.
type requestLog struct {
	mu   sync.Mutex
	sent []sentRequest
}

type sentRequest struct {
	method, path string
	status       int
}

// recording returns a copy of env.Config that acts as user (a service
// account, in the groups every service account is in), and the log of its
// requests.
func recording(user string) (*rest.Config, *requestLog) {
	log := &requestLog{}
	cfg := rest.CopyConfig(env.Config)
	ns := strings.Split(user, ":")[2]
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			status := 0
			if err == nil {
				status = resp.StatusCode
			}
			log.mu.Lock()
			log.sent = append(log.sent, sentRequest{req.Method, req.URL.Path, status})
			log.mu.Unlock()
			return resp, err
		})
	})
	return cfg, log
}

// check returns the requests answered 403, and the requests for pods or
// WorkerPools anywhere but in the namespaces in.
func (l *requestLog) check(in []string) (refused, outside []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.sent {
		line := r.method + " " + r.path
		if r.status == http.StatusForbidden {
			refused = append(refused, line)
		}
		if !strings.HasSuffix(r.path, "/pods") && !strings.Contains(r.path, "/pods/") && !strings.Contains(r.path, "/workerpools") {
			continue
		}
		listed := false
		for _, ns := range in {
			listed = listed || strings.Contains(r.path, "/namespaces/"+ns+"/")
		}
		if !listed {
			outside = append(outside, line)
		}
	}
	return refused, outside
}

// refused counts the requests answered 403.
func (l *requestLog) refused() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.sent {
		if r.status == http.StatusForbidden {
			n++
		}
	}
	return n
}

// matching counts the requests whose path contains s.
func (l *requestLog) matching(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.sent {
		if strings.Contains(r.path, s) {
			n++
		}
	}
	return n
}

// TestStopsWhileRefused stops an aggregator whose caches cannot sync, its
// reads refused (403: a Role missing, a permission revoked): it must return
// within a bound, as it must to start a new manager after a stall.
func TestStopsWhileRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  *config.Config
	}{
		{"every namespace", &config.Config{Parents: []config.Parent{workerPools}}},
		{"a fixed list", &config.Config{Parents: []config.Parent{workerPools}, NamespaceSelector: &metav1.LabelSelector{
			MatchExpressions: []metav1.LabelSelectorRequirement{{Key: corev1.LabelMetadataName, Operator: metav1.LabelSelectorOpIn, Values: []string{"a"}}},
		}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			restCfg, requests := recording("system:serviceaccount:nowhere:nobody")
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				done <- app.Run(ctx, c.cfg, restCfg, app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 1})
			}()
			require.Eventually(t, func() bool { return requests.refused() > 0 }, 30*time.Second, 100*time.Millisecond, "the reads are refused")
			time.Sleep(2 * time.Second)
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("the aggregator did not stop within 30s of its context's end")
			}
		})
	}
}
