package count

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

// Meta is the part of a pod's ObjectMeta that the cache keeps: 72 bytes
// where ObjectMeta takes about 250, for every cached pod. It implements
// metav1.Object so that a *Pod can live in an informer: the fields it does
// not keep read as empty, and setting them does nothing.
type Meta struct {
	Name, Namespace   string
	UID               types.UID
	ResourceVersion   string
	DeletionTimestamp *metav1.Time
}

var _ metav1.Object = (*Meta)(nil)

// GetNamespace implements metav1.Object.
func (m *Meta) GetNamespace() string { return m.Namespace }

// SetNamespace implements metav1.Object.
func (m *Meta) SetNamespace(namespace string) { m.Namespace = namespace }

// GetName implements metav1.Object.
func (m *Meta) GetName() string { return m.Name }

// SetName implements metav1.Object.
func (m *Meta) SetName(name string) { m.Name = name }

// GetUID implements metav1.Object.
func (m *Meta) GetUID() types.UID { return m.UID }

// SetUID implements metav1.Object.
func (m *Meta) SetUID(uid types.UID) { m.UID = uid }

// GetResourceVersion implements metav1.Object.
func (m *Meta) GetResourceVersion() string { return m.ResourceVersion }

// SetResourceVersion implements metav1.Object.
func (m *Meta) SetResourceVersion(version string) { m.ResourceVersion = version }

// GetDeletionTimestamp implements metav1.Object.
func (m *Meta) GetDeletionTimestamp() *metav1.Time { return m.DeletionTimestamp }

// SetDeletionTimestamp implements metav1.Object.
func (m *Meta) SetDeletionTimestamp(t *metav1.Time) { m.DeletionTimestamp = t }

// GetGenerateName implements metav1.Object; it is not kept.
func (m *Meta) GetGenerateName() string { return "" }

// SetGenerateName implements metav1.Object; it is not kept.
func (m *Meta) SetGenerateName(string) {}

// GetGeneration implements metav1.Object; it is not kept.
func (m *Meta) GetGeneration() int64 { return 0 }

// SetGeneration implements metav1.Object; it is not kept.
func (m *Meta) SetGeneration(int64) {}

// GetSelfLink implements metav1.Object; it is not kept.
func (m *Meta) GetSelfLink() string { return "" }

// SetSelfLink implements metav1.Object; it is not kept.
func (m *Meta) SetSelfLink(string) {}

// GetCreationTimestamp implements metav1.Object; it is not kept.
func (m *Meta) GetCreationTimestamp() metav1.Time { return metav1.Time{} }

// SetCreationTimestamp implements metav1.Object; it is not kept.
func (m *Meta) SetCreationTimestamp(metav1.Time) {}

// GetDeletionGracePeriodSeconds implements metav1.Object; it is not kept.
func (m *Meta) GetDeletionGracePeriodSeconds() *int64 { return nil }

// SetDeletionGracePeriodSeconds implements metav1.Object; it is not kept.
func (m *Meta) SetDeletionGracePeriodSeconds(*int64) {}

// GetLabels implements metav1.Object; labels are folded into Pod's fields.
func (m *Meta) GetLabels() map[string]string { return nil }

// SetLabels implements metav1.Object; labels are folded into Pod's fields.
func (m *Meta) SetLabels(map[string]string) {}

// GetAnnotations implements metav1.Object; annotations are folded into
// Pod's fields.
func (m *Meta) GetAnnotations() map[string]string { return nil }

// SetAnnotations implements metav1.Object; annotations are folded into
// Pod's fields.
func (m *Meta) SetAnnotations(map[string]string) {}

// GetFinalizers implements metav1.Object; the finalizers are folded into
// Pod.Tracking.
func (m *Meta) GetFinalizers() []string { return nil }

// SetFinalizers implements metav1.Object; the finalizers are folded into
// Pod.Tracking.
func (m *Meta) SetFinalizers([]string) {}

// GetOwnerReferences implements metav1.Object; the controller is folded
// into Pod.Controller.
func (m *Meta) GetOwnerReferences() []metav1.OwnerReference { return nil }

// SetOwnerReferences implements metav1.Object; the controller is folded
// into Pod.Controller.
func (m *Meta) SetOwnerReferences([]metav1.OwnerReference) {}

// GetManagedFields implements metav1.Object; they are not kept.
func (m *Meta) GetManagedFields() []metav1.ManagedFieldsEntry { return nil }

// SetManagedFields implements metav1.Object; they are not kept.
func (m *Meta) SetManagedFields([]metav1.ManagedFieldsEntry) {}

// GetObjectKind implements runtime.Object: a cached pod carries no type
// metadata.
func (p *Pod) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }
