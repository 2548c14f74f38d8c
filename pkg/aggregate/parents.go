package aggregate

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"tally.dev/tally/pkg/freshness"
	"tally.dev/tally/pkg/replicas"
)

// parentCaches holds one informer cache per served parent kind, apart from
// the manager's (pods, namespaces). controller-runtime's sources and
// WaitForCacheSync wait for every informer of a cache: in one shared cache,
// a kind the API server cannot list (a broken conversion webhook, a
// revoked permission) would keep every kind's controller from starting,
// and the backfill from sweeping. Apart, it stalls only itself.
//
// Each kind's view is judged by the pod view's rule (freshness.Monitor):
// after any doubt about it, its parents are read from the API server until
// the cache holds a version read after the doubt. A stale parent view
// would otherwise show a status another writer has changed since, and a
// count equal to the one cached would not be written again.
type parentCaches struct {
	mgr manager.Manager
	// newCache builds each kind's cache; cache.New when nil.
	newCache cache.NewCacheFunc
	byKind   sync.Map // schema.GroupKind → *parentCache
}

// parentCache is one kind's cache, and the monitor of its view.
type parentCache struct {
	cache.Cache
	view      *freshness.Monitor
	liveReads prometheus.Counter
}

var _ client.Reader = (*parentCaches)(nil)

// add creates and starts (with mgr, on every replica) the cache of gvk's
// parents, and the monitor of its view.
func (c *parentCaches) add(ctx context.Context, gvk schema.GroupVersionKind) (cache.Cache, error) {
	kind := gvk.GroupKind().String()
	mapping, err := c.mgr.GetRESTMapper().RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("finding the resource of %s: %w", kind, err)
	}
	// The cache's requests go through a transport its monitor observes;
	// the monitor's barrier reads through one it does not.
	cfg := rest.CopyConfig(c.mgr.GetConfig())
	view, err := freshness.New(ctrl.LoggerFrom(ctx).WithName("parents"), rest.CopyConfig(cfg), freshness.Options{Resource: mapping.Resource, Kind: kind})
	if err != nil {
		return nil, err
	}
	view.Wrap(cfg)
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating the HTTP client of %s's cache: %w", kind, err)
	}
	newCache := c.newCache
	if newCache == nil {
		newCache = cache.New
	}
	kc, err := newCache(cfg, cache.Options{HTTPClient: httpClient, Scheme: c.mgr.GetScheme(), Mapper: c.mgr.GetRESTMapper()})
	if err != nil {
		return nil, fmt.Errorf("creating the cache of %s: %w", kind, err)
	}
	inf, err := kc.GetInformer(ctx, newParent(gvk), cache.BlockUntilSynced(false))
	if err != nil {
		return nil, fmt.Errorf("creating the informer of %s: %w", kind, err)
	}
	watched, ok := inf.(freshness.Informer)
	if !ok {
		return nil, fmt.Errorf("the informer of %s (%T) does not tell what it synced", kind, inf)
	}
	view.Attach(watched)
	// On every replica, in the manager's group that waits for nothing:
	// the manager's start does not wait for them.
	if err := c.mgr.Add(replicas.Every(kc.Start)); err != nil {
		return nil, err
	}
	if err := c.mgr.Add(replicas.Every(func(ctx context.Context) error {
		view.Run(ctx)
		return nil
	})); err != nil {
		return nil, err
	}
	c.byKind.Store(gvk.GroupKind(), &parentCache{Cache: kc, view: view, liveReads: parentLiveReads.WithLabelValues(kind)})
	return kc, nil
}

// of returns the cache of obj's kind.
func (c *parentCaches) of(obj any) (*parentCache, error) {
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
	return kc.(*parentCache), nil
}

// Get reads a parent from its kind's cache, or from the API server while
// the kind's view is not known fresh.
func (c *parentCaches) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	kc, err := c.of(obj)
	if err != nil {
		return err
	}
	if !kc.view.Fresh() {
		kc.liveReads.Inc()
		return c.mgr.GetAPIReader().Get(ctx, key, obj, opts...)
	}
	return kc.Get(ctx, key, obj, opts...)
}

// List lists parents from their kind's cache, or from the API server while
// the kind's view is not known fresh.
func (c *parentCaches) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	kc, err := c.of(list)
	if err != nil {
		return err
	}
	if !kc.view.Fresh() {
		kc.liveReads.Inc()
		return c.mgr.GetAPIReader().List(ctx, list, opts...)
	}
	return kc.List(ctx, list, opts...)
}
