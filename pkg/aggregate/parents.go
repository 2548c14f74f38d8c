package aggregate

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"tally.dev/tally/pkg/replicas"
)

// parentCaches holds one informer cache per served parent kind, apart from
// the manager's (pods, namespaces). controller-runtime's sources and
// WaitForCacheSync wait for every informer of a cache: in one shared cache,
// a kind the API server cannot list (a broken conversion webhook, a
// revoked permission) would keep every kind's controller from starting,
// and the backfill from sweeping. Apart, it stalls only itself.
type parentCaches struct {
	mgr manager.Manager
	// newCache builds each kind's cache; cache.New when nil.
	newCache cache.NewCacheFunc
	byKind   sync.Map // schema.GroupKind → cache.Cache
}

var _ client.Reader = (*parentCaches)(nil)

// add creates and starts (with mgr, on every replica) the cache of gvk's
// parents.
func (c *parentCaches) add(gvk schema.GroupVersionKind) (cache.Cache, error) {
	newCache := c.newCache
	if newCache == nil {
		newCache = cache.New
	}
	kc, err := newCache(c.mgr.GetConfig(), cache.Options{
		HTTPClient: c.mgr.GetHTTPClient(), Scheme: c.mgr.GetScheme(), Mapper: c.mgr.GetRESTMapper(),
	})
	if err != nil {
		return nil, fmt.Errorf("creating the cache of %s: %w", gvk.GroupKind(), err)
	}
	// On every replica, in the manager's group that waits for nothing:
	// the manager's start does not wait for it.
	if err := c.mgr.Add(replicas.Every(kc.Start)); err != nil {
		return nil, err
	}
	c.byKind.Store(gvk.GroupKind(), kc)
	return kc, nil
}

// of returns the cache of obj's kind.
func (c *parentCaches) of(obj any) (cache.Cache, error) {
	o, ok := obj.(interface {
		GetObjectKind() schema.ObjectKind
	})
	if !ok {
		return nil, fmt.Errorf("reading a parent: %T has no kind", obj)
	}
	gk := o.GetObjectKind().GroupVersionKind().GroupKind()
	if _, isList := obj.(client.ObjectList); isList {
		gk.Kind = strings.TrimSuffix(gk.Kind, "List")
	}
	kc, ok := c.byKind.Load(gk)
	if !ok {
		return nil, fmt.Errorf("reading a parent: kind %s is not served yet", gk)
	}
	return kc.(cache.Cache), nil
}

// Get reads a parent from its kind's cache.
func (c *parentCaches) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	kc, err := c.of(obj)
	if err != nil {
		return err
	}
	return kc.Get(ctx, key, obj, opts...)
}

// List lists parents from their kind's cache.
func (c *parentCaches) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	kc, err := c.of(list)
	if err != nil {
		return err
	}
	return kc.List(ctx, list, opts...)
}
