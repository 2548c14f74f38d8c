package aggregator

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

const hold = "test.tally.dev/hold"

// TestNoLostUpdates runs the workload of the problem statement against the
// aggregator: concurrent intent marking, pod completion, deletion of
// completed pods, unexpected deletions and another writer of the parent's
// status. At quiescence every count equals the truth, on every run.
func TestNoLostUpdates(t *testing.T) {
	startAggregator(t, []config.Parent{workerPools}, nil)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for i := range 20 {
		t.Run(fmt.Sprintf("run-%02d", i), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, uint64(i)))
			ns := newNamespace(t)
			uid := createParent(t, builder.WorkerPoolGVK, ns, "pool")
			pods := make([]*corev1.Pod, 60)
			for j := range pods {
				b := member(builder.WorkerPoolGVK, ns, "pool", uid, fmt.Sprintf("w-%02d", j))
				if j%2 == 0 {
					b = b.Finalizer(hold)
				}
				pods[j] = b.Build()
			}
			createAll(t, pods)
			churn(t, rng, ns, pods)
			converges(t, ns, "pool", uid)
		})
	}
}

// churn runs the concurrent handlers of the problem statement to completion.
func churn(t *testing.T, rng *rand.Rand, ns string, pods []*corev1.Pod) {
	ctx := context.Background()
	order := rng.Perm(len(pods))
	marked, unmarked := order[:40], order[40:]
	deleted, failed := unmarked[:10], unmarked[10:13]
	succeed := make(map[int]bool)
	for _, j := range marked {
		succeed[j] = rng.IntN(10) < 6
	}

	var errs sync.Map
	report := func(what string, err error) {
		if err != nil {
			errs.Store(what, err)
		}
	}
	exiting := make(chan int, len(pods))
	completed := make(chan int, len(pods))
	var wg sync.WaitGroup

	// The timer: marks pods with a completion intent, in random order.
	wg.Go(func() {
		defer close(exiting)
		for _, j := range marked {
			p := pods[j].DeepCopy()
			patch := client.MergeFrom(p.DeepCopy())
			p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
			report("mark "+p.Name, env.Client.Patch(ctx, p, patch))
			exiting <- j
		}
	})
	// The kubelet: some exiting pods finish.
	wg.Go(func() {
		defer close(completed)
		for j := range exiting {
			if succeed[j] {
				report("complete "+pods[j].Name, setPhase(ctx, env.Client, pods[j].DeepCopy(), corev1.PodSucceeded))
				completed <- j
			}
		}
	})
	// The completion handler: deletes completed pods.
	wg.Go(func() {
		for j := range completed {
			report("delete completed "+pods[j].Name, env.Client.Delete(ctx, pods[j].DeepCopy()))
		}
	})
	// Unexpected deletions and failures of pods without intent.
	for _, part := range [][]int{deleted[:5], deleted[5:]} {
		wg.Go(func() {
			for _, j := range part {
				report("delete "+pods[j].Name, env.Client.Delete(ctx, pods[j].DeepCopy()))
			}
		})
	}
	wg.Go(func() {
		for _, j := range failed {
			report("fail "+pods[j].Name, setPhase(ctx, env.Client, pods[j].DeepCopy(), corev1.PodFailed))
		}
	})
	// Another field manager keeps writing an unrelated status field.
	stop := make(chan struct{})
	var other sync.WaitGroup
	other.Go(func() {
		for gen := int64(1); ; gen++ {
			select {
			case <-stop:
				return
			default:
			}
			u := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "example.tally.dev/v1", "kind": "WorkerPool",
				"metadata": map[string]any{"name": "pool", "namespace": ns},
				"status":   map[string]any{"observedGeneration": gen},
			}}
			report("operator status", env.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner("operator")))
		}
	})
	wg.Wait()
	close(stop)
	other.Wait()
	errs.Range(func(k, v any) bool {
		t.Errorf("%s: %v", k, v)
		return true
	})
}

// naiveCounter is the design tally replaces: handlers keep status.completing
// by reading the parent and merge-patching the incremented or decremented
// value. betweenReadAndWrite runs after the read.
type naiveCounter struct {
	ns, name            string
	betweenReadAndWrite func()
}

func (n *naiveCounter) add(ctx context.Context, delta int64) error {
	u := builder.WorkerPool(n.ns, n.name, 0)
	if err := env.Client.Get(ctx, client.ObjectKeyFromObject(u), u); err != nil {
		return err
	}
	v, _, _ := unstructured.NestedInt64(u.Object, "status", "completing")
	n.betweenReadAndWrite()
	patch := []byte(fmt.Sprintf(`{"status":{"completing":%d}}`, v+delta))
	return env.Client.Status().Patch(ctx, u, client.RawPatch(types.MergePatchType, patch), client.FieldOwner("naive-operator"))
}

// TestNaiveCounterLosesUpdates shows why tally exists. A scale-down timer
// marks pod A (+1) while the deletion handler of completed pod B runs (-1).
// Both read before either writes, an interleaving the two handlers reach
// whenever they run at once, here made certain: one update is lost and the
// counter is wrong. The aggregator, started on the same pods, writes the
// truth.
func TestNaiveCounterLosesUpdates(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, builder.WorkerPoolGVK, ns, "pool")
	a := member(builder.WorkerPoolGVK, ns, "pool", uid, "a").Build()
	b := member(builder.WorkerPoolGVK, ns, "pool", uid, "b").Annotation(keys.CompletionIntent, "scale-down").Build()
	createAll(t, []*corev1.Pod{a, b})

	naive := &naiveCounter{ns: ns, name: "pool", betweenReadAndWrite: func() {}}
	require.NoError(t, naive.add(ctx, 1)) // B was marked earlier: completing = 1.

	// Both handlers read before either writes.
	var read sync.WaitGroup
	read.Add(2)
	naive.betweenReadAndWrite = func() {
		read.Done()
		read.Wait()
	}

	// B completes and is deleted; A is marked. The two handlers run at once.
	require.NoError(t, setPhase(ctx, env.Client, b, corev1.PodSucceeded))
	require.NoError(t, env.Client.Delete(ctx, b))
	patch := client.MergeFrom(a.DeepCopy())
	a.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
	require.NoError(t, env.Client.Patch(ctx, a, patch))
	var wg sync.WaitGroup
	var errA, errB error
	wg.Go(func() { errA = naive.add(ctx, 1) })  // the timer, for A
	wg.Go(func() { errB = naive.add(ctx, -1) }) // the deletion handler, for B
	wg.Wait()
	require.NoError(t, errA)
	require.NoError(t, errB)

	want := truth(t, ns, uid)[config.Completing]
	require.Equal(t, int64(1), want)
	got := shown(t, builder.WorkerPoolGVK, ns, "pool", allCounts)[config.Completing]
	assert.NotEqual(t, want, got, "the naive counter should have lost an update")
	t.Logf("naive status.completing = %d, truth = %d", got, want)

	startAggregator(t, []config.Parent{workerPools}, nil)
	converges(t, ns, "pool", uid)
}
