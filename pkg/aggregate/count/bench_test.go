package count

import (
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

func parentPod(parent string, uid types.UID, i int) *corev1.Pod {
	b := builder.Pod("ns", fmt.Sprintf("%s-%d", parent, i)).ControlledBy(operator.GVK, parent, uid).Label(keys.ParentUID, string(uid))
	if i%4 == 0 {
		b = b.Annotation(keys.CompletionIntent, "scale-down")
	}
	return b.Phase(corev1.PodRunning).Build()
}

// BenchmarkCountParent counts one parent's 100 pods while the cache holds
// 1k, 10k or 100k pods of 100-pod parents: the time must not grow with the
// other parents' pods, since the index answers "pods of P" directly.
func BenchmarkCountParent(b *testing.B) {
	for _, others := range []int{1_000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("others=%d", others), func(b *testing.B) {
			indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, Indexers)
			for p := range others / 100 {
				parent := fmt.Sprintf("other-%d", p)
				uid := types.UID(fmt.Sprintf("uid-%d", p))
				for i := range 100 {
					if err := indexer.Add(reducer.Pod(parentPod(parent, uid, i))); err != nil {
						b.Fatal(err)
					}
				}
			}
			for i := range 100 {
				if err := indexer.Add(reducer.Pod(parentPod("target", uid, i))); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				pods, err := PodsOf(indexer, uid)
				if err != nil {
					b.Fatal(err)
				}
				if c := Tally("ns", uid, pods); c.Completing != 25 || c.Active != 75 {
					b.Fatalf("counts %+v", c)
				}
			}
		})
	}
}

// customPools is the WorkerPool kind with two custom counts.
var customPools = config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", CustomCounts: []config.CustomCount{
	{Name: "ready", Path: "status.ready", Expression: `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`},
	{Name: "restarted", Path: "status.restarted", Expression: `has(pod.status.containerStatuses) && pod.status.containerStatuses.exists(s, s.restartCount > 0)`},
}}

// benchPods returns n realistic running pods of one parent, as JSON: with
// the conditions and container statuses a kubelet reports.
func benchPods(b *testing.B, n int) [][]byte {
	raw := make([][]byte, n)
	for i := range raw {
		pod := builder.RealisticPod(builder.Pod("ns", fmt.Sprintf("pool-a-%05d", i)).
			ControlledBy(operator.GVK, "pool-a", "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").
			Label(keys.ParentUID, "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").
			Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a"))
		pod.UID = types.UID(fmt.Sprintf("9d1f8c1e-0000-4000-8000-%012d", i))
		pod.ResourceVersion = fmt.Sprint(100000 + i)
		pod.Status.Phase = corev1.PodRunning
		since := metav1.NewTime(time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC))
		for _, t := range []corev1.PodConditionType{corev1.PodReadyToStartContainers, corev1.PodInitialized, corev1.PodReady, corev1.ContainersReady, corev1.PodScheduled} {
			pod.Status.Conditions = append(pod.Status.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: since})
		}
		for _, c := range pod.Spec.Containers {
			pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, Ready: true,
				RestartCount: int32(i % 3), State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: since}}})
		}
		var err error
		if raw[i], err = json.Marshal(pod); err != nil {
			b.Fatal(err)
		}
	}
	return raw
}

// BenchmarkTransform measures the informer's transform of one decoded pod:
// without custom counts, and with two (both expressions evaluated on it).
func BenchmarkTransform(b *testing.B) {
	raw := benchPods(b, 100)
	pods := make([]*corev1.Pod, len(raw))
	for i, r := range raw {
		pods[i] = &corev1.Pod{}
		if err := json.Unmarshal(r, pods[i]); err != nil {
			b.Fatal(err)
		}
	}
	withCustom := NewReducer([]config.Parent{customPools})
	for _, tc := range []struct {
		name    string
		reducer *Reducer
	}{{"no custom counts", reducer}, {"two custom counts", withCustom}} {
		b.Run(tc.name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				if _, err := tc.reducer.Transform(pods[i%len(pods)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkCachedPodMemory measures the heap a cached pod costs in an
// indexed store like the informer's: pods decoded from realistic JSON, kept
// whole or reduced by the transform, without or with two custom counts. It
// reports bytes per pod.
func BenchmarkCachedPodMemory(b *testing.B) {
	raw := benchPods(b, 20_000)
	withCustom := NewReducer([]config.Parent{customPools})
	wholeIndexers := toolscache.Indexers{ParentIndex: func(obj any) ([]string, error) {
		return []string{obj.(*corev1.Pod).Labels[keys.ParentUID]}, nil
	}}
	for _, tc := range []struct {
		name      string
		transform func(any) (any, error)
		indexers  toolscache.Indexers
	}{
		{"whole", func(o any) (any, error) { return o, nil }, wholeIndexers},
		{"reduced", reducer.Transform, Indexers},
		{"reduced, two custom counts", withCustom.Transform, Indexers},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var perPod float64
			for b.Loop() {
				perPod = cachedBytesPerPod(b, raw, tc.transform, tc.indexers)
			}
			b.ReportMetric(perPod, "B/pod")
		})
	}
}

func cachedBytesPerPod(b *testing.B, raw [][]byte, transform func(any) (any, error), indexers toolscache.Indexers) float64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, indexers)
	for _, r := range raw {
		pod := &corev1.Pod{}
		if err := json.Unmarshal(r, pod); err != nil {
			b.Fatal(err)
		}
		obj, err := transform(pod)
		if err != nil {
			b.Fatal(err)
		}
		if err := indexer.Add(obj); err != nil {
			b.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(indexer)
	return float64(after.HeapAlloc-before.HeapAlloc) / float64(len(raw))
}
