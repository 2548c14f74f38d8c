package aggregate

import (
	"context"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
)

// graceOf is what a pass knows of a parent of held pods: whether their
// grace runs, whether no reconcile would record them (they are released
// uncounted, not lost, when it runs out), and when the last record of the
// parent that was tried began (zero: none was).
type graceOf struct {
	runs, orphaned bool
	tried          time.Time
}

// hadAChance reports whether the parent had a real chance to record pod,
// seen held at seen: a record of it that began since was tried (and
// answered, or failed), or no reconcile would record it. Time alone, or
// time a record waited in the client's rate limiter, is no chance.
func (g graceOf) hadAChance(seen time.Time) bool {
	return g.orphaned || !g.tried.IsZero() && !g.tried.Before(seen)
}

// reconciledParents records the parents reconciled while this replica may
// write (the grace of a parent's pods runs only from then), and when each
// last tried to record its finished pods: a pod past the hold limit is
// released uncounted only once a record of its parent that began after the
// pod was seen held was tried, and answered or failed.
type reconciledParents struct{ m, tried sync.Map }

func (r *reconciledParents) add(k parentKey) { r.m.Store(k, struct{}{}) }

// forget drops a parent that is gone, so that the set holds only parents
// that exist.
func (r *reconciledParents) forget(k parentKey) {
	r.m.Delete(k)
	r.tried.Delete(k)
}

func (r *reconciledParents) has(k parentKey) bool {
	_, ok := r.m.Load(k)
	return ok
}

// recorded records that a record of k's finished pods that began at began
// was tried: written, refused, or failed.
func (r *reconciledParents) recorded(k parentKey, began time.Time) { r.tried.Store(k, began) }

// triedSince returns when the last record of k that was tried began; zero
// if none was.
func (r *reconciledParents) triedSince(k parentKey) time.Time {
	if v, ok := r.tried.Load(k); ok {
		return v.(time.Time)
	}
	return time.Time{}
}

// parentOf names pod's parent.
func parentOf(pod *count.Pod) types.NamespacedName {
	return types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name}
}

// graceRuns returns, for each parent of held, pods of kind p, whether their
// grace runs in this pass (this replica writing, the gate able to tell):
// once the parent was reconciled while this replica may write, or at once
// when no reconcile would record them.
func (u *Unrecorded) graceRuns(ctx context.Context, p config.Parent, held []*count.Pod) map[types.NamespacedName]graceOf {
	out := map[types.NamespacedName]graceOf{}
	// One budget for the pass's parent reads (from the cache, or from the
	// API server while the kind's view is not known fresh): a kind whose
	// informer has not synced is read no longer than that, and its pods'
	// grace waits.
	readCtx, cancel := context.WithTimeout(ctx, parentReadWait)
	defer cancel()
	for _, pod := range held {
		key := parentOf(pod)
		if _, ok := out[key]; ok {
			continue
		}
		orphaned := !p.Tracked() || !u.scope.Selects(readCtx, pod.Namespace) || u.parentGone(readCtx, p, key, pod.Controller.UID)
		pk := parentKey{kind: p.GroupKind(), name: key}
		out[key] = graceOf{runs: orphaned || u.reconciled.has(pk), orphaned: orphaned, tried: u.reconciled.triedSince(pk)}
	}
	return out
}

// parentGone reports whether the parents' view (the kind's cache, or the
// API server while the cache is not known fresh) shows that the parent of
// kind p named key with UID uid does not exist (none, or another under its
// name).
func (u *Unrecorded) parentGone(ctx context.Context, p config.Parent, key types.NamespacedName, uid types.UID) bool {
	if ctx.Err() != nil {
		return false
	}
	// Unstructured, as the reconcilers read it: the informer they share.
	parent := &unstructured.Unstructured{}
	parent.SetGroupVersionKind(p.GroupVersionKind())
	switch err := u.parents.Get(ctx, key, parent); {
	case apierrors.IsNotFound(err):
		return true
	case err != nil:
		return false
	}
	return parent.GetUID() != uid
}

// clocks is the time of a pass: local (with its monotonic reading: a
// duration between two of them is measured on the monotonic clock) and
// the API server's (apiclock), which the times the API server stamps are
// compared with.
type clocks struct{ local, server time.Time }

// sinceFinish returns how long ago pod finished, as its own metadata shows
// it, by the API server's clock; 0 when it shows no finish.
func sinceFinish(pod *count.Pod, now clocks) time.Duration {
	if pod.FinishedAt == 0 {
		return 0
	}
	return now.server.Sub(time.Unix(pod.FinishedAt, 0))
}

// heldFor returns how long pod has been held, as far as anything shows:
// since this process first saw it held (h), or since the finish its own
// metadata shows, whichever is longer (a process that started a moment ago
// does not make a pod held for hours look new).
func heldFor(pod *count.Pod, h heldPod, now clocks) time.Duration {
	return max(now.local.Sub(h.seen), sinceFinish(pod, now))
}

// reportHeld sets the held-pod gauges of kind from its held pods and what
// is known of them.
func reportHeld(kind schema.GroupKind, held []*count.Pod, known map[types.UID]heldPod, now clocks) {
	var oldest time.Duration
	for _, pod := range held {
		oldest = max(oldest, heldFor(pod, known[pod.UID], now))
	}
	heldPods.WithLabelValues(kind.String()).Set(float64(len(held)))
	oldestHeldPod.WithLabelValues(kind.String()).Set(oldest.Seconds())
}

// heldLogEvery is how long a pod is held before its parent's held pods are
// logged, with why they wait, and how often they are logged again.
const heldLogEvery = time.Minute

// logWaiting logs, for each parent of kind whose pods have been held for
// heldLogEvery, why they wait (why), at most every heldLogEvery. Called
// with u.mu held.
func (u *Unrecorded) logWaiting(kind schema.GroupKind, held []*count.Pod, known map[types.UID]heldPod, now clocks, why func(*count.Pod) string) {
	type waiting struct {
		pods   []string
		oldest time.Duration
		used   time.Duration
		reason string
	}
	byParent := map[parentKey]*waiting{}
	for _, pod := range held {
		h := known[pod.UID]
		age := heldFor(pod, h, now)
		if age < heldLogEvery {
			continue
		}
		key := parentKey{kind: kind, name: parentOf(pod)}
		w := byParent[key]
		if w == nil {
			w = &waiting{reason: why(pod)}
			byParent[key] = w
		}
		w.pods = append(w.pods, pod.Name)
		w.oldest, w.used = max(w.oldest, age), max(w.used, h.used)
	}
	for key, last := range u.logged {
		if _, ok := byParent[key]; !ok && key.kind == kind && now.local.Sub(last) >= heldLogEvery {
			delete(u.logged, key)
		}
	}
	for key, w := range byParent {
		if now.local.Sub(u.logged[key]) < heldLogEvery {
			continue
		}
		u.logged[key] = now.local
		u.log.Info("Pods held by the tracking finalizer", "kind", kind.String(), "parent", key.name, "reason", w.reason,
			"pods", listed(w.pods), "heldFor", w.oldest.Round(time.Second).String(), "graceUsed", w.used.Round(time.Second).String(),
			"grace", u.grace.String())
	}
}

// heldAtMost is how many graces a finished pod is held at most after the
// finish its own metadata shows (Pod.FinishedAt), whatever became of the
// processes that saw it: a grace used in a process that stopped (a manager
// restarted, a leader that changed) is not lost to the bound. A pod past it
// is released once its grace has run for a while in this process
// (pastLimitRun) and its parent had a real chance to record it
// (graceOf.hadAChance): a pod of a parent whose records succeed is
// recorded, never released as lost for lack of time.
const heldAtMost = 5

// pastLimitRun is how much of its grace a pod past the hold limit uses in
// this process before it is released: a quarter of the grace, at most 30 s.
func pastLimitRun(grace time.Duration) time.Duration { return min(grace/4, 30*time.Second) }

// pastHoldLimit reports whether pod finished, as it shows, heldAtMost
// graces ago or more by the API server's clock.
func pastHoldLimit(pod *count.Pod, now clocks, grace time.Duration) bool {
	return pod.FinishedAt != 0 && sinceFinish(pod, now) >= heldAtMost*grace
}

// overdue returns what is known of each held pod after this pass — a pod
// not seen before is seen now, with none of its grace used; one seen
// before adds elapsed to the grace it used when its grace runs now
// (graceOf.runs) — and the pods to release: those that have used all of
// it, and those past the hold limit that have used pastLimitRun of it and
// whose parent had a chance to record them. Pods no longer held are
// forgotten.
func overdue(held []*count.Pod, before map[types.UID]heldPod, now clocks, elapsed, grace time.Duration, of func(*count.Pod) graceOf) (map[types.UID]heldPod, []*count.Pod) {
	known := make(map[types.UID]heldPod, len(held))
	var expired []*count.Pod
	for _, pod := range held {
		h, seen := before[pod.UID]
		g := of(pod)
		switch {
		case !seen:
			h = heldPod{seen: now.local}
		case g.runs:
			h.used += elapsed
		}
		known[pod.UID] = h
		pastLimit := g.runs && h.used >= pastLimitRun(grace) && pastHoldLimit(pod, now, grace) && g.hadAChance(h.seen)
		if h.used >= grace || pastLimit {
			expired = append(expired, pod)
		}
	}
	return known, expired
}
