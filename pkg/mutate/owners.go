package mutate

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
)

// ReaderOwnerChecker verifies owners against an informer cache of the parent
// kinds' metadata. On a miss or a UID mismatch it asks the API server
// directly, so that a parent created an instant before its pods is not
// refused because the cache has not seen it yet.
type ReaderOwnerChecker struct {
	cache, live client.Reader
	versions    map[schema.GroupKind]schema.GroupVersionKind
}

var _ OwnerChecker = (*ReaderOwnerChecker)(nil)

// NewReaderOwnerChecker returns a checker that reads the parents' metadata
// from cache, then from live.
func NewReaderOwnerChecker(parents []config.Parent, cache, live client.Reader) *ReaderOwnerChecker {
	versions := make(map[schema.GroupKind]schema.GroupVersionKind, len(parents))
	for _, p := range parents {
		versions[p.GroupKind()] = p.GroupVersionKind()
	}
	return &ReaderOwnerChecker{cache: cache, live: live, versions: versions}
}

// PartialMetadata returns an empty metadata-only object of a parent kind, as
// used with the cache.
func PartialMetadata(gvk schema.GroupVersionKind) *metav1.PartialObjectMetadata {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(gvk)
	return m
}

// CheckOwner reports whether the owner exists in namespace with its UID.
func (c *ReaderOwnerChecker) CheckOwner(ctx context.Context, namespace string, owner Owner) (bool, string) {
	gvk, ok := c.versions[owner.GroupKind]
	if !ok {
		return false, fmt.Sprintf("%s is not a tracked kind", owner.GroupKind)
	}
	key := client.ObjectKey{Namespace: namespace, Name: owner.Name}
	obj := PartialMetadata(gvk)
	if err := c.cache.Get(ctx, key, obj); err == nil && obj.UID == owner.UID {
		return true, ""
	}
	obj = PartialMetadata(gvk)
	err := c.live.Get(ctx, key, obj)
	switch {
	case apierrors.IsNotFound(err):
		return false, fmt.Sprintf("owner %s not found in namespace %s", owner.Identity(), namespace)
	case err != nil:
		return false, fmt.Sprintf("owner %s could not be verified: %v", owner.Identity(), err)
	case obj.UID != owner.UID:
		return false, fmt.Sprintf("owner %s in namespace %s has UID %s, not %s", owner.Identity(), namespace, obj.UID, owner.UID)
	}
	return true, ""
}
