package aggregate

import (
	"context"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"tally.dev/tally/pkg/servable"
)

// reportSchema reports that the parent kind's schema does not declare a
// field manager writes, so the API server refuses to apply it. A refused
// apply of the totals stops the kind's totals until the schema declares
// them: its pods are released. A refused apply of the counts stops only
// the counts: the ledger and the totals are written all the same.
func (r *Reconciler) reportSchema(_ context.Context, parent *unstructured.Unstructured, manager string, err error) {
	r.failed.Inc()
	kindProblems.WithLabelValues(r.kind, schemaProblem(manager)).Set(1)
	fields, what, still := r.counts, "counts", ""
	var paths []string
	if manager == TotalsFieldManager {
		fields, what = r.totals, "totals"
		paths = append(paths, strings.Join(r.ledger, ".")+" (an object with the lists completed and unexpected)")
		if r.Totals != nil {
			r.Totals.Report(r.gvk.GroupKind(), &servable.Problem{Name: "totals-not-in-schema", Err: err})
		}
	} else if r.ledger != nil {
		still = "; the totals and the ledger are kept all the same"
	}
	for _, f := range fields {
		paths = append(paths, strings.Join(f.Path, "."))
	}
	r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "StatusFieldNotInSchema", "Apply"+strings.ToUpper(what[:1])+what[1:],
		"tally cannot write the %s: the schema of %s must declare %s (%v)%s", what, r.kind, strings.Join(paths, ", "), err, still)
}

// schemaProblem names, in tally_aggregator_parent_kind_problems, a schema
// that refuses a field manager writes: the counts' and the totals' apart,
// since one does not stop the other.
func schemaProblem(manager string) string {
	if manager == TotalsFieldManager {
		return "totals-not-in-schema"
	}
	return "field-not-in-schema"
}

// reportLedger reports a ledger or total that tally cannot read (edited by
// hand, or declared with another type): nothing is written until it is
// fixed, so that no total is lost or counted twice.
func (r *Reconciler) reportLedger(parent *unstructured.Unstructured, err error) {
	r.failed.Inc()
	r.Recorder.Eventf(parent, nil, corev1.EventTypeWarning, "LedgerUnreadable", "ApplyTotals",
		"tally cannot update the totals: %v", err)
}
