package robustness

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// viewBound is the stated bound on the view a count is written from: every
// counts write equals the truth, all four counts at once, at some point of
// the viewBound before the write was seen (and not after it, as the API
// server ordered them). A count written from an empty or partial cache, or
// from a view that stopped at a watch that broke, fails it.
const viewBound = 5 * time.Second

// counted is the counts the example maps, as a pool's status shows them or
// as its pods make them.
type counted [4]int64

var countNames = [4]config.Count{config.Completing, config.Active, config.Completed, config.Unexpected}

func countedOf(m map[config.Count]int64) counted {
	var c counted
	for i, name := range countNames {
		c[i] = m[name]
	}
	return c
}

// at is a pool's counts at a revision of the API server, with when the
// test saw it.
type at struct {
	rv     int64
	seen   time.Time
	counts counted
	// relisted marks a write the pool watch learnt of from a relist, not
	// when it happened: when it was seen tells nothing of its view.
	relisted bool
	// unstamped marks a truth in which a pod of the pool lacks tally's
	// labels (admitted while the webhook was down): the aggregator counts
	// it within one --backfill-interval, not within viewBound.
	unstamped bool
	// cause is what made a truth: a pod's event, or a relist.
	cause string
}

func (a at) String() string {
	return fmt.Sprintf("%v@%d(%s, %s)", a.counts, a.rv, a.cause, a.seen.Format("15:04:05.000"))
}

// countsHistory records, as the API server ordered them, each pool's true
// counts after every change to the namespace's pods (its pods as a watch
// delivers them, counted by internal/truth) and every counts write to the
// pools, so that check can tell whether each write came from a view that
// was whole and recent; and every pair of totals each pool showed.
type countsHistory struct {
	mu     sync.Mutex
	truths map[types.UID][]at
	writes map[types.UID][]at
	totals map[types.UID][][2]int64
	names  map[types.UID]string
	// gaps are the revisions the pod watch could not tell (a relist after
	// "too old resource version"): a write whose window holds one is not
	// checked.
	gaps [][2]int64
	// podsAt is the revision the pod watch has delivered up to.
	podsAt int64
}

func rv(obj metav1.Object) int64 {
	n, _ := strconv.ParseInt(obj.GetResourceVersion(), 10, 64)
	return n
}

// watchCounts starts recording the history of ns's pools (uids: by name)
// until the test ends.
func watchCounts(t *testing.T, ns string, uids map[string]types.UID) *countsHistory {
	t.Helper()
	h := &countsHistory{truths: map[types.UID][]at{}, writes: map[types.UID][]at{}, totals: map[types.UID][][2]int64{}, names: map[types.UID]string{}}
	for name, uid := range uids {
		h.names[uid] = name
	}
	cs, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	pods := map[types.UID]*corev1.Pod{}
	podsReady, poolsReady := make(chan struct{}), make(chan struct{})
	wg.Go(func() {
		follow(ctx, podsReady,
			func(ctx context.Context) ([]runtime.Object, string, error) {
				list, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
				if err != nil {
					return nil, "", err
				}
				objs := make([]runtime.Object, len(list.Items))
				for i := range list.Items {
					objs[i] = &list.Items[i]
				}
				return objs, list.ResourceVersion, nil
			},
			func(ctx context.Context, from string) (watch.Interface, error) {
				return cs.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: from})
			},
			func(objs []runtime.Object, listRV, lastRV string) {
				clear(pods)
				for _, o := range objs {
					p := o.(*corev1.Pod)
					pods[p.UID] = p
				}
				n, _ := strconv.ParseInt(listRV, 10, 64)
				h.relisted(lastRV, n, pods, ns)
			},
			func(ev watch.Event) {
				p, ok := ev.Object.(*corev1.Pod)
				if !ok {
					return
				}
				if ev.Type == watch.Deleted {
					delete(pods, p.UID)
				} else {
					pods[p.UID] = p
				}
				h.podChanged(rv(p), string(ev.Type)+" "+p.Name, pods, ns, metav1.GetControllerOf(p))
			})
	})
	poolClient := dyn.Resource(operator.GVK.GroupVersion().WithResource("workerpools")).Namespace(ns)
	wg.Go(func() {
		follow(ctx, poolsReady,
			func(ctx context.Context) ([]runtime.Object, string, error) {
				list, err := poolClient.List(ctx, metav1.ListOptions{})
				if err != nil {
					return nil, "", err
				}
				objs := make([]runtime.Object, len(list.Items))
				for i := range list.Items {
					objs[i] = &list.Items[i]
				}
				return objs, list.GetResourceVersion(), nil
			},
			func(ctx context.Context, from string) (watch.Interface, error) {
				return poolClient.Watch(ctx, metav1.ListOptions{ResourceVersion: from})
			},
			func(objs []runtime.Object, _, _ string) {
				for _, o := range objs {
					h.written(o.(*unstructured.Unstructured), true)
				}
			},
			func(ev watch.Event) {
				if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Deleted {
					h.written(u, false)
				}
			})
	})
	for _, ready := range []chan struct{}{podsReady, poolsReady} {
		select {
		case <-ready:
		case <-time.After(30 * time.Second):
			t.Fatal("the history's watches did not open within 30 s")
		}
	}
	return h
}

// follow lists, then watches from the list's resourceVersion, until ctx is
// done: a watch that ends is opened again from the last version seen, and
// one answered "too old resource version" lists again (replaced gets the
// list, its version and the last version seen before it). ready is closed
// once the first list is in.
func follow(ctx context.Context, ready chan struct{}, list func(context.Context) ([]runtime.Object, string, error),
	open func(context.Context, string) (watch.Interface, error), replaced func([]runtime.Object, string, string), event func(watch.Event)) {
	var once sync.Once
	last, listed := "", false
	for ctx.Err() == nil {
		if !listed {
			objs, version, err := list(ctx)
			if err != nil {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			replaced(objs, version, last)
			last, listed = version, true
			once.Do(func() { close(ready) })
		}
		w, err := open(ctx, last)
		if err != nil {
			listed = !apierrors.IsResourceExpired(err) && !apierrors.IsGone(err)
			time.Sleep(200 * time.Millisecond)
			continue
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				if status, ok := ev.Object.(*metav1.Status); ok && status.Code == http.StatusGone {
					listed = false
				}
				break
			}
			if obj, ok := ev.Object.(metav1.Object); ok {
				last = obj.GetResourceVersion()
			}
			event(ev)
		}
		w.Stop()
	}
}

// relisted records the truth of every pool after a relist at revision
// listRV; the revisions since lastRV (the last one seen before) are a gap.
func (h *countsHistory) relisted(lastRV string, listRV int64, pods map[types.UID]*corev1.Pod, ns string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if last, err := strconv.ParseInt(lastRV, 10, 64); err == nil {
		h.gaps = append(h.gaps, [2]int64{last, listRV})
	}
	h.podsAt = max(h.podsAt, listRV)
	list := podList(pods)
	now := time.Now()
	for uid := range h.names {
		tr := truthOf(listRV, now, list, ns, uid)
		tr.cause = "relist"
		h.truths[uid] = append(h.truths[uid], tr)
	}
}

// caughtUp waits until the pod watch has delivered every change to the
// namespace's pods made so far, so that check sees each truth the writes
// were taken from: it creates a pod that no pool owns and waits for the
// watch to deliver it.
func (h *countsHistory) caughtUp(ctx context.Context, ns string) error {
	barrier := builder.Pod(ns, "history-barrier").Build()
	if err := env.Client.Create(ctx, barrier); err != nil {
		return fmt.Errorf("creating the history's barrier pod: %w", err)
	}
	defer func() { _ = env.Client.Delete(context.WithoutCancel(ctx), barrier, client.GracePeriodSeconds(0)) }()
	want := rv(barrier)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		h.mu.Lock()
		at := h.podsAt
		h.mu.Unlock()
		if at >= want {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("the history's pod watch did not deliver revision %d within 30 s", want)
}

// podChanged records that the pod watch has delivered revision rev, and
// the truth of the pool that owns the pod that changed then.
func (h *countsHistory) podChanged(rev int64, cause string, pods map[types.UID]*corev1.Pod, ns string, owner *metav1.OwnerReference) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.podsAt = max(h.podsAt, rev)
	if owner == nil {
		return
	}
	if _, ok := h.names[owner.UID]; !ok {
		return
	}
	tr := truthOf(rev, time.Now(), podList(pods), ns, owner.UID)
	tr.cause = cause
	h.truths[owner.UID] = append(h.truths[owner.UID], tr)
}

// truthOf is the truth of the pool with UID uid at revision rev.
func truthOf(rev int64, seen time.Time, pods []corev1.Pod, ns string, uid types.UID) at {
	tr := at{rv: rev, seen: seen, counts: countedOf(truth.Counts(pods, ns, uid))}
	for _, p := range pods {
		if ref := metav1.GetControllerOf(&p); ref != nil && ref.UID == uid && p.Labels[keys.ParentUID] == "" {
			tr.unstamped = true
		}
	}
	return tr
}

// written records a pool's counts and totals as its status shows them,
// when they changed; relisted: as a relist showed them.
func (h *countsHistory) written(u *unstructured.Unstructured, relisted bool) {
	var c counted
	for i, name := range countNames {
		c[i], _, _ = unstructured.NestedInt64(u.Object, "status", string(name))
	}
	completed, unexpected, _ := framework.Totals(u)
	totals := [2]int64{completed, unexpected}
	h.mu.Lock()
	defer h.mu.Unlock()
	uid := u.GetUID()
	if seen := h.totals[uid]; len(seen) == 0 || seen[len(seen)-1] != totals {
		h.totals[uid] = append(seen, totals)
	}
	w := h.writes[uid]
	if len(w) > 0 && w[len(w)-1].counts == c {
		return
	}
	h.writes[uid] = append(w, at{rv: rv(u), seen: time.Now(), counts: c, relisted: relisted})
}

// addPool makes a pool created during the run part of the history: no pod
// is its own yet.
func (h *countsHistory) addPool(name string, pool metav1.Object) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.names[pool.GetUID()] = name
	h.truths[pool.GetUID()] = append(h.truths[pool.GetUID()], at{rv: rv(pool), seen: time.Now()})
}

// totalsSeen returns every pair of totals (completed, unexpected) each
// pool showed, in order, by UID.
func (h *countsHistory) totalsSeen() map[types.UID][][2]int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[types.UID][][2]int64, len(h.totals))
	for uid, seen := range h.totals {
		out[uid] = slices.Clone(seen)
	}
	return out
}

func podList(pods map[types.UID]*corev1.Pod) []corev1.Pod {
	out := make([]corev1.Pod, 0, len(pods))
	for _, p := range pods {
		out = append(out, *p)
	}
	return out
}

// check returns every counts write that no truth of its window matches,
// how many writes it checked and left unchecked (a window holding a gap or
// an unstamped pod, a write learnt of from a relist),
// and the longest a written value had no longer been the truth when the
// write was seen.
func (h *countsHistory) check() (violations []string, checked, unchecked int, lag time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for uid, writes := range h.writes {
		truths := h.truths[uid]
		for _, w := range writes {
			// The window: from the truth in force viewBound before the
			// write was seen, to the last truth at or before its revision.
			first := sort.Search(len(truths), func(i int) bool { return !truths[i].seen.Before(w.seen.Add(-viewBound)) })
			first = max(0, first-1)
			end := sort.Search(len(truths), func(i int) bool { return truths[i].rv > w.rv })
			if w.relisted || end == 0 || first >= end {
				unchecked++
				continue
			}
			if h.gapIn(truths[first].rv, w.rv) || slices.ContainsFunc(truths[first:end], func(tr at) bool { return tr.unstamped }) {
				unchecked++
				continue
			}
			checked++
			matched := -1
			for i := end - 1; i >= first; i-- {
				if truths[i].counts == w.counts {
					matched = i
					break
				}
			}
			if matched >= 0 && matched+1 < end {
				lag = max(lag, w.seen.Sub(truths[matched+1].seen))
			}
			if matched < 0 {
				violations = append(violations, fmt.Sprintf("%s: counts %v (completing, active, completed, unexpected) written at revision %d, seen at %s, "+
					"never the truth in the %s before: it was %v; after it: %v; the pod watch's gaps: %v", h.names[uid], w.counts, w.rv, w.seen.Format(time.StampMilli), viewBound,
					truths[first:end], truths[end:min(len(truths), end+8)], h.gaps))
			}
		}
	}
	return violations, checked, unchecked, lag
}

func (h *countsHistory) gapIn(from, to int64) bool {
	for _, g := range h.gaps {
		if g[0] < to && g[1] > from {
			return true
		}
	}
	return false
}

// TestCheckCountsHistory: the check itself, on histories written by hand.
func TestCheckCountsHistory(t *testing.T) {
	t0 := time.Unix(1_000, 0)
	truths := []at{
		{rv: 10, seen: t0, counts: counted{0, 3, 0, 0}},
		{rv: 20, seen: t0.Add(time.Second), counts: counted{1, 2, 0, 0}},
		{rv: 30, seen: t0.Add(10 * time.Second), counts: counted{0, 2, 1, 0}},
	}
	tests := []struct {
		name       string
		write      at
		truths     []at
		gaps       [][2]int64
		violations int
		checked    int
	}{
		{name: "the truth then", write: at{rv: 31, seen: t0.Add(10 * time.Second), counts: counted{0, 2, 1, 0}}, checked: 1},
		{name: "the truth a moment before", write: at{rv: 31, seen: t0.Add(12 * time.Second), counts: counted{1, 2, 0, 0}}, checked: 1},
		{name: "the truth, but longer ago than the bound", write: at{rv: 31, seen: t0.Add(17 * time.Second), counts: counted{1, 2, 0, 0}},
			checked: 1, violations: 1},
		{name: "zero over non-zero", write: at{rv: 25, seen: t0.Add(2 * time.Second), counts: counted{}}, checked: 1, violations: 1},
		{name: "counts that were never the truth together", write: at{rv: 25, seen: t0.Add(2 * time.Second), counts: counted{1, 3, 0, 0}},
			checked: 1, violations: 1},
		{name: "not before its revision", write: at{rv: 25, seen: t0.Add(11 * time.Second), counts: counted{0, 2, 1, 0}}, checked: 1, violations: 1},
		{name: "a gap in the window: not checked", write: at{rv: 31, seen: t0.Add(2 * time.Second), counts: counted{}}, gaps: [][2]int64{{12, 18}}},
		{name: "an unstamped pod in the window: not checked", write: at{rv: 31, seen: t0.Add(11 * time.Second), counts: counted{}},
			truths: []at{truths[0], truths[1], {rv: 30, seen: t0.Add(10 * time.Second), counts: counted{0, 2, 1, 0}, unstamped: true}}},
		{name: "learnt of from a relist: not checked", write: at{rv: 31, seen: t0.Add(60 * time.Second), counts: counted{1, 2, 0, 0}, relisted: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.truths == nil {
				tt.truths = truths
			}
			h := &countsHistory{truths: map[types.UID][]at{"p": tt.truths}, writes: map[types.UID][]at{"p": {tt.write}},
				names: map[types.UID]string{"p": "pool"}, gaps: tt.gaps}
			violations, checked, _, _ := h.check()
			assert.Len(t, violations, tt.violations, "%v", violations)
			assert.Equal(t, tt.checked, checked)
		})
	}
}
