package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// steadyPhase marks pods at rate for d, and returns how long each mark took
// to reach its parent's status (tally) and to be delivered by a pod watch
// (base), measured in the same run.
func steadyPhase(ctx context.Context, env *framework.Env, parents []*parent, marked, rate int, d time.Duration) (tally, base []time.Duration, err error) {
	dyn, err := dynamic.NewForConfig(env.Config)
	if err != nil {
		return nil, nil, err
	}
	cs, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		return nil, nil, err
	}
	poolWatch, err := dyn.Resource(schema.GroupVersionResource{Group: "example.tally.dev", Version: "v1", Resource: "workerpools"}).Namespace(ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, nil, err
	}
	defer poolWatch.Stop()
	podWatch, err := cs.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, nil, err
	}
	defer podWatch.Stop()

	type pending struct {
		want int64
		at   time.Time
	}
	var mu sync.Mutex
	waiting := map[string][]pending{} // parent -> changes not yet shown
	podSent := map[string]time.Time{} // pod -> when its change was sent
	var done sync.WaitGroup
	done.Go(func() {
		for ev := range poolWatch.ResultChan() {
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok || ev.Type != watch.Modified {
				continue
			}
			now, v := time.Now(), field(u, "completed")
			mu.Lock()
			q := waiting[u.GetName()]
			for len(q) > 0 && q[0].want <= v {
				tally = append(tally, now.Sub(q[0].at))
				q = q[1:]
			}
			waiting[u.GetName()] = q
			mu.Unlock()
		}
	})
	done.Go(func() {
		for ev := range podWatch.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || p.Status.Phase != corev1.PodSucceeded {
				continue
			}
			now := time.Now()
			mu.Lock()
			if at, ok := podSent[p.Name]; ok {
				base = append(base, now.Sub(at))
				delete(podSent, p.Name)
			}
			mu.Unlock()
		}
	})

	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	next := 0
	sem := make(chan struct{}, 32)
	var inflight sync.WaitGroup
	var sendErr error
	for n := 0; time.Now().Before(end) && n < len(parents)*marked; n++ {
		<-tick.C
		p := parents[next%len(parents)]
		k := next / len(parents)
		next++
		pod := p.pods[k].DeepCopy()
		sem <- struct{}{}
		inflight.Go(func() {
			defer func() { <-sem }()
			at := time.Now()
			mu.Lock()
			waiting[p.name] = append(waiting[p.name], pending{want: int64(k + 1), at: at})
			podSent[pod.Name] = at
			mu.Unlock()
			patch := client.MergeFrom(pod.DeepCopy())
			pod.Status.Phase = corev1.PodSucceeded
			if err := env.Client.Status().Patch(ctx, pod, patch); err != nil {
				mu.Lock()
				sendErr = err
				mu.Unlock()
			}
		})
	}
	inflight.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		left := 0
		for _, q := range waiting {
			left += len(q)
		}
		mu.Unlock()
		if left == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	poolWatch.Stop()
	podWatch.Stop()
	done.Wait()
	return tally, base, sendErr
}

func mark(ctx context.Context, c client.Client, pod *corev1.Pod) error {
	p := pod.DeepCopy()
	patch := client.MergeFrom(p.DeepCopy())
	p.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
	return c.Patch(ctx, p, patch)
}

func field(u *unstructured.Unstructured, name string) int64 {
	v, _, _ := unstructured.NestedInt64(u.Object, "status", name)
	return v
}

func waitAll(ctx context.Context, c client.Client, parents []*parent, ok func(*unstructured.Unstructured) bool) error {
	deadline := time.Now().Add(5 * time.Minute)
	for time.Now().Before(deadline) {
		list := &unstructured.UnstructuredList{}
		list.SetGroupVersionKind(operator.GVK.GroupVersion().WithKind("WorkerPoolList"))
		if err := c.List(ctx, list, client.InNamespace(ns)); err != nil {
			return err
		}
		good := 0
		for i := range list.Items {
			if ok(&list.Items[i]) {
				good++
			}
		}
		if good == len(parents) {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("parents did not converge within 5 minutes")
}

func parallel(workers int, jobs []func() error) error {
	ch := make(chan func() error)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for range workers {
		wg.Go(func() {
			for job := range ch {
				if err := job(); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		})
	}
	for _, j := range jobs {
		ch <- j
	}
	close(ch)
	wg.Wait()
	return first
}

func applies() float64 {
	families, _ := ctrlmetrics.Registry.Gather()
	for _, f := range families {
		if f.GetName() == "tally_aggregator_applies_total" {
			total := 0.0
			for _, m := range f.GetMetric() {
				total += m.GetCounter().GetValue()
			}
			return total
		}
	}
	return 0
}

func pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)-1)*p/100].Round(100 * time.Microsecond)
}
