package aggregate

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/pkg/replicas"
	"tally.dev/tally/pkg/servable"
)

// PodSelector selects the pods the aggregator watches: those carrying the
// keys.ParentUID label.
func PodSelector() labels.Selector {
	req, err := labels.NewRequirement(keys.ParentUID, selection.Exists, nil)
	if err != nil {
		panic(err) // the key is a valid label key
	}
	return labels.NewSelector().Add(*req)
}

// CacheOptions returns the manager cache options the aggregator needs: one
// label-selected pod informer whose objects reducer reduces to *Pod; none
// with a fixed list of namespaces, whose pods are in caches of their own
// (NewPodCaches).
func CacheOptions(reducer *count.Reducer, namespaces []string) cache.Options {
	if len(namespaces) > 0 {
		return cache.Options{}
	}
	return cache.Options{
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}: {Label: PodSelector(), Transform: reducer.Transform},
		},
	}
}

// Options tune the aggregator's controllers.
type Options struct {
	// MaxConcurrentReconciles is how many parents of one kind are reconciled
	// at once. Work on one parent is always serialised.
	MaxConcurrentReconciles int
	// BackfillInterval is the time between two backfill sweeps.
	BackfillInterval time.Duration
	// VerifyOwner makes the backfill confirm a pod's owner before stamping
	// it, as the webhook does with verifyOwner.
	VerifyOwner bool
	// MayWrite, when set, tells whether this replica may still write in a
	// namespace ("" for every namespace): with leader election, whether it
	// surely still holds the lease, and whether its pod view of that
	// namespace is fresh.
	MayWrite func(ns string) bool
	// Leads, when set, tells whether this replica surely holds the lease,
	// whatever its pod view: the tracking grace runs while it does (and
	// always when nil), so that a view that stays stale holds no pod past
	// its grace.
	Leads func() bool
	// ViewEpoch, when set, changes whenever the pod view of a namespace
	// stops being fresh (Deps.ViewEpoch).
	ViewEpoch func(ns string) uint64
	// TrackingGrace is how long a finished pod of a kind with totals may
	// wait to be recorded before it is released uncounted (lost).
	TrackingGrace time.Duration
	// ServerNow, when set, returns the API server's time (apiclock.Clock),
	// which the finish a pod's metadata shows is compared with; the local
	// time when nil.
	ServerNow func() time.Time
	// Namespaces selects the namespaces whose pods the backfill stamps and
	// the aggregator tracks: the webhook registration's namespaceSelector.
	// Nil selects every one.
	Namespaces labels.Selector
	// NewCache builds each parent kind's cache; cache.New when nil. Give
	// it the manager's NewCache, so that the parents' views come back
	// from an API server outage as fast as the pod view: the status
	// applies carry the cached parent's resourceVersion, and each is
	// answered 409 Conflict while the parent's cache lags behind the
	// writes before it.
	NewCache cache.NewCacheFunc
	// DriftAfter is how long a field a parent's operator keeps may differ
	// from tally's count before the parent gets a Warning Event;
	// DefaultDriftAfter when 0.
	DriftAfter time.Duration
	// Pods are the pod caches (NewPodCaches); the manager's when nil. With
	// a fixed list of namespaces, the parents too are watched and the
	// sweep lists pods only in those.
	Pods *PodCaches
	// CustomCountReports are the process's reports of the custom counts
	// that cannot be kept (NewCustomCountReports); nil: each reconciler
	// reports its own.
	CustomCountReports *CustomCountReports
}

// Setup adds the pod index, the backfill sweep and one controller per
// parent kind to mgr, whose cache must have been built with CacheOptions
// (of the namespaces of opts.Pods).
// A kind the API server does not serve, or serves without a status
// subresource, is reported (log and tally_aggregator_parent_kind_problems)
// and checked again, with backoff, until it can be served; the others are
// served meanwhile.
func Setup(ctx context.Context, mgr manager.Manager, parents []config.Parent, opts Options) error {
	if opts.BackfillInterval <= 0 {
		return fmt.Errorf("the backfill interval must be positive, not %s", opts.BackfillInterval)
	}
	if opts.TrackingGrace <= 0 {
		return fmt.Errorf("the tracking grace must be positive, not %s", opts.TrackingGrace)
	}
	pods := opts.Pods
	if pods == nil {
		var err error
		if pods, err = NewPodCaches(ctx, mgr, nil, nil, nil); err != nil {
			return err
		}
	}
	if err := pods.setup(mgr); err != nil {
		return err
	}
	disco, err := discovery.NewDiscoveryClientForConfig(mgr.GetConfig())
	if err != nil {
		return fmt.Errorf("creating discovery client: %w", err)
	}

	parentCache := &parentCaches{mgr: mgr, newCache: opts.NewCache, namespaces: pods.Namespaces()}
	var checker mutate.OwnerChecker
	if opts.VerifyOwner {
		checker = mutate.NewReaderOwnerChecker(parents, parentCache, newParent, mgr.GetAPIReader())
	}
	log := ctrl.LoggerFrom(ctx)
	backfill := NewBackfill(mutate.NewMutator(parents, checker), mgr.GetAPIReader(), mgr.GetClient(), pods.index,
		pods.synced(mgr), opts.BackfillInterval, log.WithName("backfill"))
	if opts.MayWrite != nil {
		// A sweep goes through every namespace watched; it starts once
		// this replica may write in one of them.
		backfill.mayWrite = func() bool {
			for _, ns := range pods.Namespaces() {
				if opts.MayWrite(ns) {
					return true
				}
			}
			return false
		}
	}
	recorder := mgr.GetEventRecorder(FieldManager)
	backfill.recorder = recorder
	backfill.Namespaces, backfill.within = opts.Namespaces, pods.Namespaces()
	if err := mgr.Add(backfill); err != nil {
		return err
	}
	if err := pods.addEventHandler(backfill.Unstamped.EventHandler()); err != nil {
		return fmt.Errorf("watching pods for the backfill: %w", err)
	}

	scope := NewScope(opts.Namespaces, mgr.GetCache())
	if scope != nil {
		if _, err := mgr.GetCache().GetInformer(ctx, namespaceMeta()); err != nil {
			return fmt.Errorf("creating the namespace informer (tally tracks pods only in the namespaces its namespaceSelector selects): %w", err)
		}
	}

	kindChecker := servable.NewChecker(mgr.GetRESTMapper(), disco)
	gate := servable.NewGate(kindChecker, parents, log.WithName("totals"))
	if err := mgr.Add(gate); err != nil {
		return err
	}
	reconciled := &reconciledParents{}
	obs := observe()
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		<-ctx.Done()
		obs.forget()
		return nil
	})); err != nil {
		return err
	}
	unrecorded := NewUnrecorded(parents, gate, pods.index, parentCache, mgr.GetClient(),
		recorder, opts.TrackingGrace, opts.Leads, reconciled, log.WithName("unrecorded"))
	unrecorded.live = mgr.GetAPIReader()
	if opts.ServerNow != nil {
		unrecorded.serverNow = opts.ServerNow
	}
	recording := &recordLocks{}
	unrecorded.recording, unrecorded.scope = recording, scope
	if err := mgr.Add(unrecorded); err != nil {
		return err
	}
	k := &kinds{mgr: mgr, recorder: recorder, checker: kindChecker, gate: gate, pods: pods, backfill: backfill, reconciled: reconciled, recording: recording, observed: obs, scope: scope, parents: parentCache, opts: opts}
	backfill.Unstamped.Notify(k.notify)
	var pending []config.Parent
	for _, p := range parents {
		problem, err := k.serve(ctx, p)
		if err != nil {
			return err
		}
		if problem != nil {
			log.Error(problem, "Parent kind cannot be served yet; serving the other kinds and checking again", "kind", p.GroupKind().String())
			pending = append(pending, p)
		}
	}
	if len(pending) == 0 {
		return nil
	}
	// Every replica checks again, as every one checked at the start: a
	// standby that did not would report the kind unservable until it led.
	return mgr.Add(replicas.Every(func(ctx context.Context) error {
		k.retry(ctx, pending)
		return nil
	}))
}

// newParent returns an empty parent object, as the cache serves parents.
func newParent(gvk schema.GroupVersionKind) client.Object {
	parent := &unstructured.Unstructured{}
	parent.SetGroupVersionKind(gvk)
	return parent
}

// kinds adds the controller of each parent kind once the API server serves
// it.
type kinds struct {
	mgr      manager.Manager
	checker  *servable.Checker
	gate     *servable.Gate
	pods     *PodCaches
	backfill *Backfill
	// reconciled records the parents reconciled as leader, for Unrecorded.
	reconciled *reconciledParents
	// recording is shared by the reconcilers and Unrecorded.
	recording *recordLocks
	observed  *observed
	recorder  events.EventRecorder
	scope     *Scope
	parents   *parentCaches
	opts      Options
	// served holds the reconciler of each kind served, by GroupKind.
	served sync.Map
}

// notify has the parent of pod reconciled, when its kind is served.
func (k *kinds) notify(pod *count.Pod) {
	if r, ok := k.served.Load(pod.Controller.Kind); ok {
		r.(*Reconciler).enqueue(pod)
	}
}

// serve adds the controller of kind p when the API server serves it with a
// status subresource, and reports the problem otherwise. The error is for
// a controller that could not be created.
func (k *kinds) serve(ctx context.Context, p config.Parent) (*servable.Problem, error) {
	kind := p.GroupKind().String()
	if problem := k.checker.Kind(p); problem != nil {
		kindProblems.DeletePartialMatch(prometheus.Labels{"kind": kind})
		kindProblems.WithLabelValues(kind, problem.Name).Set(1)
		return problem, nil
	}
	kc, err := k.parents.add(ctx, p.GroupVersionKind())
	if err != nil {
		return nil, err
	}
	// A parent is written once a sweep has read its namespace: the first
	// sweep reads every namespace it may list (Backfilled waits for it),
	// a later one a namespace refused until then.
	mayWrite := func(ns string) bool {
		return k.backfill.Swept(ns) && (k.opts.MayWrite == nil || k.opts.MayWrite(ns))
	}
	r := NewReconciler(p, Deps{
		Parents: k.parents, Live: k.mgr.GetAPIReader(), Writer: k.mgr.GetClient(), Pods: k.pods.index,
		Backfilled: k.backfill.Wait, Unstamped: k.backfill.Unstamped, MayWrite: mayWrite, ViewEpoch: k.opts.ViewEpoch,
		Recorder: k.recorder, Reports: k.opts.CustomCountReports, Totals: k.gate, Scope: k.scope, reconciled: k.reconciled, recording: k.recording, observed: k.observed,
		DriftAfter: k.opts.DriftAfter,
	})
	b := ctrl.NewControllerManagedBy(k.mgr).Named(strings.ToLower(kind))
	for _, src := range kc.sources(newParent(p.GroupVersionKind()), handler.EnqueueRequestsFromMapFunc(r.self)) {
		b = b.WatchesRawSource(src)
	}
	for _, src := range k.pods.sources(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(r.parentOf)) {
		b = b.WatchesRawSource(src)
	}
	if k.scope != nil {
		// A namespace whose labels change may enter or leave the scope;
		// a new one has no parent yet.
		labelsChanged := predicate.Funcs{
			CreateFunc:  func(event.CreateEvent) bool { return false },
			DeleteFunc:  func(event.DeleteEvent) bool { return false },
			GenericFunc: func(event.GenericEvent) bool { return false },
			UpdateFunc:  predicate.LabelChangedPredicate{}.Update,
		}
		b = b.Watches(namespaceMeta(), handler.EnqueueRequestsFromMapFunc(r.parentsIn), builder.WithPredicates(labelsChanged))
	}
	err = b.
		WatchesRawSource(source.Func(func(_ context.Context, q workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
			r.queue.Store(&q)
			return nil
		})).
		WithOptions(controller.Options{
			MaxConcurrentReconciles: k.opts.MaxConcurrentReconciles,
			// Names are unique per manager (the config rejects a kind
			// given twice); the process-wide check would only refuse a
			// second manager in the same process, as tests start.
			SkipNameValidation: ptr.To(true),
			// A first list of many pods can take longer than the
			// default two minutes; no status is written before it ends.
			CacheSyncTimeout: 10 * time.Minute,
			// Errors that need a change elsewhere (a CRD that does not
			// declare a field yet) are retried at least once a minute.
			RateLimiter: workqueue.NewTypedMaxOfRateLimiter(
				workqueue.NewTypedItemExponentialFailureRateLimiter[reconcile.Request](5*time.Millisecond, time.Minute),
				&workqueue.TypedBucketRateLimiter[reconcile.Request]{Limiter: rate.NewLimiter(rate.Limit(10), 100)},
			),
		}).
		Complete(r)
	if err != nil {
		return nil, fmt.Errorf("creating the controller of %s: %w", kind, err)
	}
	k.served.Store(p.GroupKind(), r)
	kindProblems.DeletePartialMatch(prometheus.Labels{"kind": kind})
	return nil, nil
}

// retry checks the pending kinds again, with backoff, until each is served
// or ctx is done.
func (k *kinds) retry(ctx context.Context, pending []config.Parent) {
	log := ctrl.LoggerFrom(ctx)
	for wait := 2 * time.Second; len(pending) > 0; wait = min(2*wait, time.Minute) {
		if !sleep(ctx, wait) {
			return
		}
		still := pending[:0]
		for _, p := range pending {
			problem, err := k.serve(ctx, p)
			switch {
			case err != nil:
				log.Error(err, "Parent kind cannot be served", "kind", p.GroupKind().String())
				still = append(still, p)
			case problem != nil:
				if log := log.V(1); log.Enabled() {
					log.Info("Parent kind still cannot be served", "kind", p.GroupKind().String(), "problem", problem.Name, "reason", problem.Err.Error())
				}
				still = append(still, p)
			default:
				log.Info("Parent kind is served now", "kind", p.GroupKind().String())
			}
		}
		pending = still
	}
}
