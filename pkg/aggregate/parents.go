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

// parentCaches holds the informer caches of each served parent kind, apart
// from the manager's (pods, namespaces). controller-runtime's sources and
// WaitForCacheSync wait for every informer of a cache: in one shared cache,
// a kind the API server cannot list (a broken conversion webhook, a
// revoked permission) would keep every kind's controller from starting,
// and the backfill from sweeping. Apart, it stalls only itself.
//
// Each kind's view is judged by the pod view's rule (freshness.Monitor):
// after any doubt about it, its parents are read from the API server until
// the cache holds a version read after the doubt. A stale parent view
// would otherwise show a status another writer has changed since, and a
// count equal to the one cached would not be written again. With a fixed
// list of namespaces, each kind has one cache and one monitor per
// namespace, and a parent is read from the cache while its namespace's
// view is fresh.
type parentCaches struct {
	mgr manager.Manager
	// newCache builds each kind's caches; cache.New when nil.
	newCache cache.NewCacheFunc
	// namespaces are the namespaces watched: [""] for every one.
	namespaces []string
	byKind     sync.Map // schema.GroupKind → *parentCache
}

// parentCache is one kind's caches, and the monitors of its view.
type parentCache struct {
	*namespaced
	view      freshness.Views
	liveReads prometheus.Counter
}

var _ client.Reader = (*parentCaches)(nil)

// add creates and starts (with mgr, on every replica) the caches of gvk's
// parents, and the monitors of their view.
func (c *parentCaches) add(ctx context.Context, gvk schema.GroupVersionKind) (*namespaced, error) {
	kind := gvk.GroupKind().String()
	mapping, err := c.mgr.GetRESTMapper().RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("finding the resource of %s: %w", kind, err)
	}
	// The caches' requests go through a transport their monitors observe;
	// the monitors' barriers read through one they do not.
	cfg := rest.CopyConfig(c.mgr.GetConfig())
	view := make(freshness.Views, len(c.namespaces))
	for i, ns := range c.namespaces {
		view[i], err = freshness.New(ctrl.LoggerFrom(ctx).WithName("parents"), rest.CopyConfig(cfg), freshness.Options{Resource: mapping.Resource, Kind: kind, Namespace: ns})
		if err != nil {
			return nil, err
		}
	}
	view.Wrap(cfg)
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating the HTTP client of %s's cache: %w", kind, err)
	}
	caches, err := newNamespaced(ctx, c.newCache, cfg, cache.Options{HTTPClient: httpClient, Scheme: c.mgr.GetScheme(), Mapper: c.mgr.GetRESTMapper()}, c.namespaces, newParent(gvk))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", kind, err)
	}
	for i, ns := range c.namespaces {
		view[i].Attach(caches.informers[ns])
	}
	// On every replica, in the manager's group that waits for nothing:
	// the manager's start does not wait for them.
	if err := c.mgr.Add(replicas.Every(caches.Start)); err != nil {
		return nil, err
	}
	if err := c.mgr.Add(replicas.Every(func(ctx context.Context) error {
		view.Run(ctx)
		return nil
	})); err != nil {
		return nil, err
	}
	c.byKind.Store(gvk.GroupKind(), &parentCache{namespaced: caches, view: view, liveReads: parentLiveReads.WithLabelValues(kind)})
	return caches, nil
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
// the kind's view is not known fresh; one in a namespace not watched is
// not found.
func (c *parentCaches) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	kc, err := c.of(obj)
	if err != nil {
		return err
	}
	var live client.Reader
	if kc.holds(key.Namespace) && !kc.view.FreshIn(key.Namespace) {
		kc.liveReads.Inc()
		live = c.mgr.GetAPIReader()
	}
	return kc.get(ctx, key, obj, opts, live)
}

// List lists parents from their kind's cache, or from the API server while
// the kind's view is not known fresh; only in the namespaces watched.
func (c *parentCaches) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	kc, err := c.of(list)
	if err != nil {
		return err
	}
	var o client.ListOptions
	o.ApplyOptions(opts)
	var live client.Reader
	if !kc.view.FreshIn(o.Namespace) {
		kc.liveReads.Inc()
		live = c.mgr.GetAPIReader()
	}
	return kc.list(ctx, list, opts, live)
}
