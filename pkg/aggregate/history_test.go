package aggregate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/config"
)

// parentWith returns a parent whose status is status, its fields owned by
// the given managers (FieldsV1 JSON, applied to the status subresource).
func parentWith(status map[string]any, owners map[string]string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{"status": status}}
	var mfs []metav1.ManagedFieldsEntry
	for manager, fields := range owners {
		mfs = append(mfs, metav1.ManagedFieldsEntry{Manager: manager, Operation: metav1.ManagedFieldsOperationApply,
			Subresource: "status", FieldsType: "FieldsV1", FieldsV1: metav1.NewFieldsV1(fields)})
	}
	u.SetManagedFields(mfs)
	return u
}

func reconcilerFor(counts map[config.Count]string, ledger string) *Reconciler {
	return NewReconciler(config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "HistoryPool", Counts: counts, Ledger: ledger}, Deps{})
}

func TestHistory(t *testing.T) {
	both := map[config.Count]string{config.Active: "status.active", config.CompletedTotal: "status.completedTotal", config.UnexpectedTotal: "status.unexpectedTotal"}
	ledger := map[string]any{"completed": []any{"c1"}, "unexpected": []any{"u1"}}
	status := map[string]any{"active": int64(3), "completedTotal": int64(5), "unexpectedTotal": int64(7), "tallyLedger": ledger}
	totalsOwned := `{"f:status":{"f:completedTotal":{},"f:unexpectedTotal":{},"f:tallyLedger":{".":{},"f:completed":{},"f:unexpected":{}}}}`
	countsOwned := `{"f:status":{"f:active":{}}}`

	tests := []struct {
		name        string
		counts      map[config.Count]string
		ledger      string
		owners      map[string]string
		merge       bool
		wantKeep    map[string]any
		wantOld     [][]string
		wantHandOff bool
	}{
		{name: "nothing changed: nothing to keep besides what is mapped",
			counts: both, ledger: "status.tallyLedger", owners: map[string]string{TotalsFieldManager: totalsOwned, FieldManager: countsOwned},
			merge: true, wantKeep: map[string]any{}},
		{name: "a total unmapped keeps its last value",
			counts: map[config.Count]string{config.Active: "status.active", config.CompletedTotal: "status.completedTotal"}, ledger: "status.tallyLedger",
			owners: map[string]string{TotalsFieldManager: totalsOwned, FieldManager: countsOwned},
			merge:  true, wantKeep: map[string]any{"status.unexpectedTotal": int64(7)}},
		{name: "the ledger renamed: the old one is merged, not kept",
			counts: both, ledger: "status.ledgerV2",
			owners: map[string]string{TotalsFieldManager: totalsOwned, FieldManager: countsOwned},
			merge:  true, wantKeep: map[string]any{}, wantOld: [][]string{{"status", "tallyLedger"}}},
		{name: "a hand-over keeps what is mapped, as it is",
			counts: both, ledger: "status.tallyLedger", owners: map[string]string{TotalsFieldManager: totalsOwned},
			wantKeep: map[string]any{"status.completedTotal": int64(5), "status.unexpectedTotal": int64(7), "status.tallyLedger.completed": []any{"c1"}, "status.tallyLedger.unexpected": []any{"u1"}}},
		{name: "the single-manager layout opted out: its totals and ledger are handed over",
			counts:      map[config.Count]string{config.Active: "status.active"},
			owners:      map[string]string{FieldManager: `{"f:status":{"f:active":{},"f:completedTotal":{},"f:unexpectedTotal":{},"f:tallyLedger":{".":{},"f:completed":{},"f:unexpected":{}}}}`},
			wantKeep:    map[string]any{"status.completedTotal": int64(5), "status.unexpectedTotal": int64(7), "status.tallyLedger.completed": []any{"c1"}, "status.tallyLedger.unexpected": []any{"u1"}},
			wantHandOff: true},
		{name: "handed over in this reconcile, ownership read before: the book's write keeps nothing it maps",
			counts: both, ledger: "status.tallyLedger",
			owners: map[string]string{FieldManager: `{"f:status":{"f:active":{},"f:completedTotal":{},"f:unexpectedTotal":{},"f:tallyLedger":{".":{},"f:completed":{},"f:unexpected":{}}}}`},
			merge:  true, wantKeep: map[string]any{}, wantHandOff: true},
		{name: "the single-manager layout's ledger renamed: merged, not kept",
			counts: both, ledger: "status.ledgerV2",
			owners: map[string]string{FieldManager: `{"f:status":{"f:active":{},"f:completedTotal":{},"f:unexpectedTotal":{},"f:tallyLedger":{".":{},"f:completed":{},"f:unexpected":{}}}}`},
			merge:  true, wantKeep: map[string]any{}, wantOld: [][]string{{"status", "tallyLedger"}}, wantHandOff: true},
		{name: "counts alone, never totals: the counts' manager holds no history",
			counts: map[config.Count]string{config.Active: "status.active"}, owners: map[string]string{FieldManager: `{"f:status":{"f:active":{},"f:completing":{}}}`},
			wantKeep: map[string]any{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := reconcilerFor(tt.counts, tt.ledger)
			parent := parentWith(status, tt.owners)
			own := ownershipOf(parent)
			assert.Equal(t, tt.wantHandOff, r.countsHoldHistory(parent, own))
			keep, old := r.history(parent, own, tt.merge)
			assert.Equal(t, tt.wantKeep, keep)
			assert.Equal(t, tt.wantOld, old)
		})
	}
}

func TestMergeLedgers(t *testing.T) {
	obj := map[string]any{"status": map[string]any{"old": map[string]any{"completed": []any{"a", "b"}, "unexpected": []any{"c"}}}}
	book := ledger.Book{Completed: []types.UID{"a"}, CompletedTotal: 4}
	require.NoError(t, mergeLedgers(obj, &book, [][]string{{"status", "old"}}))
	assert.Equal(t, ledger.Book{Completed: []types.UID{"a", "b"}, Unexpected: []types.UID{"c"}, CompletedTotal: 4}, book, "each UID once")
}

func TestOverlapping(t *testing.T) {
	tests := []struct {
		values map[string]any
		want   bool
	}{
		{map[string]any{"status.a": 1, "status.a-b": 2, "status.ab": 3}, false},
		{map[string]any{"status.a": 1, "status.a-b": 2, "status.a.c": 3}, true},
		{map[string]any{"status.tallyLedger": 1, "status.tallyLedger.completed": 2}, true},
	}
	for _, tt := range tests {
		_, _, got := overlapping(tt.values)
		assert.Equal(t, tt.want, got, "%v", tt.values)
	}
}
