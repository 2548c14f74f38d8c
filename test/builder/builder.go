// Package builder builds the pods and parents that tally's unit and
// integration tests create. It holds no Kubernetes client.
package builder

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// WorkerPoolGVK is the example parent kind (examples/workerpool).
var WorkerPoolGVK = schema.GroupVersionKind{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}

// WorkerPool returns an unsaved WorkerPool with the given replicas.
func WorkerPool(namespace, name string, replicas int64) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(WorkerPoolGVK)
	u.SetNamespace(namespace)
	u.SetName(name)
	u.Object["spec"] = map[string]any{"replicas": replicas}
	return u
}

// PodBuilder builds pods.
type PodBuilder struct{ pod corev1.Pod }

// Pod starts a pod with one container.
func Pod(namespace, name string) *PodBuilder {
	return &PodBuilder{pod: corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "registry.example/worker:1"}}},
	}}
}

// ControlledBy adds a controller ownerReference.
func (b *PodBuilder) ControlledBy(gvk schema.GroupVersionKind, name string, uid types.UID) *PodBuilder {
	b.pod.OwnerReferences = append(b.pod.OwnerReferences, metav1.OwnerReference{
		APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind, Name: name, UID: uid, Controller: ptr.To(true),
	})
	return b
}

// OwnedBy adds an ownerReference that is not the controller.
func (b *PodBuilder) OwnedBy(gvk schema.GroupVersionKind, name string, uid types.UID) *PodBuilder {
	b.pod.OwnerReferences = append(b.pod.OwnerReferences, metav1.OwnerReference{
		APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind, Name: name, UID: uid,
	})
	return b
}

// Label sets a label.
func (b *PodBuilder) Label(k, v string) *PodBuilder {
	if b.pod.Labels == nil {
		b.pod.Labels = map[string]string{}
	}
	b.pod.Labels[k] = v
	return b
}

// Annotation sets an annotation.
func (b *PodBuilder) Annotation(k, v string) *PodBuilder {
	if b.pod.Annotations == nil {
		b.pod.Annotations = map[string]string{}
	}
	b.pod.Annotations[k] = v
	return b
}

// Finalizer adds a finalizer, which keeps a deleted pod terminating.
func (b *PodBuilder) Finalizer(f string) *PodBuilder {
	b.pod.Finalizers = append(b.pod.Finalizers, f)
	return b
}

// Phase sets the pod's phase.
func (b *PodBuilder) Phase(p corev1.PodPhase) *PodBuilder {
	b.pod.Status.Phase = p
	return b
}

// Build returns the pod.
func (b *PodBuilder) Build() *corev1.Pod { return b.pod.DeepCopy() }
