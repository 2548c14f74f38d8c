package count

import (
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
)

// ParentIndex names the pod informer's index by parent UID.
const ParentIndex = "tally.dev/parent-uid"

// IndexByParent is the pod informer's index function: a pod is filed under
// its ParentUID. UIDs are unique across namespaces, so the key needs no
// namespace.
func IndexByParent(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok {
		return []string{string(p.ParentUID)}, nil
	}
	return nil, fmt.Errorf("indexing by parent: unexpected object %T", obj)
}

// MisstampedIndex names the pod informer's index of the pods whose tally
// metadata the backfill sweep must correct; they are filed under
// "true", the others under no key.
const MisstampedIndex = "tally.dev/misstamped"

// MisstampedValue is the MisstampedIndex key of the misstamped pods.
const MisstampedValue = "true"

func indexMisstamped(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Misstamped {
		return []string{MisstampedValue}, nil
	}
	return nil, nil
}

// Indexers are the indexes the pod informer needs.
var Indexers = toolscache.Indexers{
	ParentIndex: IndexByParent, MisstampedIndex: indexMisstamped, OwnerIndex: indexTrackingOwner,
	TrackingKindIndex: indexTrackingKind, HeldIndex: indexHeld,
}

// Index is what the aggregator reads of the pod caches: an informer's
// indexer (with Indexers), or the indexers of several read as one
// (Indexes).
type Index interface {
	ByIndex(index, key string) ([]any, error)
	GetByKey(key string) (any, bool, error)
}

// Indexes are the indexers of the pod informers of several namespaces, read
// as one, by namespace.
type Indexes map[string]toolscache.Indexer

// ByIndex returns the objects every indexer files under key in index.
func (ix Indexes) ByIndex(index, key string) ([]any, error) {
	var all []any
	for _, indexer := range ix {
		objs, err := indexer.ByIndex(index, key)
		if err != nil {
			return nil, err
		}
		all = append(all, objs...)
	}
	return all, nil
}

// GetByKey returns the object of key ("<namespace>/<name>") from its
// namespace's indexer; none from a namespace not watched.
func (ix Indexes) GetByKey(key string) (any, bool, error) {
	ns, _, err := toolscache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil, false, err
	}
	indexer, ok := ix[ns]
	if !ok {
		return nil, false, nil
	}
	return indexer.GetByKey(key)
}

// PodsOf returns the cached pods filed under the parent's UID. The pods are
// shared with the cache and must not be modified.
func PodsOf(indexer Index, uid types.UID) ([]*Pod, error) {
	pods, err := ByIndex(indexer, ParentIndex, string(uid))
	if err != nil {
		return nil, fmt.Errorf("listing pods of parent %s: %w", uid, err)
	}
	return pods, nil
}

// ByIndex returns the cached pods filed under key in index.
func ByIndex(indexer Index, index, key string) ([]*Pod, error) {
	objs, err := indexer.ByIndex(index, key)
	if err != nil {
		return nil, err
	}
	pods := make([]*Pod, 0, len(objs))
	for _, obj := range objs {
		if p, ok := obj.(*Pod); ok {
			pods = append(pods, p)
		}
	}
	return pods, nil
}

// OwnerIndex names the pod informer's index of the pods carrying the
// tracking finalizer, by "<namespace>/<controller name>": it finds the pods
// of a parent that is gone, whose UID is no longer known.
const OwnerIndex = "tally.dev/tracking-owner"

func indexTrackingOwner(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && p.Controller.Name != "" {
		return []string{p.Namespace + "/" + p.Controller.Name}, nil
	}
	return nil, nil
}

// TrackingKindIndex names the pod informer's index of the pods carrying
// the tracking finalizer, by their controller's kind: the pods to release
// when a kind cannot keep its totals.
const TrackingKindIndex = "tally.dev/tracking-kind"

// HeldIndex names the pod informer's index of the finished pods that still
// carry the tracking finalizer, by their controller's kind: the pods waiting
// on tally to go.
const HeldIndex = "tally.dev/held"

func indexTrackingKind(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && !p.Controller.Kind.Empty() {
		return []string{p.Controller.Kind.String()}, nil
	}
	return nil, nil
}

func indexHeld(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && p.Finished() && !p.Controller.Kind.Empty() {
		return []string{p.Controller.Kind.String()}, nil
	}
	return nil, nil
}
