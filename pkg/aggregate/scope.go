package aggregate

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// Scope tells whether a namespace is one the webhook registration selects
// (its namespaceSelector, the config's): only there does tally track pods.
// Pods elsewhere are still counted, as every pod a parent controls is, but
// never get the tracking finalizer, and lose it if they have it.
type Scope struct {
	selector labels.Selector
	// namespaces reads namespaces' metadata from the informer cache.
	namespaces client.Reader
}

// NewScope returns the scope of selector, reading namespaces through
// reader; nil, which selects every namespace, when selector is nil or
// empty.
func NewScope(selector labels.Selector, reader client.Reader) *Scope {
	if selector == nil || selector.Empty() {
		return nil
	}
	return &Scope{selector: selector, namespaces: reader}
}

// Selects reports whether the registration selects namespace ns. A
// namespace the cache does not show (yet) is taken as selected, as it was
// before the scope was known: its next reconcile tells.
func (s *Scope) Selects(ctx context.Context, ns string) bool {
	if s == nil {
		return true
	}
	obj := namespaceMeta()
	if err := s.namespaces.Get(ctx, client.ObjectKey{Name: ns}, obj); err != nil {
		return true
	}
	// As the API server matches a namespaceSelector: the namespace's
	// labels, which always include kubernetes.io/metadata.name.
	return s.selector.Matches(labels.Set(obj.GetLabels()))
}

// namespaceMeta is an empty Namespace, metadata only.
func namespaceMeta() *metav1.PartialObjectMetadata {
	obj := &metav1.PartialObjectMetadata{}
	obj.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
	return obj
}
