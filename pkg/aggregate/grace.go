package aggregate

import (
	"context"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/config"
)

// graceOf is what a pass knows of a parent of held pods: whether their
// grace runs, and whether no reconcile would record them (they are
// released uncounted, not lost, when it runs out).
type graceOf struct{ runs, orphaned bool }

// parentOf names pod's parent.
func parentOf(pod *Pod) types.NamespacedName {
	return types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name}
}

// graceRuns returns, for each parent of held, pods of kind p, whether their
// grace runs in this pass (this replica writing, the gate able to tell):
// once the parent was reconciled while this replica may write, or at once
// when no reconcile would record them.
func (u *Unrecorded) graceRuns(ctx context.Context, p config.Parent, held []*Pod) map[types.NamespacedName]graceOf {
	out := map[types.NamespacedName]graceOf{}
	// One budget for the pass's cache reads: a kind whose informer has not
	// synced is read no longer than that, and its pods' grace waits.
	readCtx, cancel := context.WithTimeout(ctx, parentReadWait)
	defer cancel()
	for _, pod := range held {
		key := parentOf(pod)
		if _, ok := out[key]; ok {
			continue
		}
		orphaned := !p.Tracked() || !u.scope.Selects(readCtx, pod.Namespace) || u.parentGone(readCtx, p, key, pod.Controller.UID)
		out[key] = graceOf{runs: orphaned || u.reconciled.has(parentKey{kind: p.GroupKind(), name: key}), orphaned: orphaned}
	}
	return out
}

// parentGone reports whether the cache shows that the parent of kind p
// named key with UID uid does not exist (none, or another under its name).
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

// heldFor returns how long pod has been held, as far as anything shows:
// since this process first saw it held (h), or since the finish its own
// metadata shows, whichever is longer (a process that started a moment ago
// does not make a pod held for hours look new).
func heldFor(pod *Pod, h heldPod, now time.Time) time.Duration {
	held := now.Sub(h.seen)
	if pod.FinishedAt != 0 {
		held = max(held, now.Sub(time.Unix(pod.FinishedAt, 0)))
	}
	return held
}

// reportHeld sets the held-pod gauges of kind from its held pods and what
// is known of them.
func reportHeld(kind schema.GroupKind, held []*Pod, known map[types.UID]heldPod, now time.Time) {
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
func (u *Unrecorded) logWaiting(kind schema.GroupKind, held []*Pod, known map[types.UID]heldPod, now time.Time, why func(*Pod) string) {
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
		if _, ok := byParent[key]; !ok && key.kind == kind && now.Sub(last) >= heldLogEvery {
			delete(u.logged, key)
		}
	}
	for key, w := range byParent {
		if now.Sub(u.logged[key]) < heldLogEvery {
			continue
		}
		u.logged[key] = now
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
// (pastLimitRun): long enough for its parent's reconciles to record it,
// batch after batch, if they can.
const heldAtMost = 5

// pastLimitRun is how much of its grace a pod past the hold limit uses in
// this process before it is released: a quarter of the grace, at most 30 s.
func pastLimitRun(grace time.Duration) time.Duration { return min(grace/4, 30*time.Second) }

// pastHoldLimit reports whether pod finished, as it shows, heldAtMost
// graces ago or more.
func pastHoldLimit(pod *Pod, now time.Time, grace time.Duration) bool {
	return pod.FinishedAt != 0 && now.Sub(time.Unix(pod.FinishedAt, 0)) >= heldAtMost*grace
}

// overdue returns what is known of each held pod after this pass — a pod
// not seen before is seen now, with none of its grace used; one seen
// before adds elapsed to the grace it used when its grace runs now (runs)
// — and the pods to release: those that have used all of it, and those
// past the hold limit that have used pastLimitRun of it. Pods no longer
// held are forgotten.
func overdue(held []*Pod, before map[types.UID]heldPod, now time.Time, elapsed, grace time.Duration, runs func(*Pod) bool) (map[types.UID]heldPod, []*Pod) {
	known := make(map[types.UID]heldPod, len(held))
	var expired []*Pod
	for _, pod := range held {
		h, seen := before[pod.UID]
		running := runs(pod)
		switch {
		case !seen:
			h = heldPod{seen: now}
		case running:
			h.used += elapsed
		}
		known[pod.UID] = h
		if h.used >= grace || running && h.used >= pastLimitRun(grace) && pastHoldLimit(pod, now, grace) {
			expired = append(expired, pod)
		}
	}
	return known, expired
}
