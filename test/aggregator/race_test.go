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

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
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
			uid := createParent(t, operator.GVK, ns, "pool")
			pods := make([]*corev1.Pod, 60)
			for j := range pods {
				b := member(operator.GVK, ns, "pool", uid, fmt.Sprintf("w-%02d", j))
				if j%2 == 0 {
					b = b.Finalizer(hold)
				}
				pods[j] = b.Build()
			}
			createAll(t, pods)
			churn(t, rng, ns, pods, handlers{})
			converges(t, ns, "pool", uid)
		})
	}
}

// handlers are the naive operator's counter updates, called by the churn
// when the timer has marked a pod (nth from 0) and when the kubelet has
// completed a marked pod (nth from 0). Nil handlers do nothing.
type handlers struct {
	marked, completed func(nth int)
}

// churn runs the concurrent handlers of the problem statement to completion.
// The first marked pod always completes.
func churn(t *testing.T, rng *rand.Rand, ns string, pods []*corev1.Pod, h handlers) {
	ctx := context.Background()
	order := rng.Perm(len(pods))
	marked, unmarked := order[:40], order[40:]
	deleted, failed := unmarked[:10], unmarked[10:13]
	succeed := make(map[int]bool)
	for _, j := range marked {
		succeed[j] = rng.IntN(10) < 6
	}
	succeed[marked[0]] = true
	if h.marked == nil {
		h.marked = func(int) {}
	}
	if h.completed == nil {
		h.completed = func(int) {}
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
		for n, j := range marked {
			p := pods[j].DeepCopy()
			patch := client.MergeFrom(p.DeepCopy())
			p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
			report("mark "+p.Name, env.Client.Patch(ctx, p, patch))
			exiting <- j
			h.marked(n)
		}
	})
	// The kubelet: some exiting pods finish.
	wg.Go(func() {
		defer close(completed)
		n := 0
		for j := range exiting {
			if succeed[j] {
				report("complete "+pods[j].Name, setPhase(ctx, env.Client, pods[j].DeepCopy(), corev1.PodSucceeded))
				completed <- j
				h.completed(n)
				n++
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
// value.
type naiveCounter struct {
	ns, name string
}

func (n *naiveCounter) read(ctx context.Context) (int64, error) {
	u := operator.Pool(n.ns, n.name, 0)
	if err := env.Client.Get(ctx, client.ObjectKeyFromObject(u), u); err != nil {
		return 0, err
	}
	v, _, err := unstructured.NestedInt64(u.Object, "status", "completing")
	return v, err
}

func (n *naiveCounter) write(ctx context.Context, v int64) error {
	u := operator.Pool(n.ns, n.name, 0)
	patch := fmt.Appendf(nil, `{"status":{"completing":%d}}`, v)
	return env.Client.Status().Patch(ctx, u, client.RawPatch(types.MergePatchType, patch), client.FieldOwner("naive-operator"))
}

// TestNaiveCounterLosesUpdates runs the naive design under the same
// workload: the timer adds one for each pod it marks, the pod-completion
// handler subtracts one for each marked pod that finishes. Every update is
// a read-modify-write, serialised with the others except for one pair: the
// completion handler's first update reads, one update of the timer runs
// whole, then the completion handler writes, as the two handlers do whenever
// they run at once. The timer's update is lost and the counter ends one
// short of the truth, on every run. The aggregator, started afterwards on
// the same pods, writes the truth.
func TestNaiveCounterLosesUpdates(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	uid := createParent(t, operator.GVK, ns, "pool")
	pods := make([]*corev1.Pod, 60)
	for j := range pods {
		pods[j] = member(operator.GVK, ns, "pool", uid, fmt.Sprintf("w-%02d", j)).Build()
	}
	createAll(t, pods)

	naive := &naiveCounter{ns: ns, name: "pool"}
	var serial sync.Mutex
	var errs []error
	add := func(delta int64) {
		serial.Lock()
		defer serial.Unlock()
		v, err := naive.read(ctx)
		if err == nil {
			err = naive.write(ctx, v+delta)
		}
		errs = append(errs, err)
	}
	// The timer's update for its partner-th mark races the completion
	// handler's first update: the handler reads, the timer's update runs
	// whole, the handler writes.
	timerReady, completionRead, timerWrote := make(chan struct{}), make(chan struct{}), make(chan struct{})
	const partner = 20
	h := handlers{
		marked: func(n int) {
			if n != partner {
				add(1)
				return
			}
			close(timerReady)
			<-completionRead
			add(1)
			close(timerWrote)
		},
		completed: func(n int) {
			if n != 0 {
				add(-1)
				return
			}
			<-timerReady
			serial.Lock()
			v, err := naive.read(ctx)
			serial.Unlock()
			close(completionRead)
			<-timerWrote
			serial.Lock()
			defer serial.Unlock()
			if err == nil {
				err = naive.write(ctx, v-1)
			}
			errs = append(errs, err)
		},
	}
	churn(t, rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0)), ns, pods, h)
	for _, err := range errs {
		require.NoError(t, err)
	}

	want := listTruth(t, ns, uid)[config.Completing]
	got, err := naive.read(ctx)
	require.NoError(t, err)
	t.Logf("naive status.completing = %d, truth = %d", got, want)
	assert.Equal(t, want-1, got, "the naive counter should have lost exactly the timer's update")

	startAggregator(t, []config.Parent{workerPools}, nil)
	converges(t, ns, "pool", uid)
}
