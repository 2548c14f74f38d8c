package aggregate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/mutate"
)

// applyCounts writes the counts when they differ from what the parent
// shows, then removes the finalizer of the pods in orphaned, for why,
// whatever became of the counts: a release never waits on them.
func (r *Reconciler) applyCounts(ctx context.Context, parent *unstructured.Unstructured, counts count.Counts, orphaned []*count.Pod, why releaseReason) (reconcile.Result, error) {
	result, err := r.writeCounts(ctx, parent, counts)
	if len(orphaned) == 0 {
		return result, err
	}
	released, releaseErr := r.releaseBatch(ctx, orphaned, why, parent)
	return earliest(result, released), errors.Join(err, releaseErr)
}

// writeCounts applies the counts when they differ from what the parent
// shows.
func (r *Reconciler) writeCounts(ctx context.Context, parent *unstructured.Unstructured, counts count.Counts) (reconcile.Result, error) {
	if !r.differs(parent, counts) {
		r.skipped.Inc()
		return reconcile.Result{}, nil
	}
	values := make(map[string]any, len(r.counts))
	for _, f := range r.counts {
		v, known := counts.Value(f)
		if known {
			values[strings.Join(f.Path, ".")] = v
			continue
		}
		// A custom count not known yet (a pod read by a sweep, without
		// its status): what the parent shows stays, still owned (an apply
		// without it would remove it).
		if shown, found, err := unstructured.NestedFieldNoCopy(parent.Object, f.Path...); found && err == nil {
			values[strings.Join(f.Path, ".")] = shown
		}
	}
	return r.apply(ctx, parent, values, FieldManager)
}

// earliest returns the result that brings the parent back sooner: a requeue
// of either, at the earlier of the two times.
func earliest(a, b reconcile.Result) reconcile.Result {
	if a.RequeueAfter == 0 || (b.RequeueAfter > 0 && b.RequeueAfter < a.RequeueAfter) {
		return b
	}
	return a
}

// applyTotals writes, under TotalsFieldManager, the totals and the ledger
// of book, with the history that apply must keep (Reconciler.history): the
// other fields that manager owns, and those the counts' manager hands over.
// A nil book writes no new value: it hands the history over, values
// unchanged, before an apply of the counts would remove it. own is what
// parent's managed fields say each manager owns.
func (r *Reconciler) applyTotals(ctx context.Context, parent *unstructured.Unstructured, own ownership, book *ledger.Book) (reconcile.Result, error) {
	values, _ := r.history(parent, own, book != nil)
	if book != nil {
		for _, f := range r.totals {
			values[strings.Join(f.Path, ".")] = book.Get(f.Count)
		}
		// The whole ledger, changed or not: an apply that leaves out a
		// field its manager owns removes it.
		values[strings.Join(r.ledger, ".")] = book.LedgerValue()
	}
	if len(values) == 0 {
		return reconcile.Result{}, nil
	}
	return r.apply(ctx, parent, values, TotalsFieldManager)
}

// differs reports whether any mapped field of parent does not hold its
// count.
func (r *Reconciler) differs(parent *unstructured.Unstructured, counts count.Counts) bool {
	for _, f := range r.counts {
		want, known := counts.Value(f)
		if !known {
			continue
		}
		v, found, err := unstructured.NestedFieldNoCopy(parent.Object, f.Path...)
		if err != nil || !found || !equalCount(v, want) {
			return true
		}
	}
	return false
}

func equalCount(v any, want int64) bool {
	n, ok := ledger.ToInt64(v)
	return ok && n == want
}

// conflictRequeue is when a parent whose apply met a newer version is
// reconciled again; its watch event usually brings it back sooner.
const conflictRequeue = time.Second

// SendWithin bounds the time from the checks before a status apply to its
// sending: values counted then are not sent later (after a wait in the
// client's rate limiter, a process paused by the kernel or a debugger).
// The request's context carries the time (SendBy), which the aggregator's
// transport checks against the clock just before it sends; a parent whose
// apply missed it is counted again. The API server may take longer to
// answer: only the sending is bounded.
const SendWithin = 2 * time.Second

type sendByKey struct{}

// WithSendBy returns ctx with the time by which a status apply sent with
// it must be sent.
func WithSendBy(ctx context.Context, by time.Time) context.Context {
	return context.WithValue(ctx, sendByKey{}, by)
}

// SendBy returns the time by which the status apply of ctx must be sent,
// if it has one.
func SendBy(ctx context.Context) (time.Time, bool) {
	t, ok := ctx.Value(sendByKey{}).(time.Time)
	return t, ok
}

// ErrSentLate is the error of a status apply not sent by its SendBy time.
var ErrSentLate = errors.New("status apply not sent: its counts are older than aggregate.SendWithin")

// apply sends one server-side apply to the status subresource holding
// exactly values (by dotted path) under manager, once this replica may
// write. The resourceVersion of the parent the values were computed against
// is a precondition: a parent deleted and created again under the same name
// is never written with the old one's values, and values counted against
// an older parent than the API server has get a conflict instead of
// overwriting newer ones (and are counted again on the parent read from the
// API server: what keeps a deposed leader from writing is mayWrite, not
// this precondition). (A UID in an apply is not a precondition: the API
// server ignores it.) On success parent takes the new resourceVersion, so
// that a second apply in the same reconcile holds the same precondition,
// and written records it.
func (r *Reconciler) apply(ctx context.Context, parent *unstructured.Unstructured, values map[string]any, manager string) (reconcile.Result, error) {
	// Set before the checks: a pause right after them counts too.
	sendCtx := WithSendBy(ctx, time.Now().Add(SendWithin))
	if !r.mayWrite(ctx) || !r.sameView(ctx) {
		// A deposed leader that has not noticed yet (the new leader
		// writes), or a pod view that broke since the values were
		// counted: they are counted again.
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
	if a, b, ok := overlapping(values); ok {
		// One would overwrite part of the other, whichever is set last.
		return reconcile.Result{}, fmt.Errorf("building status of %s %s: %s and %s overlap", r.kind, key, a, b)
	}
	for path, v := range values {
		if err := unstructured.SetNestedField(obj.Object, v, strings.Split(path, ".")...); err != nil {
			return reconcile.Result{}, fmt.Errorf("building status of %s %s: %w", r.kind, key, err)
		}
	}
	err := r.Writer.Status().Apply(sendCtx, client.ApplyConfigurationFromUnstructured(obj), client.FieldOwner(manager), client.ForceOwnership)
	switch {
	case err == nil:
		r.applied.Inc()
		r.written.wrote(parentKey{kind: r.gvk.GroupKind(), name: key}, passOf(ctx).cachedVersion(), parent.GetResourceVersion(), obj.GetResourceVersion(), time.Now())
		parent.SetResourceVersion(obj.GetResourceVersion())
		// The schema declares every field this manager writes, and the
		// status is served (again).
		kindProblems.DeleteLabelValues(r.kind, schemaProblem(manager))
		kindProblems.DeleteLabelValues(r.kind, "status-not-found")
		if log := log.FromContext(ctx).V(1); log.Enabled() {
			log.Info("Applied status", "manager", manager, "values", values, "resourceVersion", obj.GetResourceVersion())
		}
		return reconcile.Result{}, nil
	case apierrors.IsConflict(err):
		// The parent changed since it was read: Reconcile counts again on
		// the parent read from the API server, and a conflict there too
		// comes back after conflictRequeue (its watch event usually
		// brings it back sooner).
		r.conflicts.Inc()
		passOf(ctx).lag()
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	case errors.Is(err, ErrSentLate):
		// Not sent within SendWithin of the checks: counted again.
		r.failed.Inc()
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	case apierrors.IsTooManyRequests(err):
		// Throttled (API Priority and Fairness): counted again once the
		// delay the API server asks for has passed, not sent again with
		// the counts of now (the aggregator's client sends an apply once).
		r.failed.Inc()
		delay, _ := apierrors.SuggestsClientDelay(err)
		return reconcile.Result{RequeueAfter: max(time.Duration(delay)*time.Second, conflictRequeue)}, nil
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

// overlapping returns two paths of values one of which lies within the
// other.
func overlapping(values map[string]any) (string, string, bool) {
	for a := range values {
		for b := range values {
			if strings.HasPrefix(b, a+".") {
				return a, b, true
			}
		}
	}
	return "", "", false
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
	case notServed(err) || notServed(applyErr):
		// Not "gone": an API server that has just started answers 404
		// for custom resources until it has read the CRDs. Retried with
		// back-off.
		r.failed.Inc()
		return fmt.Errorf("applying status of %s %s: the API server does not serve %s (yet): %w", r.kind, key, r.gvk.GroupVersion(), applyErr)
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

// gone reports whether err says that the object read does not exist: a
// 404 with a Status, not one that says the resource is not served (yet).
func gone(err error) bool { return apierrors.IsNotFound(err) && !notServed(err) }

// notServed reports whether a 404 says that the API server does not serve
// the resource (its body is not a Status: "404 page not found"), rather
// than that the object does not exist.
func notServed(err error) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) || status.Status().Code != http.StatusNotFound || status.Status().Details == nil {
		return false
	}
	for _, c := range status.Status().Details.Causes {
		if c.Type == metav1.CauseTypeUnexpectedServerResponse {
			return true
		}
	}
	return false
}
