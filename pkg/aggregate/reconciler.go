package aggregate

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
)

// FieldManager is the server-side apply field manager under which the
// aggregator owns the mapped status fields.
const FieldManager = "tally-aggregator"

// Reconciler keeps one parent kind's mapped status fields equal to the
// counts of each parent's pods.
type Reconciler struct {
	gvk    schema.GroupVersionKind
	kind   string
	fields []config.Field
	// ledger is the ledger's path; nil when the kind keeps no totals.
	ledger   []string
	releases *releases
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
	// Backfilled waits until the start-up backfill's stamps are cached:
	// nothing is written before.
	Backfilled func(context.Context) error
	// MayWrite, when set, tells whether this replica may still write (it
	// holds the leader lease); a parent is not written while it says no.
	MayWrite func() bool
	Recorder events.EventRecorder
}

var _ reconcile.Reconciler = (*Reconciler)(nil)

// NewReconciler returns the reconciler of one parent kind.
func NewReconciler(parent config.Parent, deps Deps) *Reconciler {
	kind := parent.GroupKind().String()
	return &Reconciler{
		gvk: parent.GroupVersionKind(), kind: kind, fields: parent.Fields(), ledger: parent.LedgerPath(),
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
		return reconcile.Result{}, r.releaseOrphans(ctx, req.NamespacedName, "")
	}
	if err := r.releaseOrphans(ctx, req.NamespacedName, parent.GetUID()); err != nil {
		return reconcile.Result{}, err
	}
	all, err := PodsOf(r.Pods, parent.GetUID())
	if err != nil {
		return reconcile.Result{}, err
	}
	pods := Members(parent.GetNamespace(), parent.GetUID(), all)
	counts := Tally(parent.GetNamespace(), parent.GetUID(), pods)
	if r.ledger == nil {
		return r.applyCounts(ctx, parent, counts, nil, false, r.untracked(pods))
	}

	book, err := ReadBook(parent.Object, r.ledger, r.fields)
	if err != nil {
		r.reportLedger(parent, err)
		return reconcile.Result{}, fmt.Errorf("reading the ledger of %s %s: %w", r.kind, req.NamespacedName, err)
	}
	released := r.releases.of(parent.GetUID())
	has := func(uid types.UID) bool { return released[uid] }
	step := Advance(pods, book, has, nil)
	if step.NeedLive {
		live, err := r.livePods(ctx, parent.GetNamespace(), parent.GetUID())
		if err != nil {
			return reconcile.Result{}, err
		}
		step = Advance(pods, book, has, live)
	}
	counts.CompletedTotal, counts.UnexpectedTotal = step.Book.CompletedTotal, step.Book.UnexpectedTotal
	result, err := r.applyCounts(ctx, parent, counts, &step.Book, !step.Book.Equal(&book), nil)
	if err != nil || result.RequeueAfter > 0 {
		// The ledger holding the pods to release is not written.
		return result, err
	}
	r.releases.settle(parent.GetUID(), pods, &step.Book)
	if !r.mayWrite() {
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	if err := r.trackAll(ctx, step.Track); err != nil {
		return reconcile.Result{}, err
	}
	if err := r.releaseAll(ctx, parent.GetUID(), step.Release, "released"); err != nil {
		return reconcile.Result{}, err
	}
	if len(step.Release) > 0 {
		// Fold them: the cache may never show a change (a finalizer that
		// was gone already).
		return reconcile.Result{RequeueAfter: foldRequeue}, nil
	}
	return reconcile.Result{}, nil
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
// exists under that name, "" when none).
func (r *Reconciler) releaseOrphans(ctx context.Context, name types.NamespacedName, current types.UID) error {
	orphans, err := r.orphans(ctx, name, current)
	if err != nil || len(orphans) == 0 {
		return err
	}
	if !r.mayWrite() {
		return nil
	}
	return r.releaseAll(ctx, "", orphans, "orphaned")
}

func (r *Reconciler) mayWrite() bool { return r.MayWrite == nil || r.MayWrite() }

// applyCounts writes the counts (and book, the ledger and totals, for a
// kind with totals) when they differ from what the parent shows (bookChanged
// for the ledger), then removes the finalizer of the pods in orphaned.
func (r *Reconciler) applyCounts(ctx context.Context, parent *unstructured.Unstructured, counts Counts, book *Book, bookChanged bool, orphaned []*Pod) (reconcile.Result, error) {
	if !bookChanged && !r.differs(parent, counts) {
		r.skipped.Inc()
	} else {
		if !r.mayWrite() {
			// A deposed leader that has not noticed yet: the new leader
			// writes.
			r.fenced.Inc()
			return reconcile.Result{RequeueAfter: conflictRequeue}, nil
		}
		if result, err := r.apply(ctx, parent, counts, book); err != nil || result.RequeueAfter > 0 {
			return result, err
		}
	}
	if len(orphaned) > 0 && r.mayWrite() {
		return reconcile.Result{}, r.releaseAll(ctx, "", orphaned, "orphaned")
	}
	return reconcile.Result{}, nil
}

// differs reports whether any mapped field of parent does not hold its
// count.
func (r *Reconciler) differs(parent *unstructured.Unstructured, counts Counts) bool {
	for _, f := range r.fields {
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
// exactly the mapped fields. The resourceVersion of the parent the counts
// were computed against is a precondition: a parent deleted and created
// again under the same name is never written with the old one's counts, and
// a writer whose cache is behind (a deposed leader) gets a conflict instead
// of overwriting newer counts. (A UID in an apply is not a precondition: the
// API server ignores it.)
func (r *Reconciler) apply(ctx context.Context, parent *unstructured.Unstructured, counts Counts, book *Book) (reconcile.Result, error) {
	key := client.ObjectKeyFromObject(parent)
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": r.gvk.GroupVersion().String(),
		"kind":       r.gvk.Kind,
		"metadata": map[string]any{
			"name": parent.GetName(), "namespace": parent.GetNamespace(), "resourceVersion": parent.GetResourceVersion(),
		},
	}}
	for _, f := range r.fields {
		if err := unstructured.SetNestedField(obj.Object, counts.Get(f.Count), f.Path...); err != nil {
			return reconcile.Result{}, fmt.Errorf("building status of %s %s: %w", r.kind, key, err)
		}
	}
	if book != nil {
		// The whole ledger, changed or not: an apply that leaves out a
		// field this manager owns removes it.
		if err := unstructured.SetNestedField(obj.Object, book.LedgerValue(), r.ledger...); err != nil {
			return reconcile.Result{}, fmt.Errorf("building status of %s %s: %w", r.kind, key, err)
		}
	}
	err := r.Writer.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(FieldManager), client.ForceOwnership)
	switch {
	case err == nil:
		r.applied.Inc()
		// The schema declares every mapped field, and the status is served
		// (again).
		kindProblems.DeleteLabelValues(r.kind, "field-not-in-schema")
		kindProblems.DeleteLabelValues(r.kind, "status-not-found")
		if log := log.FromContext(ctx).V(1); log.Enabled() {
			log.Info("Applied counts", "counts", counts, "ledger", book != nil)
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
		r.reportSchema(ctx, parent, err)
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
// mapped field, so the API server refuses to apply it.
func (r *Reconciler) reportSchema(ctx context.Context, parent *unstructured.Unstructured, err error) {
	r.failed.Inc()
	kindProblems.WithLabelValues(r.kind, "field-not-in-schema").Set(1)
	paths := make([]string, 0, len(r.fields)+1)
	for _, f := range r.fields {
		paths = append(paths, strings.Join(f.Path, "."))
	}
	if r.ledger != nil {
		paths = append(paths, strings.Join(r.ledger, ".")+" (an object with the lists completed and unexpected)")
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

func (r *Reconciler) pendingRequest(name types.NamespacedName) []reconcile.Request {
	changes.seen(parentKey{kind: r.gvk.GroupKind(), name: name}, time.Now())
	return []reconcile.Request{{NamespacedName: name}}
}
