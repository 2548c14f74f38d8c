package aggregate

import (
	"context"
	"fmt"
	"slices"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/freshness"
	"tally.dev/tally/pkg/replicas"
)

// namespaced are the caches of one kind: one that watches every namespace
// (namespaces is [""]), or one per namespace of a fixed list, so that
// nothing of that kind outside them is read. They read as one (get, list):
// a Get goes to the cache of its namespace, a List to each.
type namespaced struct {
	namespaces []string
	caches     map[string]cache.Cache
	informers  map[string]*informer
}

// informer is one cache's informer of the kind, as client-go made it: it
// tells what it synced (freshness.Informer).
type informer struct {
	cache.Informer
	shared toolscache.SharedIndexInformer
}

func (i *informer) LastSyncResourceVersion() string { return i.shared.LastSyncResourceVersion() }
func (i *informer) GetIndexer() toolscache.Indexer  { return i.shared.GetIndexer() }

var _ freshness.Informer = (*informer)(nil)

// newNamespaced builds, with newCache, cfg and opts, one cache of obj's
// kind per namespace ("" for every namespace), each with its informer of
// the kind made (not started). opts must not select objects by kind
// (ByObject): each cache holds obj's kind only.
func newNamespaced(ctx context.Context, newCache cache.NewCacheFunc, cfg *rest.Config, opts cache.Options, namespaces []string, obj client.Object) (*namespaced, error) {
	if newCache == nil {
		newCache = cache.New
	}
	n := &namespaced{namespaces: namespaces, caches: map[string]cache.Cache{}, informers: map[string]*informer{}}
	for _, ns := range namespaces {
		opts := opts
		if ns != metav1.NamespaceAll {
			opts.DefaultNamespaces = map[string]cache.Config{ns: {}}
		}
		// The informer client-go makes for the kind: controller-runtime's
		// (a multi-namespace one) does not tell what it synced.
		var made toolscache.SharedIndexInformer
		opts.NewInformer = func(lw toolscache.ListerWatcher, obj runtime.Object, resync time.Duration, indexers toolscache.Indexers) toolscache.SharedIndexInformer {
			made = toolscache.NewSharedIndexInformer(lw, obj, resync, indexers)
			return made
		}
		c, err := newCache(cfg, opts)
		if err != nil {
			return nil, fmt.Errorf("creating the cache of %s: %w", where(ns), err)
		}
		inf, err := c.GetInformer(ctx, obj, cache.BlockUntilSynced(false))
		if err != nil {
			return nil, fmt.Errorf("creating the informer of %s: %w", where(ns), err)
		}
		if made == nil {
			return nil, fmt.Errorf("the cache of %s made no informer of its own", where(ns))
		}
		n.caches[ns], n.informers[ns] = c, &informer{Informer: inf, shared: made}
	}
	return n, nil
}

// where names a namespace in an error: "" is every namespace.
func where(ns string) string {
	if ns == metav1.NamespaceAll {
		return "every namespace"
	}
	return "namespace " + ns
}

// of returns the cache of namespace ns; false when ns is outside the list.
func (n *namespaced) of(ns string) (cache.Cache, bool) {
	if c, ok := n.caches[metav1.NamespaceAll]; ok {
		return c, true
	}
	c, ok := n.caches[ns]
	return c, ok
}

// holds reports whether namespace ns is watched.
func (n *namespaced) holds(ns string) bool {
	_, ok := n.of(ns)
	return ok
}

// get reads obj through reader (the cache of key's namespace when nil); an
// object in a namespace outside the list is not found.
func (n *namespaced) get(ctx context.Context, key client.ObjectKey, obj client.Object, opts []client.GetOption, reader client.Reader) error {
	c, ok := n.of(key.Namespace)
	if !ok {
		gvk := obj.GetObjectKind().GroupVersionKind()
		return apierrors.NewNotFound(schema.GroupResource{Group: gvk.Group, Resource: gvk.Kind}, key.Name)
	}
	if reader == nil {
		reader = c
	}
	return reader.Get(ctx, key, obj, opts...)
}

// list lists through reader (each namespace's cache when nil): in the
// namespace asked for (nothing from one outside the list), or in each.
func (n *namespaced) list(ctx context.Context, list client.ObjectList, opts []client.ListOption, reader client.Reader) error {
	var o client.ListOptions
	o.ApplyOptions(opts)
	readerOf := func(ns string) client.Reader {
		if reader != nil {
			return reader
		}
		c, _ := n.of(ns)
		return c
	}
	if o.Namespace != metav1.NamespaceAll || n.holds(metav1.NamespaceAll) {
		if !n.holds(o.Namespace) {
			return meta.SetList(list, nil)
		}
		return readerOf(o.Namespace).List(ctx, list, opts...)
	}
	var items []runtime.Object
	for _, ns := range n.namespaces {
		part, ok := list.DeepCopyObject().(client.ObjectList)
		if !ok {
			return fmt.Errorf("listing: %T does not copy to a list", list)
		}
		if err := readerOf(ns).List(ctx, part, append(slices.Clone(opts), client.InNamespace(ns))...); err != nil {
			return err
		}
		objs, err := meta.ExtractList(part)
		if err != nil {
			return err
		}
		items = append(items, objs...)
	}
	return meta.SetList(list, items)
}

// Start runs every cache until ctx is done, or one of them fails (the
// others are then stopped).
func (n *namespaced) Start(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, ns := range n.namespaces {
		g.Go(func() error {
			if err := n.caches[ns].Start(ctx); err != nil {
				return fmt.Errorf("the cache of %s: %w", where(ns), err)
			}
			return nil
		})
	}
	return g.Wait()
}

// WaitForCacheSync waits until every cache has synced, and reports whether
// they did (false once ctx is done).
func (n *namespaced) WaitForCacheSync(ctx context.Context) bool {
	for _, ns := range n.namespaces {
		if !n.caches[ns].WaitForCacheSync(ctx) {
			return false
		}
	}
	return true
}

// sources returns one source of obj's events per cache, each handled by h.
// With a fixed list of namespaces, a controller does not wait for them to
// sync before it starts: a namespace whose list is refused (its Role
// missing) would hold back those of every other, and stop the manager once
// the controller's CacheSyncTimeout ran out. Nothing is counted from a
// namespace's pods, nor read from its parents' cache, until its view is
// fresh, which it cannot be before its cache has synced.
func (n *namespaced) sources(obj client.Object, h handler.EventHandler) []source.Source {
	var srcs []source.Source
	for _, ns := range n.namespaces {
		var src source.Source = source.Kind(n.caches[ns], obj, h)
		if ns != metav1.NamespaceAll {
			src = startOnly{src}
		}
		srcs = append(srcs, src)
	}
	return srcs
}

// startOnly is a source that tells nothing of its sync (it is no
// source.SyncingSource): its controller starts without waiting for it.
type startOnly struct{ source.Source }

// PodCaches are the pod caches the aggregator reads: the manager's, which
// watches every namespace, or, for a fixed list of namespaces, one per
// namespace, so that no pod outside them is read.
type PodCaches struct {
	*namespaced
	index count.Index
	// own is set when the caches are not the manager's: they are started
	// with it, on every replica.
	own bool
}

// NewPodCaches returns the manager's pod cache (mgr built with
// CacheOptions) when namespaces is empty. Otherwise it returns one cache
// per namespace, built with newCache (cache.New when nil) from mgr's
// config, each holding the pods of its namespace that PodSelector selects,
// reduced by reducer; Setup adds them to mgr.
func NewPodCaches(ctx context.Context, mgr manager.Manager, newCache cache.NewCacheFunc, reducer *count.Reducer, namespaces []string) (*PodCaches, error) {
	if len(namespaces) == 0 {
		inf, err := mgr.GetCache().GetInformer(ctx, &corev1.Pod{})
		if err != nil {
			return nil, fmt.Errorf("creating the pod informer: %w", err)
		}
		shared, ok := inf.(toolscache.SharedIndexInformer)
		if !ok {
			return nil, fmt.Errorf("the pod informer (%T) does not tell what it synced", inf)
		}
		n := &namespaced{
			namespaces: []string{metav1.NamespaceAll},
			caches:     map[string]cache.Cache{metav1.NamespaceAll: mgr.GetCache()},
			informers:  map[string]*informer{metav1.NamespaceAll: {Informer: inf, shared: shared}},
		}
		return &PodCaches{namespaced: n}, nil
	}
	opts := cache.Options{
		HTTPClient: mgr.GetHTTPClient(), Scheme: mgr.GetScheme(), Mapper: mgr.GetRESTMapper(),
		DefaultLabelSelector: PodSelector(), DefaultTransform: reducer.Transform,
	}
	n, err := newNamespaced(ctx, newCache, mgr.GetConfig(), opts, namespaces, &corev1.Pod{})
	if err != nil {
		return nil, fmt.Errorf("pods: %w", err)
	}
	return &PodCaches{namespaced: n, own: true}, nil
}

// Namespaces returns the namespaces the caches watch: "" for every one.
func (p *PodCaches) Namespaces() []string { return p.namespaces }

// Informer returns the pod informer of namespace ns ("" for every one).
func (p *PodCaches) Informer(ns string) freshness.Informer { return p.informers[ns] }

// setup indexes the pods, and adds the caches that are not the manager's
// to mgr, on every replica.
func (p *PodCaches) setup(mgr manager.Manager) error {
	indexes := count.Indexes{}
	for _, ns := range p.namespaces {
		if err := p.informers[ns].AddIndexers(count.Indexers); err != nil {
			return fmt.Errorf("indexing the pods of %s by parent: %w", where(ns), err)
		}
		indexes[ns] = p.informers[ns].GetIndexer()
	}
	p.index = indexes
	if len(indexes) == 1 {
		p.index = indexes[p.namespaces[0]]
	}
	if !p.own {
		return nil
	}
	return mgr.Add(replicas.Every(p.Start))
}

// addEventHandler adds h to every pod informer.
func (p *PodCaches) addEventHandler(h toolscache.ResourceEventHandler) error {
	for _, ns := range p.namespaces {
		if _, err := p.informers[ns].AddEventHandler(h); err != nil {
			return err
		}
	}
	return nil
}

// podSyncWait bounds how long the backfill waits for the pod caches of a
// fixed list of namespaces.
const podSyncWait = 2 * time.Minute

// synced waits until the manager's caches have synced (the pod cache of
// every namespace among them), or, with a fixed list of namespaces, until
// they and the pod cache of each namespace whose pods this replica may
// list have, for at most podSyncWait: a namespace whose list is refused
// (its Role missing) never syncs. The sweep's corrections of cached pods
// in a namespace not synced by then wait for the next sweep.
func (p *PodCaches) synced(mgr manager.Manager) func(context.Context) bool {
	return func(ctx context.Context) bool {
		if !mgr.GetCache().WaitForCacheSync(ctx) || !p.own {
			return ctx.Err() == nil
		}
		bounded, cancel := context.WithTimeout(ctx, podSyncWait)
		defer cancel()
		for _, ns := range p.namespaces {
			list := &metav1.PartialObjectMetadataList{}
			list.SetGroupVersionKind(podListGVK)
			if err := mgr.GetAPIReader().List(bounded, list, client.InNamespace(ns), client.Limit(1)); apierrors.IsForbidden(err) {
				continue
			}
			p.caches[ns].WaitForCacheSync(bounded)
		}
		return ctx.Err() == nil
	}
}
