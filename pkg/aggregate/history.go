package aggregate

import (
	"encoding/json"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"tally.dev/tally/pkg/aggregate/ledger"
)

// No configuration change erases history. Server-side apply removes a
// field its manager owned when an apply of that manager leaves it out, so
// every apply under TotalsFieldManager holds, besides the totals and the
// ledger mapped now, every other status field that manager owns, with its
// value: a total unmapped or renamed keeps its last value where it was. A
// ledger that was renamed is different: its UIDs were recorded but not yet
// folded, so they move into the ledger mapped now and the old one goes, in
// one apply. And the history the counts' manager holds (the single-manager
// layout wrote the totals and the ledger with the counts) is handed over to
// TotalsFieldManager, values unchanged, before the counts' apply would
// remove it; this is also done for a kind that keeps no totals any more.

// ownership holds the status fields (leaves, as paths from the object's
// root) that each of tally's field managers owns through applies to a
// parent's status subresource, read once per reconcile from its managed
// fields.
type ownership struct{ counts, totals [][]string }

func ownershipOf(parent *unstructured.Unstructured) ownership {
	var o ownership
	for _, mf := range parent.GetManagedFields() {
		if mf.Subresource != "status" || mf.Operation != metav1.ManagedFieldsOperationApply || mf.FieldsV1 == nil {
			continue
		}
		var owned *[][]string
		switch mf.Manager {
		case FieldManager:
			owned = &o.counts
		case TotalsFieldManager:
			owned = &o.totals
		default:
			continue
		}
		var set map[string]any
		if json.Unmarshal(mf.FieldsV1.GetRawBytes(), &set) != nil {
			continue
		}
		leaves(set, nil, func(path []string) { *owned = append(*owned, path) })
	}
	return o
}

// leaves calls leaf with the path of every field of a managed fields set
// (FieldsV1) that holds no field itself. List entries ("k:", "v:") belong
// to their list.
func leaves(set map[string]any, path []string, leaf func([]string)) {
	fields := false
	for key, sub := range set {
		name, ok := strings.CutPrefix(key, "f:")
		if !ok {
			continue
		}
		fields = true
		next, _ := sub.(map[string]any)
		leaves(next, append(slices.Clone(path), name), leaf)
	}
	if !fields && len(path) > 0 {
		leaf(path)
	}
}

// within reports whether path is one of paths, or inside one.
func within(path []string, paths [][]string) bool {
	for _, p := range paths {
		if len(p) > 0 && len(path) >= len(p) && slices.Equal(path[:len(p)], p) {
			return true
		}
	}
	return false
}

// ledgerAt returns the ledger that holds field, when field is the
// completed or unexpected list of an object shaped as a ledger (nothing
// else in it).
func ledgerAt(obj map[string]any, field []string) ([]string, bool) {
	if len(field) < 2 || (field[len(field)-1] != "completed" && field[len(field)-1] != "unexpected") {
		return nil, false
	}
	ledger := field[:len(field)-1]
	v, found, _ := unstructured.NestedFieldNoCopy(obj, ledger...)
	m, ok := v.(map[string]any)
	if !found || !ok || len(m) == 0 {
		return nil, false
	}
	for key, list := range m {
		if _, isList := list.([]any); (key != "completed" && key != "unexpected") || (list != nil && !isList) {
			return nil, false
		}
	}
	return ledger, true
}

// mappedHistory returns the paths of the totals and the ledger the kind
// maps now.
func (r *Reconciler) mappedHistory() [][]string {
	var paths [][]string
	for _, f := range r.totals {
		paths = append(paths, f.Path)
	}
	if r.ledger != nil {
		paths = append(paths, r.ledger)
	}
	return paths
}

func (r *Reconciler) countPaths() [][]string {
	paths := make([][]string, 0, len(r.counts))
	for _, f := range r.counts {
		paths = append(paths, f.Path)
	}
	return paths
}

// countsHoldHistory reports whether FieldManager owns a total or a ledger
// of parent (the single-manager layout's history, mapped now or not) that
// TotalsFieldManager does not own too: history an apply of the counts
// would remove.
func (r *Reconciler) countsHoldHistory(parent *unstructured.Unstructured, own ownership) bool {
	mapped := r.mappedHistory()
	for _, field := range own.counts {
		if within(field, own.totals) {
			continue
		}
		if within(field, mapped) {
			return true
		}
		if _, ok := ledgerAt(parent.Object, field); ok {
			return true
		}
	}
	return false
}

// history returns the status fields, by dotted path, that an apply under
// TotalsFieldManager must hold besides the totals and the ledger it writes:
// the fields it owns and does not map now, and the history the counts'
// manager holds, each with its value. With merge, the ledgers it owns at
// another path than the kind's ledger are returned apart (old), to be
// merged into the book and left out; without, the totals and ledger mapped
// now are kept too, as they are (a hand-over that writes no new value).
func (r *Reconciler) history(parent *unstructured.Unstructured, own ownership, merge bool) (keep map[string]any, old [][]string) {
	keep = map[string]any{}
	mapped := r.mappedHistory()
	consider := func(field []string) {
		if within(field, mapped) && merge {
			// The apply writes it from the book; a value kept here too
			// would overwrite part of it (a ledger's list).
			return
		}
		if ledger, ok := ledgerAt(parent.Object, field); ok && merge {
			if !slices.ContainsFunc(old, func(p []string) bool { return slices.Equal(p, ledger) }) {
				old = append(old, ledger)
			}
			return
		}
		if v, found, _ := unstructured.NestedFieldNoCopy(parent.Object, field...); found {
			keep[strings.Join(field, ".")] = v
		}
	}
	for _, field := range own.totals {
		consider(field)
	}
	// own may have been read before this reconcile handed the counts'
	// history over: the same rules hold for it.
	if r.countsHoldHistory(parent, own) {
		counts := r.countPaths()
		for _, field := range own.counts {
			if !within(field, counts) {
				consider(field)
			}
		}
	}
	return keep, old
}

// mergeLedgers adds to book the UIDs of the ledgers at paths old, once each.
func mergeLedgers(obj map[string]any, book *ledger.Book, old [][]string) error {
	for _, path := range old {
		moved, err := ledger.ReadBook(obj, path, nil)
		if err != nil {
			return err
		}
		for _, uid := range moved.Completed {
			if !book.Has(uid) {
				book.Completed = append(book.Completed, uid)
			}
		}
		for _, uid := range moved.Unexpected {
			if !book.Has(uid) {
				book.Unexpected = append(book.Unexpected, uid)
			}
		}
	}
	return nil
}
