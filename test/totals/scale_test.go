package totals

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// TestBigParentCostsWhatChanges: a pool of 2,000 running pods admitted
// while its kind kept no totals opts in to them. Its counts are right while
// its pods are still being given the finalizer, and a change meanwhile is
// counted between two batches of finalizers, not after all of them (a
// reconcile adds at most 100, at a client limit of 100 a second). Each pod
// that then finishes costs a read of that pod, never a list of the pool's
// pods.
func TestBigParentCostsWhatChanges(t *testing.T) {
	framework.Long(t)
	const n = 2000
	ns := namespace(t)
	ctx := context.Background()
	startWebhook(t, ns, withoutTotals)
	pool := operator.Pool(ns, "big", n)
	require.NoError(t, env.Client.Create(ctx, pool))
	pods := make([]*corev1.Pod, n)
	var wg sync.WaitGroup
	work := make(chan int)
	for range 8 {
		wg.Go(func() {
			for i := range work {
				pods[i] = builder.Pod(ns, fmt.Sprintf("big-%04d", i)).ControlledBy(operator.GVK, "big", pool.GetUID()).Build()
				assert.NoError(t, env.Client.Create(ctx, pods[i]))
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	require.Empty(t, withFinalizer(t, ns))
	// Once the aggregator has stopped (cleanups run last first), the pods
	// go: the next tests' aggregators would have them to release.
	t.Cleanup(func() { removeAll(t, ns) })

	port, err := process.FreePort()
	require.NoError(t, err)
	startAggregator(t, "aggregator", withTotals, "", "--metrics-bind-address", fmt.Sprintf("127.0.0.1:%d", port), "--kube-api-qps", "100")
	require.Eventually(t, func() bool { return status(t, ns, "big", "active") == n }, 30*time.Second, 50*time.Millisecond)
	tracked := len(withFinalizer(t, ns))
	assert.Less(t, tracked, n, "the counts were written before the finalizers were all added")
	t.Logf("counts right with %d of %d pods tracked", tracked, n)
	intent := fmt.Sprintf(`{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent)
	require.NoError(t, env.Client.Patch(ctx, pods[n-1].DeepCopy(), client.RawPatch(types.MergePatchType, []byte(intent))))
	require.Eventually(t, func() bool { return status(t, ns, "big", "completing") == 1 }, 30*time.Second, 50*time.Millisecond)
	tracked = len(withFinalizer(t, ns))
	assert.Less(t, tracked, n/2, "a change during the opt-in waits for one batch of finalizers, not for all of them")
	t.Logf("an intent set meanwhile counted with %d of %d pods tracked", tracked, n)
	require.Eventually(t, func() bool { return len(withFinalizer(t, ns)) == n }, 2*time.Minute, 200*time.Millisecond)

	metrics := func() (lists, reads float64) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		require.NoError(t, err)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			name, value, _ := strings.Cut(sc.Text(), " ")
			v, _ := strconv.ParseFloat(value, 64)
			switch {
			case strings.HasPrefix(name, "tally_aggregator_ledger_live_lists_total{"):
				lists += v
			case strings.HasPrefix(name, "tally_aggregator_ledger_live_reads_total{"):
				reads += v
			}
		}
		return lists, reads
	}
	const finished = 20
	for _, p := range pods[:finished] {
		require.NoError(t, finish(ctx, p, failed, false))
		time.Sleep(100 * time.Millisecond)
	}
	require.Eventually(t, func() bool {
		_, unexpected, ledger := totals(t, ns, "big")
		return unexpected == finished && ledger == 0
	}, time.Minute, 100*time.Millisecond)
	lists, reads := metrics()
	assert.Zero(t, lists, "no list of the pool's pods")
	assert.GreaterOrEqual(t, reads, float64(finished))
	assert.LessOrEqual(t, reads, float64(2*finished), "about one read per finished pod")
	assert.Len(t, withFinalizer(t, ns), n-finished)
}

// status reads one of a pool's status fields.
func status(t *testing.T, ns, name, field string) int64 {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, u))
	v, _, _ := unstructured.NestedInt64(u.Object, "status", field)
	return v
}

// removeAll removes the tracking finalizer from every pod of ns and deletes
// them.
func removeAll(t *testing.T, ns string) {
	ctx := context.Background()
	var pods corev1.PodList
	require.NoError(t, env.Client.List(ctx, &pods, client.InNamespace(ns)))
	var wg sync.WaitGroup
	work := make(chan *corev1.Pod)
	for range 8 {
		wg.Go(func() {
			for p := range work {
				patch := client.RawPatch(types.StrategicMergePatchType, aggregate.ReleasePatch(p.UID))
				if err := env.Client.Patch(ctx, p, patch); err != nil && !apierrors.IsNotFound(err) {
					t.Errorf("releasing %s: %v", p.Name, err)
				}
			}
		})
	}
	for i := range pods.Items {
		work <- &pods.Items[i]
	}
	close(work)
	wg.Wait()
	require.NoError(t, env.Client.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns), client.GracePeriodSeconds(0)))
}
