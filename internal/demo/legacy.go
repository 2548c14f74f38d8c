package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

// legacyCounter keeps a pool's completing count the old way, beside tally
// in shadow mode: as the operators tally was built for, with two handlers
// that each read the counter and patch it back, one more when the
// scale-down marks a pod, one less when a marked pod finishes. Like a
// Kopf operator's, the handlers of different pods run at once, and take a
// moment between their read and their write (other API calls). Their merge
// patches meet no conflict, so updates get lost: the drift tally's shadow
// mode reports.
type legacyCounter struct {
	client client.Client
	// path is the field the counter keeps (the pool kind's compare).
	path []string
	ctx  context.Context
	// informed is closed once the pod informer has stopped.
	informed chan struct{}
	mu       sync.Mutex
	// pending counts the handlers that have not written yet.
	pending int
	rng     *rand.Rand
	// marked and ended are the pods whose mark, and whose end, were
	// counted.
	marked, ended map[types.UID]bool
}

// startLegacyCounter starts a counter at path of the demo pool, fed by a
// watch of the demo namespace's pods, until ctx is done.
func startLegacyCounter(ctx context.Context, cfg *rest.Config, c client.Client, path string, seed uint64) (*legacyCounter, error) {
	informer, err := podInformer(cfg, Namespace)
	if err != nil {
		return nil, err
	}
	l := &legacyCounter{client: c, path: strings.Split(path, "."), ctx: ctx, informed: make(chan struct{}),
		rng: rand.New(rand.NewPCG(seed, 3)), marked: map[types.UID]bool{}, ended: map[types.UID]bool{}}
	_, err = informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { l.observe(obj, false) },
		UpdateFunc: func(_, obj any) { l.observe(obj, false) },
		DeleteFunc: func(obj any) { l.observe(obj, true) },
	})
	if err != nil {
		return nil, err
	}
	go func() {
		defer close(l.informed)
		informer.RunWithContext(ctx)
	}()
	if !toolscache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil, errors.New("the old counter's pod watch never synced")
	}
	return l, nil
}

// observe runs the handler a pod's change calls for, in a goroutine of its
// own: +1 when the pod is first seen marked and running, -1 when a pod
// counted so ends (terminal, being deleted, or gone). Once the counter is
// stopped, it starts none.
func (l *legacyCounter) observe(obj any, deleted bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	_, marked := pod.Annotations[keys.CompletionIntent]
	ended := deleted || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx.Err() != nil {
		return
	}
	delta := 0
	switch {
	case marked && !ended && !l.marked[pod.UID]:
		l.marked[pod.UID] = true
		delta = 1
	case ended && l.marked[pod.UID] && !l.ended[pod.UID]:
		l.ended[pod.UID] = true
		delta = -1
	}
	if delta == 0 {
		return
	}
	work := time.Duration(l.rng.IntN(40)) * time.Millisecond
	l.pending++
	go func() {
		l.add(delta, work)
		l.mu.Lock()
		l.pending--
		l.mu.Unlock()
	}()
}

// add reads the counter, works for a moment, and patches back the value
// read plus delta.
func (l *legacyCounter) add(delta int, work time.Duration) {
	ctx := l.ctx
	pool := operator.Pool(Namespace, Pool, 0)
	if err := l.client.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
		return
	}
	v, _, _ := unstructured.NestedInt64(pool.Object, l.path...)
	select {
	case <-ctx.Done():
		return
	case <-time.After(work):
	}
	status := map[string]any{}
	if err := unstructured.SetNestedField(status, v+int64(delta), l.path...); err != nil {
		return
	}
	patch, err := json.Marshal(status)
	if err != nil {
		return
	}
	_ = l.client.Status().Patch(ctx, operator.Pool(Namespace, Pool, 0), client.RawPatch(types.MergePatchType, patch))
}

// value returns what the counter shows on pool: 0 before its first
// write, as tally reads it (aggregate.OperatorValue).
func (l *legacyCounter) value(pool *unstructured.Unstructured) int64 {
	v, _ := aggregate.OperatorValue(pool, l.path)
	return v
}

// waiting returns how many handlers have yet to write.
func (l *legacyCounter) waiting() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pending
}

// drained waits, for at most timeout, until no handler is left to write
// (and, once the counter is stopped, until its pod watch has stopped too).
func (l *legacyCounter) drained(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		waiting := l.waiting()
		stopped := true
		if l.ctx.Err() != nil {
			select {
			case <-l.informed:
			default:
				stopped = false
			}
		}
		if waiting == 0 && stopped {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the old counter did not drain within %s (%d handlers yet to write; its watch stopped: %t)", timeout, waiting, stopped)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
