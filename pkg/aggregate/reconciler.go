package aggregate

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/config"
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
	ledger   []string
	releases *releases
	// queue is the controller's work queue, once it started.
	queue atomic.Pointer[workqueue.TypedRateLimitingInterface[reconcile.Request]]
	Deps
	// The kind's counters, resolved once.
	reconciled, applied, skipped, failed, conflicts, fenced prometheus.Counter
}

// Deps are what a Reconciler reads from and writes to.
type Deps struct {
	// Parents reads parents from the informer cache; Live from the API
	// server (when it answers an apply with 404).
	Parents, Live client.Reader
	// Writer sends the server-side applies.
	Writer client.Client
	// Pods is the shared pod informer's indexer (with Indexers).
	Pods toolscache.Indexer
	// Backfilled waits until the start-up backfill sweep has read every
	// pod: nothing is written before.
	Backfilled func(context.Context) error
	// Unstamped holds the pods the sweep read that the cache does not show
	// yet; nil when none.
	Unstamped *Unstamped
	// MayWrite, when set, tells whether this replica may still write (it
	// holds the leader lease); a parent is not written while it says no.
	MayWrite func() bool
	Recorder events.EventRecorder
	// Totals, for a kind with totals, tells whether the API server serves
	// them (servable.Gate); while it does not, the counts are kept, the
	// totals left as they are, and the pods' finalizers released by
	// Unrecorded. Nil: always.
	Totals *servable.Gate
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
	return &Reconciler{
		gvk: parent.GroupVersionKind(), kind: kind, counts: counts, totals: totals, ledger: parent.LedgerPath(),
		releases: newReleases(), Deps: deps,
		reconciled: reconciles.WithLabelValues(kind), applied: applies.WithLabelValues(kind),
		skipped: appliesSkipped.WithLabelValues(kind), failed: applyErrors.WithLabelValues(kind),
		conflicts: applyConflicts.WithLabelValues(kind), fenced: appliesFenced.WithLabelValues(kind),
	}
}

// Reconcile recomputes one parent's counts from the cached pods (and the
// pods a sweep read that await their stamps) and applies the mapped fields
// whose values differ from what the parent shows. For a kind with totals it
// then takes a step of the ledger protocol (Advance): the ledger and totals
// go in one apply, then the finalizers of the recorded pods are removed, at
// most PodBatch pod writes at a time. Pods carrying the finalizer whose
// parent is gone, or whose kind keeps no totals, lose it.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	if r.Backfilled(ctx) != nil {
		// Shutting down before the start-up backfill completed.
		return reconcile.Result{}, nil
	}
	changes.picked(parentKey{kind: r.gvk.GroupKind(), name: req.NamespacedName})
	r.reconciled.Inc()

	parent := &unstructured.Unstructured{}
	parent.SetGroupVersionKind(r.gvk)
	if err := r.Parents.Get(ctx, req.NamespacedName, parent); err != nil {
		if !apierrors.IsNotFound(err) {
			return reconcile.Result{}, err
		}
		return r.releaseOrphans(ctx, req.NamespacedName, "")
	}
	if result, err := r.releaseOrphans(ctx, req.NamespacedName, parent.GetUID()); err != nil || result.RequeueAfter > 0 {
		return result, err
	}
	// With the pods a sweep read, counted before their stamps land; the
	// ledger protocol sees only the cache's.
	all, held, err := r.Unstamped.PodsOf(r.Pods, parent.GetUID())
	if err != nil {
		return reconcile.Result{}, err
	}
	pods := Members(parent.GetNamespace(), parent.GetUID(), all)
	counts := Tally(parent.GetNamespace(), parent.GetUID(), append(held, pods...))
	if r.ledger == nil {
		return r.applyCounts(ctx, parent, counts, r.untracked(pods))
	}

	book, err := ReadBook(parent.Object, r.ledger, r.totals)
	if err != nil {
		r.reportLedger(parent, err)
		return reconcile.Result{}, fmt.Errorf("reading the ledger of %s %s: %w", r.kind, req.NamespacedName, err)
	}
	// The counts first: they do not wait for the pods read below. The
	// counts' apply leaves out the totals and the ledger, which would
	// remove them while the counts' manager still owns them (an
	// installation of the single-manager layout): they are moved first.
	if r.countsOwnTotals(parent) {
		if result, err := r.applyTotals(ctx, parent, &book, true); err != nil || result.RequeueAfter > 0 {
			return result, err
		}
	}
	if result, err := r.applyCounts(ctx, parent, counts, nil); err != nil || result.RequeueAfter > 0 {
		return result, err
	}
	if !r.totalsServed(ctx) {
		// The totals stay as they are; Unrecorded releases the pods. Served
		// again later (a CRD fixed, a schema published): track the running
		// pods then.
		after := servable.Interval
		if p := r.Totals.Problem(r.gvk.GroupKind()); p != nil && p.Unknown {
			after = servable.RetryUnknown
		}
		return reconcile.Result{RequeueAfter: after}, nil
	}
	released := r.releases.of(parent.GetUID())
	has := func(uid types.UID) bool { _, ok := released[uid]; return ok }
	step := Advance(pods, book, has, Live{})
	if !step.Settled() {
		live, err := r.confirm(ctx, parent, &step)
		if err != nil {
			return reconcile.Result{}, err
		}
		step = Advance(pods, book, has, live)
	}
	if wait := foldWait(&book, &step, released, time.Now()); wait > 0 {
		return reconcile.Result{RequeueAfter: wait}, nil
	}
	if !step.Book.Equal(&book) {
		if result, err := r.applyTotals(ctx, parent, &step.Book, false); err != nil || result.RequeueAfter > 0 {
			// The ledger holding the pods to release is not written.
			return result, err
		}
	}
	r.releases.settle(parent.GetUID(), pods, &book, &step.Book)
	if !r.mayWrite() {
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	// The pod writes are bounded per reconcile, the counts written first:
	// a parent with thousands of pods to track (a kind that just opted in
	// to totals) holds a worker for one batch at a time, and its counts and
	// those of the other parents stay current meanwhile.
	track, release := batch(step.Track, step.Release)
	if err := r.trackAll(ctx, track); err != nil {
		return reconcile.Result{}, err
	}
	if err := r.releaseAll(ctx, parent.GetUID(), release, "released"); err != nil {
		return reconcile.Result{}, err
	}
	if len(release) > 0 || len(track) < len(step.Track) || !step.Settled() {
		// Fold the released pods (the cache may never show a change: a
		// finalizer that was gone already), and take the next batch.
		return reconcile.Result{RequeueAfter: foldRequeue}, nil
	}
	return reconcile.Result{}, nil
}

// totalsServed reports whether the API server serves the kind's totals, once
// they were checked.
func (r *Reconciler) totalsServed(ctx context.Context) bool {
	if r.Totals == nil {
		return true
	}
	return r.Totals.Wait(ctx) == nil && r.Totals.Serves(r.gvk.GroupKind())
}

// foldRequeue is when a parent whose pods were just released is reconciled
// again to fold them; their watch events usually bring it back sooner.
const foldRequeue = 200 * time.Millisecond

// untracked returns the pods that carry the tracking finalizer although
// the kind keeps no totals.
func (r *Reconciler) untracked(pods []*Pod) []*Pod {
	var out []*Pod
	for _, p := range pods {
		if p.Tracking {
			out = append(out, p)
		}
	}
	return out
}

// releaseOrphans removes the tracking finalizer from the pods of a parent of
// this kind named name that is gone (current is the UID of the parent that
// exists under that name, "" when none). At most PodBatch are released at
// once; the parent is requeued for the others.
func (r *Reconciler) releaseOrphans(ctx context.Context, name types.NamespacedName, current types.UID) (reconcile.Result, error) {
	orphans, err := r.orphans(ctx, name, current)
	if err != nil || len(orphans) == 0 || !r.mayWrite() {
		return reconcile.Result{}, err
	}
	return r.releaseBatch(ctx, orphans, "orphaned")
}

// releaseBatch releases at most PodBatch of pods, none of them recorded, and
// asks for the parent to be reconciled again when some are left.
func (r *Reconciler) releaseBatch(ctx context.Context, pods []*Pod, action string) (reconcile.Result, error) {
	if len(pods) > PodBatch {
		return reconcile.Result{RequeueAfter: foldRequeue}, r.releaseAll(ctx, "", pods[:PodBatch], action)
	}
	return reconcile.Result{}, r.releaseAll(ctx, "", pods, action)
}

func (r *Reconciler) mayWrite() bool { return r.MayWrite == nil || r.MayWrite() }

// parentOf maps a pod to the parent of this reconciler's kind that controls
// it, and records the change as pending.
func (r *Reconciler) parentOf(_ context.Context, obj client.Object) []reconcile.Request {
	pod, ok := obj.(*Pod)
	if !ok || pod.Controller.Kind != r.gvk.GroupKind() {
		return nil
	}
	return r.pendingRequest(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name})
}

// self maps a parent to itself, and records the change as pending.
func (r *Reconciler) self(_ context.Context, obj client.Object) []reconcile.Request {
	return r.pendingRequest(client.ObjectKeyFromObject(obj))
}

// enqueue has the parent of pod reconciled: pod was read by a sweep, or is
// gone before its stamp.
func (r *Reconciler) enqueue(pod *Pod) {
	if q := r.queue.Load(); q != nil {
		for _, req := range r.pendingRequest(types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name}) {
			(*q).Add(req)
		}
	}
}

func (r *Reconciler) pendingRequest(name types.NamespacedName) []reconcile.Request {
	changes.seen(parentKey{kind: r.gvk.GroupKind(), name: name}, time.Now())
	return []reconcile.Request{{NamespacedName: name}}
}
