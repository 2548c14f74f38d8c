package framework

import (
	"context"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"tally.dev/tally/examples/workerpool/operator"
)

// Totals returns a WorkerPool's totals and how many pods its ledger holds,
// at the example configuration's paths (status.completedTotal,
// status.unexpectedTotal, status.tallyLedger).
func Totals(u *unstructured.Unstructured) (completed, unexpected int64, ledger int) {
	completed, _, _ = unstructured.NestedInt64(u.Object, "status", "completedTotal")
	unexpected, _, _ = unstructured.NestedInt64(u.Object, "status", "unexpectedTotal")
	for _, list := range []string{"completed", "unexpected"} {
		l, _, _ := unstructured.NestedStringSlice(u.Object, "status", "tallyLedger", list)
		ledger += len(l)
	}
	return completed, unexpected, ledger
}

// TotalsHistory is every pair of totals (Totals) each WorkerPool of a
// namespace showed, as watched, so that a test can tell that no total ever
// went down or past its final value.
type TotalsHistory struct {
	mu   sync.Mutex
	seen map[string][][2]int64
}

// WatchTotals records the totals of ns's WorkerPools until the test ends.
// The watch is opened again whenever it ends (an API server restart), from
// the last version seen, so that no status is missed.
func WatchTotals(t testing.TB, cfg *rest.Config, ns string) *TotalsHistory {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := &TotalsHistory{seen: map[string][][2]int64{}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	pools := dyn.Resource(operator.GVK.GroupVersion().WithResource("workerpools")).Namespace(ns)
	opened := make(chan struct{})
	var once sync.Once
	go func() {
		rv := ""
		for ctx.Err() == nil {
			w, err := pools.Watch(ctx, metav1.ListOptions{ResourceVersion: rv})
			if err != nil {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			once.Do(func() { close(opened) })
			for ev := range w.ResultChan() {
				u, ok := ev.Object.(*unstructured.Unstructured)
				if !ok || ev.Type == watch.Deleted {
					continue
				}
				rv = u.GetResourceVersion()
				c, x, _ := Totals(u)
				h.mu.Lock()
				h.seen[u.GetName()] = append(h.seen[u.GetName()], [2]int64{c, x})
				h.mu.Unlock()
			}
		}
	}()
	select {
	case <-opened:
	case <-time.After(30 * time.Second):
		t.Fatal("the WorkerPool watch did not open within 30 s")
	}
	return h
}

// Of returns the totals pool showed, in order.
func (h *TotalsHistory) Of(pool string) [][2]int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([][2]int64(nil), h.seen[pool]...)
}
