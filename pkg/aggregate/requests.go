package aggregate

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/aggregate/count"
)

// parentOf maps a pod to the parent of this reconciler's kind that controls
// it, and records the change as pending.
func (r *Reconciler) parentOf(_ context.Context, obj client.Object) []reconcile.Request {
	pod, ok := obj.(*count.Pod)
	if !ok || pod.Controller.Kind != r.gvk.GroupKind() {
		return nil
	}
	return r.pendingRequest(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name})
}

// self maps a parent to itself, and records the change as pending.
func (r *Reconciler) self(_ context.Context, obj client.Object) []reconcile.Request {
	return r.pendingRequest(client.ObjectKeyFromObject(obj))
}

// parentsIn maps a namespace to the parents of this kind in it (cached, or
// read from the API server while the kind's view is not known fresh). The
// read is bounded as Unrecorded's are: a kind whose cache has not synced
// would otherwise hold this handler, and its later events, until it does.
func (r *Reconciler) parentsIn(ctx context.Context, obj client.Object) []reconcile.Request {
	ctx, cancel := context.WithTimeout(ctx, parentReadWait)
	defer cancel()
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(r.gvk.GroupVersion().WithKind(r.gvk.Kind + "List"))
	if err := r.Parents.List(ctx, list, client.InNamespace(obj.GetName())); err != nil {
		log.FromContext(ctx).Error(err, "Listing the parents of a namespace whose labels changed; they are reconciled at their next change", "namespace", obj.GetName())
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		out = append(out, r.pendingRequest(client.ObjectKeyFromObject(&list.Items[i]))...)
	}
	return out
}

// enqueue has the parent of pod reconciled: pod was read by a sweep, or is
// gone before its stamp.
func (r *Reconciler) enqueue(pod *count.Pod) {
	if q := r.queue.Load(); q != nil {
		for _, req := range r.pendingRequest(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name}) {
			(*q).Add(req)
		}
	}
}

func (r *Reconciler) pendingRequest(name types.NamespacedName) []reconcile.Request {
	r.observed.changes.seen(parentKey{kind: r.gvk.GroupKind(), name: name}, time.Now())
	return []reconcile.Request{{NamespacedName: name}}
}
