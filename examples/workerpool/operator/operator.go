// Package operator is a small WorkerPool operator that relies on tally
// instead of keeping counters. It creates pods with a controller
// ownerReference up to spec.replicas, marks surplus pods with a completion
// intent on scale-down (and, with StopMarked, stops them), and deletes pods
// once they have finished. It never
// writes the counts: status.active, completing, completed and unexpected are
// tally's.
package operator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/intent"
	"tally.dev/tally/pkg/keys"
)

// GVK is the WorkerPool kind.
var GVK = schema.GroupVersionKind{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}

// Pool returns an unsaved WorkerPool with the given replicas.
func Pool(namespace, name string, replicas int64) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(GVK)
	u.SetNamespace(namespace)
	u.SetName(name)
	u.Object["spec"] = map[string]any{"replicas": replicas}
	return u
}

// ScaleDown is the reason the operator gives surplus pods.
const ScaleDown = "scale-down"

// Reconciler reconciles WorkerPools.
type Reconciler struct {
	Client client.Client
	// Image is the worker pods' image.
	Image string
	// WorkerEnv is added to every worker's environment.
	WorkerEnv []corev1.EnvVar
	// StopMarked deletes the pods it marks for completion: their workers
	// drain and exit 0 on SIGTERM. Without it the workers are expected to
	// notice the intent themselves.
	StopMarked bool
}

// SetupWithManager watches WorkerPools and the pods tally labels with their
// UID.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	pool := &unstructured.Unstructured{}
	pool.SetGroupVersionKind(GVK)
	return ctrl.NewControllerManagedBy(mgr).
		For(pool).
		Watches(&corev1.Pod{}, handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), pool, handler.OnlyControllerOwner())).
		Complete(r)
}

// Reconcile drives one WorkerPool's pods towards spec.replicas.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	pool := &unstructured.Unstructured{}
	pool.SetGroupVersionKind(GVK)
	if err := r.Client.Get(ctx, req.NamespacedName, pool); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	replicas, _, _ := unstructured.NestedInt64(pool.Object, "spec", "replicas")

	var pods corev1.PodList
	if err := r.Client.List(ctx, &pods, client.InNamespace(pool.GetNamespace()), client.MatchingLabels{keys.ParentUID: string(pool.GetUID())}); err != nil {
		return reconcile.Result{}, err
	}
	var running []*corev1.Pod
	taken := map[string]bool{}
	for i := range pods.Items {
		pod := &pods.Items[i]
		taken[pod.Name] = true
		_, marked := intent.Marked(pod)
		terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
		switch {
		case pod.DeletionTimestamp != nil:
		case terminal:
			// Finished, as asked or not: remove it (a failed pod is
			// replaced below).
			if err := r.Client.Delete(ctx, pod); client.IgnoreNotFound(err) != nil {
				return reconcile.Result{}, err
			}
		case !marked:
			running = append(running, pod)
		case r.StopMarked:
			if err := r.stop(ctx, pod); err != nil {
				return reconcile.Result{}, err
			}
		}
	}

	log := log.FromContext(ctx)
	switch have := int64(len(running)); {
	case have < replicas:
		// Pods get the lowest free names, so that a reconcile working from
		// a cache that has not yet seen the pods created by the previous one
		// collides with them instead of creating too many.
		created := int64(0)
		for i := 0; created < replicas-have; i++ {
			name := fmt.Sprintf("%s-%d", pool.GetName(), i)
			if taken[name] {
				continue
			}
			err := r.Client.Create(ctx, r.newPod(pool, name))
			if apierrors.IsAlreadyExists(err) {
				return reconcile.Result{RequeueAfter: 100 * time.Millisecond}, nil
			}
			if err != nil {
				return reconcile.Result{}, err
			}
			created++
		}
		log.V(1).Info("Created pods", "count", created)
	case have > replicas:
		// Ask the newest surplus pods to complete.
		slices.SortFunc(running, func(a, b *corev1.Pod) int {
			return b.CreationTimestamp.Compare(a.CreationTimestamp.Time)*1000 + strings.Compare(b.Name, a.Name)
		})
		marked := 0
		for _, pod := range running[:have-replicas] {
			err := intent.MarkForCompletion(ctx, r.Client, pod, ScaleDown)
			switch {
			case apierrors.IsNotFound(err):
				continue
			case errors.Is(err, intent.ErrFinished) || apierrors.IsForbidden(err):
				// It finished (crashed, or was deleted) before the mark
				// landed, so it no longer runs: its end counts as
				// unexpected, and once the cache shows it the next
				// reconcile removes it.
				log.Info("Pod not marked for completion", "pod", pod.Name, "reason", err.Error())
				continue
			case err != nil:
				return reconcile.Result{}, err
			}
			marked++
			if r.StopMarked {
				if err := r.stop(ctx, pod); err != nil {
					return reconcile.Result{}, err
				}
			}
		}
		log.V(1).Info("Marked pods for completion", "count", marked)
	}
	return reconcile.Result{}, nil
}

// stop deletes a pod marked for completion; the intent is recorded first,
// so its end counts as completed, not unexpected.
func (r *Reconciler) stop(ctx context.Context, pod *corev1.Pod) error {
	return client.IgnoreNotFound(r.Client.Delete(ctx, pod, client.Preconditions{UID: &pod.UID}))
}

// newPod returns a worker pod of pool, stamped with the pool's identity
// (identity.Stamp) so that the API server admits it without calling tally's
// webhook.
func (r *Reconciler) newPod(pool *unstructured.Unstructured, name string) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pool.GetNamespace(),
			Name:      name,
			Labels:    map[string]string{"app.kubernetes.io/name": "worker", "app.kubernetes.io/instance": pool.GetName()},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: GVK.GroupVersion().String(), Kind: GVK.Kind, Name: pool.GetName(), UID: pool.GetUID(),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: corev1.PodSpec{
			// A worker that exits is replaced by a new pod, not restarted:
			// its end is final, and counted.
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name:  "worker",
				Image: r.Image,
				// The worker reads its completion intent through the
				// downward API and exits once its work is handed off.
				Env: append([]corev1.EnvVar{{Name: "COMPLETION_INTENT", ValueFrom: &corev1.EnvVarSource{
					FieldRef: &corev1.ObjectFieldSelector{FieldPath: fmt.Sprintf("metadata.annotations['%s']", keys.CompletionIntent)},
				}}}, r.WorkerEnv...),
			}},
		},
	}
	identity.Stamp(pod)
	return pod
}
