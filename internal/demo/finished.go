package demo

import (
	"context"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// Finished records, from a watch of a namespace's pods, every pod that ever
// finished (terminal, or being deleted) with the total it belongs to: the
// truth the totals are compared with, kept apart from tally.
type Finished struct {
	mu  sync.Mutex
	uid map[types.UID]config.Count
}

// WatchFinished starts recording the finished pods of namespace ns until
// ctx is done, and waits for the first list.
func WatchFinished(ctx context.Context, cfg *rest.Config, ns string) (*Finished, error) {
	informer, err := podInformer(cfg, ns)
	if err != nil {
		return nil, err
	}
	f := &Finished{uid: map[types.UID]config.Count{}}
	_, err = informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { f.record(obj, false) },
		UpdateFunc: func(_, obj any) { f.record(obj, false) },
		DeleteFunc: func(obj any) { f.record(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	go informer.RunWithContext(ctx)
	toolscache.WaitForCacheSync(ctx.Done(), informer.HasSynced)
	return f, nil
}

// podInformer returns an informer of the pods of namespace ns, not
// started.
func podInformer(cfg *rest.Config, ns string) (toolscache.SharedIndexInformer, error) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	pods := cs.CoreV1().Pods(ns)
	return toolscache.NewSharedIndexInformer(&toolscache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return pods.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return pods.Watch(ctx, o)
		},
	}, &corev1.Pod{}, 0, toolscache.Indexers{}), nil
}

func (f *Finished) record(obj any, deleted bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	if !deleted && !terminal && pod.DeletionTimestamp == nil {
		return
	}
	total := config.UnexpectedTotal
	if _, intent := pod.Annotations[keys.CompletionIntent]; intent {
		total = config.CompletedTotal
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, seen := f.uid[pod.UID]; !seen {
		f.uid[pod.UID] = total
	}
}

// Totals returns how many pods finished in each total.
func (f *Finished) Totals() map[config.Count]int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[config.Count]int64{config.CompletedTotal: 0, config.UnexpectedTotal: 0}
	for _, total := range f.uid {
		out[total]++
	}
	return out
}

// Of returns the total the pod with uid was recorded in, if it finished.
func (f *Finished) Of(uid types.UID) (config.Count, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	total, ok := f.uid[uid]
	return total, ok
}
