package aggregate

import (
	"context"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"tally.dev/tally/pkg/servable"
)

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
