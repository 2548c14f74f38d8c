package aggregate

import (
	"context"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/pkg/servable"
)

// FieldManager is the server-side apply field manager under which the
// aggregator owns the mapped counts.
const FieldManager = "tally-aggregator"

// TotalsFieldManager is the field manager under which the aggregator owns
// the totals and the ledger. Apart from the counts, so that an apply of the
// counts alone (a kind that stops mapping totals, a release without them)
// leaves them as they are instead of removing them.
const TotalsFieldManager = "tally-aggregator-totals"

// Reconciler keeps one parent kind's mapped status fields equal to the
// counts of each parent's pods.
type Reconciler struct {
	gvk  schema.GroupVersionKind
	kind string
	// counts are the mapped counts; totals the mapped totals.
	counts, totals []config.Field
	// ledger is the ledger's path; nil when the kind keeps no totals.
	ledger []string
	// compare are the fields the kind's operator keeps that are compared
	// with tally's counts (shadow mode, config.Parent.CompareFields).
	compare []config.Field
	// custom is how many custom counts the kind defines; broken are
	// those it cannot keep (nil: none).
	custom   int
	broken   *brokenCounts
	releases *releases
	// rules are the webhook's, for this kind: whether a pod read from the
	// API server carries an intent tally admitted.
	rules *mutate.Mutator
	// written tells when the parent cache is behind this replica's own
	// writes.
	written *written
	// queue is the controller's work queue, once it started.
	queue atomic.Pointer[workqueue.TypedRateLimitingInterface[reconcile.Request]]
	Deps
	// The kind's counters, resolved once.
	reconciledTotal, applied, skipped, failed, conflicts, liveReads, fenced prometheus.Counter
}

// Deps are what a Reconciler reads from and writes to.
type Deps struct {
	// Parents reads parents from the informer cache; Live from the API
	// server (when the cache lags behind it: behind this replica's own
	// last write, or an apply answered 409 or 404).
	Parents, Live client.Reader
	// Writer sends the server-side applies.
	Writer client.Client
	// Pods is the pod index: the shared pod informer's indexer (with
	// count.Indexers), or those of each namespace of a fixed list.
	Pods count.Index
	// Backfilled waits until the start-up backfill sweep has read every
	// pod: nothing is written before.
	Backfilled func(context.Context) error
	// Unstamped holds the pods the sweep read that the cache does not show
	// yet; nil when none.
	Unstamped *Unstamped
	// MayWrite, when set, tells whether this replica may still write in a
	// namespace ("" for every namespace): it holds the leader lease, and
	// its pod view of that namespace is not known to be stale. A parent is
	// neither counted nor written while it says no for the parent's
	// namespace, where all its pods are.
	MayWrite func(ns string) bool
	// ViewEpoch, when set, changes whenever the pod view of a namespace
	// stops being fresh: a count is written only in the epoch it was taken
	// in.
	ViewEpoch func(ns string) uint64
	Recorder  events.EventRecorder
	// Reports, shared by the managers of one process, are the custom
	// counts that cannot be kept; nil: the reconciler reports its own.
	Reports *CustomCountReports
	// Totals, for a kind with totals, tells whether the API server serves
	// them (servable.Gate); while it does not, the counts are kept, the
	// totals left as they are, and the pods' finalizers released by
	// Unrecorded. Nil: always.
	Totals *servable.Gate
	// Scope tells the namespaces where pods are tracked; nil: every one.
	Scope *Scope
	// observed is what the reconciles feed the metrics with; a
	// reconciler of its own when nil.
	observed *observed
	// reconciled, when set, records each parent reconciled while this
	// replica may write: Unrecorded runs the grace of its pods only from
	// then.
	reconciled *reconciledParents
	// recording, when set, keeps Unrecorded from releasing a parent's
	// pods as lost while this reconciler records them.
	recording *recordLocks
	// DriftAfter is how long a field the parent's operator keeps may
	// differ from tally's count before the parent gets a Warning Event;
	// DefaultDriftAfter when 0.
	DriftAfter time.Duration
}

var _ reconcile.Reconciler = (*Reconciler)(nil)

// NewReconciler returns the reconciler of one parent kind.
func NewReconciler(parent config.Parent, deps Deps) *Reconciler {
	kind := parent.GroupKind().String()
	var counts, totals []config.Field
	for _, f := range parent.Fields() {
		if slices.Contains(config.Totals, f.Count) {
			totals = append(totals, f)
		} else {
			counts = append(counts, f)
		}
	}
	if parent.Tracked() {
		initTrackingMetrics(kind)
	}
	if deps.observed == nil {
		deps.observed = newObserved()
	}
	if deps.DriftAfter <= 0 {
		deps.DriftAfter = DefaultDriftAfter
	}
	compare := parent.CompareFields()
	deps.observed.compared.init(kind, compare)
	return &Reconciler{
		gvk: parent.GroupVersionKind(), kind: kind, counts: counts, totals: totals, ledger: parent.LedgerPath(), custom: len(parent.CustomCounts), compare: compare,
		broken:   deps.Reports.of(parent),
		releases: newReleases(), written: newWritten(), Deps: deps, rules: mutate.NewMutator([]config.Parent{parent}, nil),
		reconciledTotal: reconciles.WithLabelValues(kind), applied: applies.WithLabelValues(kind),
		skipped: appliesSkipped.WithLabelValues(kind), failed: applyErrors.WithLabelValues(kind),
		conflicts: applyConflicts.WithLabelValues(kind), liveReads: parentLiveReads.WithLabelValues(kind), fenced: appliesFenced.WithLabelValues(kind),
	}
}

// Reconcile recomputes one parent's counts from the cached pods (and the
// pods a sweep read that await their stamps) and applies the mapped fields
// whose values differ from what the parent shows. For a kind with totals it
// then takes a step of the ledger protocol (Advance): the ledger and totals
// go in one apply, then the finalizers of the recorded pods are removed, at
// most PodBatch pod writes at a time. Pods carrying the finalizer whose
// parent is gone, or whose kind keeps no totals, lose it. Nothing is
// counted while this replica may not write. A parent whose cache is behind
// this replica's last write of it is read from the API server, and an
// apply that meets a newer parent than it read (another writer's, or a
// cache behind in a way written does not know) brings one more pass, on
// the parent read from the API server.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	if r.Backfilled(ctx) != nil {
		// Shutting down before the start-up backfill completed.
		return reconcile.Result{}, nil
	}
	key := parentKey{kind: r.gvk.GroupKind(), name: req.NamespacedName}
	r.observed.changes.picked(key)
	r.reconciledTotal.Inc()
	if r.Deps.reconciled != nil && r.mayWriteIn(req.Namespace) {
		r.Deps.reconciled.add(key)
	}

	// The view the counts are taken from: fresh now, and still the same
	// (not broken since, however briefly) when they are written (apply).
	epoch := r.viewEpoch(req.Namespace)
	if !r.mayWriteIn(req.Namespace) {
		// Nothing is counted from a view known to be stale: the parent
		// comes back once this replica may write.
		r.fenced.Inc()
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	ctx, pass := withPass(ctx, epoch, req.Namespace)
	result, err := r.reconcileFrom(ctx, req, key, false)
	if pass.takeLagged() && r.Live != nil {
		// The parent's cache lags behind the API server (after an outage
		// its watch may come back seconds after the pods'): count again
		// at once on the parent as the API server has it, rather than
		// meet the same conflict until the cache catches up. A second
		// conflict is a writer racing this one, retried after
		// conflictRequeue.
		result, err = r.reconcileFrom(ctx, req, key, true)
	}
	return result, err
}

// reconcileFrom reconciles the parent req names, read from the API server
// when live, else from the cache.
func (r *Reconciler) reconcileFrom(ctx context.Context, req reconcile.Request, key parentKey, live bool) (reconcile.Result, error) {
	parent, err := r.readParent(ctx, key, live)
	if err != nil {
		if !gone(err) {
			return reconcile.Result{}, err
		}
		r.written.forget(key)
		r.observed.counted.forget(key)
		r.observed.compared.forget(key)
		if r.Deps.reconciled != nil {
			r.Deps.reconciled.forget(key)
		}
		return r.releaseOrphans(ctx, req.NamespacedName, "")
	}
	r.broken.warn(r.Recorder, parent, parent.GetUID(), time.Now())
	if result, err := r.releaseOrphans(ctx, req.NamespacedName, parent.GetUID()); err != nil || result.RequeueAfter > 0 {
		return result, err
	}
	pods, counts, err := r.count(parent)
	if err != nil {
		return reconcile.Result{}, err
	}
	r.observed.counted.set(key, counts)
	result, err := r.write(ctx, parent, pods, counts)
	if again := r.compareCounts(ctx, key, parent, counts); again > 0 {
		result = earliest(result, reconcile.Result{RequeueAfter: again})
	}
	return result, err
}

// write applies the counts of parent's pods, and for a kind with totals
// takes a step of the ledger protocol.
func (r *Reconciler) write(ctx context.Context, parent *unstructured.Unstructured, pods []*count.Pod, counts count.Counts) (reconcile.Result, error) {
	inScope := r.Scope.Selects(ctx, parent.GetNamespace())
	if r.ledger == nil || !inScope {
		// A kind that keeps no totals (any more), or a parent in a
		// namespace the webhook registration does not select: the
		// history the counts' manager holds is handed over before the
		// counts' apply would remove it, and the totals stay as they
		// are. Pods carrying the finalizer are released after the counts.
		if own := ownershipOf(parent); r.countsHoldHistory(parent, own) {
			if result, err := r.applyTotals(ctx, parent, own, nil); err != nil || result.RequeueAfter > 0 {
				return result, err
			}
		}
		why := kindOptedOut
		if r.ledger != nil {
			why = namespaceNotSelected
		}
		return r.applyCounts(ctx, parent, counts, r.untracked(pods), why)
	}
	return r.reconcileTotals(ctx, parent, pods, counts)
}

// readParent reads the parent from the API server when live, or when the
// cache shows a version older than this replica's last write of it (its
// watch broken, or lagging after an outage: writing from the cached
// version would only meet a conflict); else from the cache.
func (r *Reconciler) readParent(ctx context.Context, key parentKey, live bool) (*unstructured.Unstructured, error) {
	parent := &unstructured.Unstructured{}
	parent.SetGroupVersionKind(r.gvk)
	if !live {
		if err := r.Parents.Get(ctx, key.name, parent); err != nil {
			return nil, err
		}
		rv := parent.GetResourceVersion()
		passOf(ctx).cachedAt(rv)
		if r.Live == nil || !r.written.behind(key, rv, time.Now()) {
			return parent, nil
		}
		r.liveReads.Inc()
	}
	if err := r.Live.Get(ctx, key.name, parent); err != nil {
		return nil, err
	}
	return parent, nil
}

// count returns the parent's cached pods, and the counts of those and of the
// pods a sweep read that await their stamps (counted before their stamps
// land; the ledger protocol sees only the cache's).
func (r *Reconciler) count(parent client.Object) ([]*count.Pod, count.Counts, error) {
	all, held, err := r.Unstamped.PodsOf(r.Pods, parent.GetUID())
	if err != nil {
		return nil, count.Counts{}, err
	}
	pods := count.Members(parent.GetNamespace(), parent.GetUID(), all)
	counted := append(held, pods...)
	counts := count.Tally(parent.GetNamespace(), parent.GetUID(), counted)
	if r.custom > 0 {
		counts.Custom, counts.CustomPartial = count.TallyCustom(parent.GetNamespace(), parent.GetUID(), counted, r.custom)
	}
	return pods, counts, nil
}

// untracked returns the pods that carry the tracking finalizer although
// the kind keeps no totals.
func (r *Reconciler) untracked(pods []*count.Pod) []*count.Pod {
	var out []*count.Pod
	for _, p := range pods {
		if p.Tracking {
			out = append(out, p)
		}
	}
	return out
}

// mayWriteIn reports whether this replica may write in namespace ns (""
// for every namespace).
func (r *Reconciler) mayWriteIn(ns string) bool { return r.MayWrite == nil || r.MayWrite(ns) }

// mayWrite reports whether this replica may write in the namespace of
// ctx's pass; in every namespace when there is none.
func (r *Reconciler) mayWrite(ctx context.Context) bool {
	ns := ""
	if p := passOf(ctx); p != nil {
		ns = p.ns
	}
	return r.mayWriteIn(ns)
}

func (r *Reconciler) viewEpoch(ns string) uint64 {
	if r.ViewEpoch == nil {
		return 0
	}
	return r.ViewEpoch(ns)
}

// sameView reports whether the pod view is still in the epoch ctx's pass
// took its counts in.
func (r *Reconciler) sameView(ctx context.Context) bool {
	p := passOf(ctx)
	return p == nil || r.viewEpoch(p.ns) == p.epoch
}
