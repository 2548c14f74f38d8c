package aggregate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/servable"
)

// reconcileTotals writes the counts of a parent whose kind keeps totals,
// then takes a step of the ledger protocol: decide what to record, release
// and track (Advance), apply the ledger and the totals in one apply, then
// write the pods' finalizers, a batch at a time.
func (r *Reconciler) reconcileTotals(ctx context.Context, parent *unstructured.Unstructured, pods []*count.Pod, counts count.Counts) (reconcile.Result, error) {
	book, err := ledger.ReadBook(parent.Object, r.ledger, r.totals)
	if err != nil {
		r.reportLedger(parent, err)
		return reconcile.Result{}, fmt.Errorf("reading the ledger of %s %s: %w", r.kind, client.ObjectKeyFromObject(parent), err)
	}
	// The counts first: they do not wait for the pods read below. The
	// counts' apply leaves out the totals and the ledger, which would
	// remove them while the counts' manager still owns them (an
	// installation of the single-manager layout): they are handed over
	// first.
	own := ownershipOf(parent)
	if r.countsHoldHistory(parent, own) {
		if result, err := r.applyTotals(ctx, parent, own, nil); err != nil || result.RequeueAfter > 0 {
			return result, err
		}
	}
	// Totals never depend on counts: a counts apply the API server refuses
	// (a field its schema does not declare, a value it does not validate)
	// is reported and retried, and the ledger step is taken all the same. A
	// requeue (a conflict, this replica fenced) is another matter: the
	// totals' apply holds the same precondition and would meet the same.
	countsResult, countsErr := r.writeCounts(ctx, parent, counts)
	if countsErr == nil && countsResult.RequeueAfter > 0 {
		return countsResult, nil
	}
	result, err := r.stepTotals(ctx, parent, pods, book, own)
	switch {
	case countsErr == nil:
		return result, err
	case err == nil && result.RequeueAfter > 0:
		// The step comes back soon: the counts are tried again then.
		log.FromContext(ctx).Error(countsErr, "Applying the counts failed; the ledger step was taken all the same, the counts are tried again")
		return result, nil
	}
	return result, errors.Join(countsErr, err)
}

// stepTotals takes a step of the ledger protocol once the kind's totals are
// served: the ledger and totals in one apply, then the pods' finalizers.
func (r *Reconciler) stepTotals(ctx context.Context, parent *unstructured.Unstructured, pods []*count.Pod, book ledger.Book, own ownership) (reconcile.Result, error) {
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
	// Served: the schema declares the totals and the ledger (again).
	kindProblems.DeleteLabelValues(r.kind, schemaProblem(TotalsFieldManager))
	// A ledger renamed: its UIDs move into the one mapped now, and the old
	// one goes in the same apply.
	_, old := r.history(parent, own, true)
	if err := mergeLedgers(parent.Object, &book, old); err != nil {
		r.reportLedger(parent, err)
		return reconcile.Result{}, fmt.Errorf("reading an earlier ledger of %s %s: %w", r.kind, client.ObjectKeyFromObject(parent), err)
	}
	step, result, err := r.record(ctx, parent, pods, book, own, len(old) > 0)
	if err != nil || result.RequeueAfter > 0 {
		// The ledger holding the pods to release is not written.
		return result, err
	}
	r.releases.settle(parent.GetUID(), pods, &book, &step.Book)
	return r.writeFinalizers(ctx, parent, &step)
}

// record decides the step and writes the ledger and totals it holds (also
// when merged, an earlier ledger to remove). From the pods' confirmation
// to the apply, Unrecorded releases none of the parent's pods as lost (see
// recordLocks): a pod is never both recorded and counted as lost.
//
// A record tried to its end is reported to Unrecorded, with when it began:
// a pod past the hold limit is released uncounted only after its parent had
// that chance. A ledger written, or one the API server refused (refused),
// is such a chance, and so is a step that needed no write; a record that
// waits for a fold, could not confirm the pods, or whose apply was fenced,
// met a conflict, was throttled, was not sent in time (after a wait in the
// client's rate limiter) or failed on the way (a connection refused, a 5xx,
// a 404 from an API server that has not read its CRDs yet) is not.
func (r *Reconciler) record(ctx context.Context, parent *unstructured.Unstructured, pods []*count.Pod, book ledger.Book, own ownership, merged bool) (ledger.Step, reconcile.Result, error) {
	key := parentKey{kind: r.gvk.GroupKind(), name: client.ObjectKeyFromObject(parent)}
	defer r.recording.lock(key)()
	began := time.Now()
	step, released, err := r.decide(ctx, parent, pods, book)
	if err != nil {
		return ledger.Step{}, reconcile.Result{}, err
	}
	if wait := ledger.FoldWait(&book, &step, released, time.Now()); wait > 0 {
		return ledger.Step{}, reconcile.Result{RequeueAfter: wait}, nil
	}
	if merged || !step.Book.Equal(&book) {
		result, err := r.applyTotals(ctx, parent, own, &step.Book)
		if err == nil && result.RequeueAfter == 0 || refused(err) {
			r.tried(key, began)
		}
		if err != nil || result.RequeueAfter > 0 {
			return ledger.Step{}, result, err
		}
		return step, reconcile.Result{}, nil
	}
	r.tried(key, began)
	return step, reconcile.Result{}, nil
}

// refused reports whether err is the API server's refusal of a write: a
// 4xx other than unauthorized (credentials that expired on the way), not
// found, a timeout, a conflict or throttling, which the same write sent
// again would meet again (a policy, validation, a permission).
func refused(err error) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return false
	}
	switch code := status.Status().Code; code {
	case http.StatusUnauthorized, http.StatusNotFound, http.StatusRequestTimeout, http.StatusConflict, http.StatusTooManyRequests:
		return false
	default:
		return code >= 400 && code < 500
	}
}

// tried reports a record of key tried, that began at began.
func (r *Reconciler) tried(key parentKey, began time.Time) {
	if r.Deps.reconciled != nil {
		r.Deps.reconciled.recorded(key, began)
	}
}

// decide takes the ledger protocol's step from the cache, confirming with
// the API server what the cache cannot tell. It returns the step and the
// pods this process released, with when.
func (r *Reconciler) decide(ctx context.Context, parent client.Object, pods []*count.Pod, book ledger.Book) (ledger.Step, map[types.UID]time.Time, error) {
	released := r.releases.of(parent.GetUID())
	has := func(uid types.UID) bool { _, ok := released[uid]; return ok }
	step := ledger.Advance(pods, book, has, ledger.Live{})
	if !step.Settled() {
		live, err := r.confirm(ctx, parent, &step)
		if err != nil {
			return ledger.Step{}, nil, err
		}
		step = ledger.Advance(pods, book, has, live)
	}
	return step, released, nil
}

// writeFinalizers tracks and releases the pods step names once the ledger
// holding them is written. The pod writes are bounded per reconcile, the
// counts written first: a parent with thousands of pods to track (a kind
// that just opted in to totals) holds a worker for one batch at a time, and
// its counts and those of the other parents stay current meanwhile.
func (r *Reconciler) writeFinalizers(ctx context.Context, parent client.Object, step *ledger.Step) (reconcile.Result, error) {
	if !r.mayWrite(ctx) {
		return reconcile.Result{RequeueAfter: conflictRequeue}, nil
	}
	track, release := ledger.Batch(step.Track, step.Release)
	// The releases first, and each pod on its own: a pod recorded in the
	// ledger just written never waits on a finalizer that could not be
	// added to another.
	releaseErr := r.releaseAll(ctx, parent.GetUID(), release, "released")
	if err := errors.Join(releaseErr, r.trackAll(ctx, track)); err != nil {
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
