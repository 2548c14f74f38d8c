package aggregate

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

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

// Reconcile recomputes one parent's counts from the cached pods and applies
// the mapped fields whose values differ from what the parent shows. For a
// kind with totals it also takes a step of the ledger protocol (Advance):
// the ledger and totals go in the same apply, then the finalizers of the
// recorded pods are removed. Pods carrying the finalizer whose parent is
// gone, or whose kind keeps no totals, lose it.
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
	all, err := PodsOf(r.Pods, parent.GetUID())
	if err != nil {
		return reconcile.Result{}, err
	}
	pods := Members(parent.GetNamespace(), parent.GetUID(), all)
	// The pods a sweep read, counted before their stamps land; the ledger
	// protocol sees only stamped pods.
	counts := Tally(parent.GetNamespace(), parent.GetUID(), append(r.Unstamped.Of(parent.GetUID(), r.Pods), pods...))
	if r.ledger == nil {
		return r.applyCounts(ctx, parent, counts, r.untracked(pods))
	}

	book, err := ReadBook(parent.Object, r.ledger, r.totals)
	if err != nil {
		r.reportLedger(parent, err)
		return reconcile.Result{}, fmt.Errorf("reading the ledger of %s %s: %w", r.kind, req.NamespacedName, err)
	}
	if !r.totalsServed(ctx) {
		// The totals stay as they are (moved to their own manager if the
		// counts' manager still holds them); Unrecorded releases the pods.
		if r.countsOwnTotals(parent) {
			if result, err := r.applyTotals(ctx, parent, &book, true); err != nil || result.RequeueAfter > 0 {
				return result, err
			}
		}
		if result, err := r.applyCounts(ctx, parent, counts, nil); err != nil || result.RequeueAfter > 0 {
			return result, err
		}
		// Served again later (a CRD fixed, a schema published): track the
		// running pods then.
		after := servable.Interval
		if p := r.Totals.Problem(r.gvk.GroupKind()); p != nil && p.Unknown {
			after = servable.RetryUnknown
		}
		return reconcile.Result{RequeueAfter: after}, nil
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

// PodBatch bounds the pods one reconcile reads from the API server, and the
// finalizer patches it sends: the rest wait for the next reconcile of the
// parent, which follows at once.
const PodBatch = 100

// batch returns the pods to track and to release in one reconcile, at most
// PodBatch in all, releases first: they record the finish of pods.
func batch(track, release []*Pod) ([]*Pod, []*Pod) {
	release = release[:min(len(release), PodBatch)]
	return track[:min(len(track), PodBatch-len(release))], release
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

// FoldDelay is how long the fold of pods this process just released may
// wait for a record to ride with: pods finishing one at a time then cost
// one ledger write each (the next pod's record carries the last one's
// fold) instead of two. The totals show a finished pod at most this late.
const FoldDelay = time.Second

// foldWait returns how long the step may wait before it is written: a step
// that only folds pods this process released less than FoldDelay ago, and
// does nothing else, waits for the next record or for the delay, whichever
// comes first. Zero when it is to be written now.
func foldWait(book *Book, step *Step, released map[types.UID]time.Time, now time.Time) time.Duration {
	if step.Book.Equal(book) || len(step.Release) > 0 || len(step.Track) > 0 || !step.Settled() || book.size() >= MaxLedger/2 {
		return 0
	}
	for _, uid := range slices.Concat(step.Book.Completed, step.Book.Unexpected) {
		if !book.Has(uid) {
			return 0 // a record: written now, with the folds
		}
	}
	wait := FoldDelay
	for _, uid := range slices.Concat(book.Completed, book.Unexpected) {
		if step.Book.Has(uid) {
			continue
		}
		at, ok := released[uid]
		if !ok {
			return 0 // folded from the API server's word: no release to pair with
		}
		// The first released is due first.
		wait = min(wait, FoldDelay-now.Sub(at))
	}
	return max(wait, 0)
}

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
// exists under that name, "" when none). At most PodBatch are released at once; the parent is requeued for
// the others.
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

// applyCounts writes the counts when they differ from what the parent
// shows, then removes the finalizer of the pods in orphaned.
func (r *Reconciler) applyCounts(ctx context.Context, parent *unstructured.Unstructured, counts Counts, orphaned []*Pod) (reconcile.Result, error) {
	if !r.differs(parent, counts) {
		r.skipped.Inc()
	} else {
		values := make(map[string]any, len(r.counts))
		for _, f := range r.counts {
			values[strings.Join(f.Path, ".")] = counts.Get(f.Count)
		}
		if result, err := r.apply(ctx, parent, values, FieldManager); err != nil || result.RequeueAfter > 0 {
			return result, err
		}
	}
	if len(orphaned) > 0 && r.mayWrite() {
		return r.releaseBatch(ctx, orphaned, "orphaned")
	}
	return reconcile.Result{}, nil
}

// applyTotals writes the totals and the ledger of book under
// TotalsFieldManager. present writes only those the parent shows already:
// it moves them from the counts' manager, values unchanged, for a kind whose
// totals cannot be written.
func (r *Reconciler) applyTotals(ctx context.Context, parent *unstructured.Unstructured, book *Book, present bool) (reconcile.Result, error) {
	values := make(map[string]any, len(r.totals)+1)
	for _, f := range r.totals {
		values[strings.Join(f.Path, ".")] = book.Get(f.Count)
	}
	// The whole ledger, changed or not: an apply that leaves out a field
	// its manager owns removes it.
	values[strings.Join(r.ledger, ".")] = book.LedgerValue()
	if present {
		for path := range values {
			if _, found, _ := unstructured.NestedFieldNoCopy(parent.Object, strings.Split(path, ".")...); !found {
				delete(values, path)
			}
		}
		if len(values) == 0 {
			return reconcile.Result{}, nil
		}
	}
	return r.apply(ctx, parent, values, TotalsFieldManager)
}

// countsOwnTotals reports whether FieldManager owns the totals or the
// ledger of parent: an installation of the layout that applied them with
// the counts.
func (r *Reconciler) countsOwnTotals(parent *unstructured.Unstructured) bool {
	paths := [][]string{r.ledger}
	for _, f := range r.totals {
		paths = append(paths, f.Path)
	}
	for _, mf := range parent.GetManagedFields() {
		if mf.Manager != FieldManager || mf.Subresource != "status" || mf.FieldsV1 == nil {
			continue
		}
		var set map[string]any
		if json.Unmarshal(mf.FieldsV1.GetRawBytes(), &set) != nil {
			continue
		}
		for _, path := range paths {
			if ownsPath(set, path) {
				return true
			}
		}
	}
	return false
}

// ownsPath reports whether a managed fields set (FieldsV1) holds path.
func ownsPath(set map[string]any, path []string) bool {
	for _, seg := range path {
		next, ok := set["f:"+seg].(map[string]any)
		if !ok {
			return false
		}
		set = next
	}
	return true
}

// differs reports whether any mapped field of parent does not hold its
// count.
func (r *Reconciler) differs(parent *unstructured.Unstructured, counts Counts) bool {
	for _, f := range r.counts {
		v, found, err := unstructured.NestedFieldNoCopy(parent.Object, f.Path...)
		if err != nil || !found || !equalCount(v, counts.Get(f.Count)) {
			return true
		}
	}
	return false
}

func equalCount(v any, want int64) bool {
	switch n := v.(type) {
	case int64:
		return n == want
	case int32:
		return int64(n) == want
	case int:
		return int64(n) == want
	case float64:
		return n == float64(want)
	}
	return false
}

// conflictRequeue is when a parent whose apply met a newer version is
// reconciled again; its watch event usually brings it back sooner.
const conflictRequeue = time.Second

// apply sends one server-side apply to the status subresource holding
// exactly values (by dotted path) under manager, once this replica may
// write. The resourceVersion of the parent the values were computed against
// is a precondition: a parent deleted and created again under the same name
// is never written with the old one's values, and a writer whose cache is
// behind (a deposed leader) gets a conflict instead of overwriting newer
// ones. (A UID in an apply is not a precondition: the API server ignores
// it.) On success parent takes the new resourceVersion, so that a second
// apply in the same reconcile holds the same precondition.
func (r *Reconciler) apply(ctx context.Context, parent *unstructured.Unstructured, values map[string]any, manager string) (reconcile.Result, error) {
	if !r.mayWrite() {
		// A deposed leader that has not noticed yet: the new leader
		// writes.
		r.fenced.Inc()
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	key := client.ObjectKeyFromObject(parent)
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": r.gvk.GroupVersion().String(),
		"kind":       r.gvk.Kind,
		"metadata": map[string]any{
			"name": parent.GetName(), "namespace": parent.GetNamespace(), "resourceVersion": parent.GetResourceVersion(),
		},
	}}
	for path, v := range values {
		if err := unstructured.SetNestedField(obj.Object, v, strings.Split(path, ".")...); err != nil {
			return reconcile.Result{}, fmt.Errorf("building status of %s %s: %w", r.kind, key, err)
		}
	}
	err := r.Writer.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(manager), client.ForceOwnership)
	switch {
	case err == nil:
		r.applied.Inc()
		parent.SetResourceVersion(obj.GetResourceVersion())
		// The schema declares every mapped field, and the status is served
		// (again).
		kindProblems.DeleteLabelValues(r.kind, "field-not-in-schema")
		kindProblems.DeleteLabelValues(r.kind, "status-not-found")
		if log := log.FromContext(ctx).V(1); log.Enabled() {
			log.Info("Applied status", "manager", manager, "values", values)
		}
		return reconcile.Result{}, nil
	case apierrors.IsConflict(err):
		// The parent changed since the cache showed it: count again on the
		// version the cache is about to receive.
		r.conflicts.Inc()
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	case apierrors.IsNotFound(err):
		return reconcile.Result{}, r.notFound(ctx, parent, err)
	case strings.Contains(err.Error(), "field not declared in schema"):
		// Retried with backoff: the CRD may be fixed at any time.
		r.reportSchema(ctx, parent, manager, err)
		return reconcile.Result{}, fmt.Errorf("applying status of %s %s: %w", r.kind, key, err)
	}
	r.failed.Inc()
	return reconcile.Result{}, fmt.Errorf("applying status of %s %s: %w", r.kind, key, err)
}

// notFound handles a 404 answer to an apply: nothing to do when the parent
// is really gone (its deletion reconciles nothing), an error when it exists
// and its status cannot be reached (a version or a status subresource no
// longer served).
func (r *Reconciler) notFound(ctx context.Context, parent *unstructured.Unstructured, applyErr error) error {
	key := client.ObjectKeyFromObject(parent)
	live := mutate.PartialMetadata(r.gvk)
	err := r.Live.Get(ctx, key, live)
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err == nil && live.GetUID() != parent.GetUID():
		// Replaced: the new parent's own events reconcile it.
		return nil
	}
	r.failed.Inc()
	kindProblems.WithLabelValues(r.kind, "status-not-found").Set(1)
	if err != nil {
		return fmt.Errorf("applying status of %s %s: %w (and reading it: %v)", r.kind, key, applyErr, err)
	}
	return fmt.Errorf("applying status of %s %s: the parent exists but its status is not served as %s: %w", r.kind, key, r.gvk.GroupVersion(), applyErr)
}

// reportSchema reports that the parent kind's schema does not declare a
// mapped field, so the API server refuses to apply it. A refused apply of
// the totals stops the kind's totals until the schema declares them: its
// pods are released.
func (r *Reconciler) reportSchema(_ context.Context, parent *unstructured.Unstructured, manager string, err error) {
	r.failed.Inc()
	kindProblems.WithLabelValues(r.kind, "field-not-in-schema").Set(1)
	fields := r.counts
	var paths []string
	if manager == TotalsFieldManager {
		fields = r.totals
		paths = append(paths, strings.Join(r.ledger, ".")+" (an object with the lists completed and unexpected)")
		if r.Totals != nil {
			r.Totals.Report(r.gvk.GroupKind(), &servable.Problem{Name: "totals-not-in-schema", Err: err})
		}
	}
	for _, f := range fields {
		paths = append(paths, strings.Join(f.Path, "."))
	}
	r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "StatusFieldNotInSchema", "ApplyCounts",
		"tally cannot write the counts: the schema of %s must declare %s (%v)", r.kind, strings.Join(paths, ", "), err)
}

// reportLedger reports a ledger or total that tally cannot read (edited by
// hand, or declared with another type): nothing is written until it is
// fixed, so that no total is lost or counted twice.
func (r *Reconciler) reportLedger(parent *unstructured.Unstructured, err error) {
	r.failed.Inc()
	r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "LedgerUnreadable", "ApplyTotals",
		"tally cannot update the totals: %v", err)
}

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
