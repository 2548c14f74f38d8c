package mutate

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
)

// ReaderOwnerChecker verifies owners against an informer cache of the parent
// kinds. On a miss or a UID mismatch it asks the API server directly, so
// that a parent created an instant before its pods is not refused because
// the cache has not seen it yet.
type ReaderOwnerChecker struct {
	cache, live client.Reader
	// cached returns the empty object the cache serves a parent kind as.
	cached   func(schema.GroupVersionKind) client.Object
	versions map[schema.GroupKind]schema.GroupVersionKind
}

var _ OwnerChecker = (*ReaderOwnerChecker)(nil)

// NewReaderOwnerChecker returns a checker that reads the parents from
// cache, as the objects cached returns (PartialMetadata for a metadata
// cache), then their metadata from live.
func NewReaderOwnerChecker(parents []config.Parent, cache client.Reader, cached func(schema.GroupVersionKind) client.Object, live client.Reader) *ReaderOwnerChecker {
	versions := make(map[schema.GroupKind]schema.GroupVersionKind, len(parents))
	for _, p := range parents {
		versions[p.GroupKind()] = p.GroupVersionKind()
	}
	return &ReaderOwnerChecker{cache: cache, cached: cached, live: live, versions: versions}
}

// PartialMetadata returns an empty metadata-only object of a parent kind.
func PartialMetadata(gvk schema.GroupVersionKind) client.Object {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(gvk)
	return m
}

// CheckOwner reports whether the owner exists in namespace with its UID. An
// owner whose kind the API server does not serve does not exist; any other
// error of the API server is returned: the owner may exist.
func (c *ReaderOwnerChecker) CheckOwner(ctx context.Context, namespace string, owner identity.Parent) (bool, string, error) {
	gvk, ok := c.versions[owner.GroupKind]
	if !ok {
		return false, fmt.Sprintf("%s is not a tracked kind", owner.GroupKind), nil
	}
	key := client.ObjectKey{Namespace: namespace, Name: owner.Name}
	if obj := c.cached(gvk); c.cache.Get(ctx, key, obj) == nil && obj.GetUID() == owner.UID {
		return true, "", nil
	}
	obj := PartialMetadata(gvk)
	err := c.live.Get(ctx, key, obj)
	switch {
	case apierrors.IsNotFound(err):
		return false, fmt.Sprintf("owner %s not found in namespace %s", owner, namespace), nil
	case apimeta.IsNoMatchError(err):
		return false, fmt.Sprintf("owner %s: the API server does not serve %s", owner, gvk), nil
	case err != nil:
		return false, "", err
	case obj.GetUID() != owner.UID:
		return false, fmt.Sprintf("owner %s in namespace %s has UID %s, not %s", owner, namespace, obj.GetUID(), owner.UID), nil
	}
	return true, "", nil
}
