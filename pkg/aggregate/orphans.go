package aggregate

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/mutate"
)

// releaseOrphans removes the tracking finalizer from the pods of a parent of
// this kind named name that is gone (current is the UID of the parent that
// exists under that name, "" when none). At most PodBatch are released at
// once; the parent is requeued for the others.
func (r *Reconciler) releaseOrphans(ctx context.Context, name types.NamespacedName, current types.UID) (reconcile.Result, error) {
	candidates, err := r.orphanCandidates(name, current)
	if err != nil || len(candidates) == 0 {
		return reconcile.Result{}, err
	}
	if !r.mayWrite(ctx) {
		// Nothing asked of the API server while this replica cannot
		// write: the parent comes back then.
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	orphans, err := r.orphans(ctx, name, candidates)
	if err != nil || len(orphans) == 0 {
		return reconcile.Result{}, err
	}
	result, err := r.releaseBatch(ctx, orphans, parentGone, nil)
	if current != "" && result.RequeueAfter == 0 {
		// The parent's own step comes at its next reconcile, so that one
		// reconcile sends at most PodBatch pod patches.
		result.RequeueAfter = foldRequeue
	}
	return result, err
}

// releaseReason says why pods are released uncounted, for their Warning
// Event.
type releaseReason int

const (
	// parentGone: each pod gets the Event (its parent is gone).
	parentGone releaseReason = iota
	// kindOptedOut: the parent gets it; its kind keeps no totals.
	kindOptedOut
	// namespaceNotSelected: the parent gets it; its namespace is not one
	// the webhook registration selects.
	namespaceNotSelected
)

// releaseBatch releases at most PodBatch of pods, none of them recorded, and
// asks for the parent to be reconciled again when some are left, or while
// this replica may not write. Each release is reported by a Warning Event
// for why: on parent naming the pods, or on each pod when its parent is
// gone.
func (r *Reconciler) releaseBatch(ctx context.Context, pods []*count.Pod, why releaseReason, parent client.Object) (reconcile.Result, error) {
	if pods = passOf(ctx).unreleased(pods); len(pods) == 0 {
		return reconcile.Result{}, nil
	}
	if !r.mayWrite(ctx) {
		// Fenced, or not yet the leader: the release is not dropped (the
		// pods may get no other event), it waits for this replica to write.
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	var result reconcile.Result
	if len(pods) > ledger.PodBatch {
		pods, result = pods[:ledger.PodBatch], reconcile.Result{RequeueAfter: foldRequeue}
	}
	err := r.releaseAll(ctx, "", pods, "orphaned")
	if err != nil || r.Recorder == nil {
		return result, err
	}
	names := make([]string, len(pods))
	for i, p := range pods {
		names[i] = p.Name
	}
	switch why {
	case kindOptedOut:
		reportOptedOut(r.Recorder, parent, r.kind, names)
	case namespaceNotSelected:
		r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "TrackingReleasedOutOfScope", "ReleaseTracking",
			"namespace %s is not one tally's webhook registration selects (its namespaceSelector): tally tracks no pod there; released the tracking finalizer of %d pod(s), whose finish is not counted in a total: %s",
			parent.GetNamespace(), len(names), listed(names))
	default:
		for _, p := range pods {
			pod := podMeta(p.Namespace, p.Name)
			pod.SetUID(p.UID)
			r.Recorder.Eventf(pod, nil, corev1.EventTypeWarning, "TrackingReleasedOrphan", "ReleaseTracking",
				"%s %s (UID %s), this pod's controller, is gone: released its tracking finalizer; its finish is not counted in a total",
				r.kind, p.Controller.Name, p.Controller.UID)
		}
	}
	return result, nil
}

// reportOptedOut sends the Warning Event on parent, of kind, whose pods
// named names lost the tracking finalizer because the kind keeps no totals.
func reportOptedOut(recorder events.EventRecorder, parent runtime.Object, kind string, names []string) {
	recorder.Eventf(parent, nil, corev1.EventTypeWarning, "TrackingReleasedOptedOut", "ReleaseTracking",
		"%s keeps no totals: released the tracking finalizer of %d pod(s), whose finish is not counted in a total: %s",
		kind, len(names), listed(names))
}

// listed joins names, at most 20 of them and listedBytes in all, saying how
// many more there are: the API server refuses an Event whose note is over
// 1 KiB, and pod names are up to 253 bytes long.
func listed(names []string) string {
	var b strings.Builder
	shown := 0
	for _, name := range names {
		if shown == 20 || (shown > 0 && b.Len()+len(", ")+len(name) > listedBytes) {
			break
		}
		if shown > 0 {
			b.WriteString(", ")
		}
		b.WriteString(name)
		shown++
	}
	if more := len(names) - shown; more > 0 {
		fmt.Fprintf(&b, " and %d more", more)
	}
	return b.String()
}

// listedBytes bounds the names listed in one Event, which leaves room for
// its message within the 1 KiB the API server takes.
const listedBytes = 512

// orphanCandidates returns the cached pods carrying the finalizer whose
// controller is a parent of this kind named name with another UID than
// current, the one the cache shows ("" when none).
func (r *Reconciler) orphanCandidates(name types.NamespacedName, current types.UID) ([]*count.Pod, error) {
	objs, err := r.Pods.ByIndex(count.OwnerIndex, name.Namespace+"/"+name.Name)
	if err != nil {
		return nil, fmt.Errorf("listing the tracked pods of %s: %w", name, err)
	}
	var candidates []*count.Pod
	for _, obj := range objs {
		if p, ok := obj.(*count.Pod); ok && p.Tracking && p.Controller.Kind == r.gvk.GroupKind() && p.Controller.UID != current {
			candidates = append(candidates, p)
		}
	}
	return candidates, nil
}

// orphans returns those of candidates (orphanCandidates) whose parent does
// not exist with their controller's UID. It confirms with the API server
// before it answers: a parent the cache does not show yet must not lose
// its pods' finalizers.
func (r *Reconciler) orphans(ctx context.Context, name types.NamespacedName, candidates []*count.Pod) ([]*count.Pod, error) {
	live := mutate.PartialMetadata(r.gvk)
	switch err := r.Live.Get(ctx, name, live); {
	case gone(err):
		return candidates, nil
	case err != nil:
		return nil, fmt.Errorf("confirming that %s %s is gone: %w", r.kind, name, err)
	}
	out := candidates[:0]
	for _, p := range candidates {
		if p.Controller.UID != live.GetUID() {
			out = append(out, p)
		}
	}
	return out, nil
}
