package servable

import (
	"errors"
	"testing"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"

	"tally.dev/tally/pkg/config"
)

// answers is a TotalsChecker that gives its answers in turn.
type answers []*Problem

func (a *answers) Totals(config.Parent) *Problem {
	next := (*a)[0]
	*a = (*a)[1:]
	return next
}

// TestGateKeepsWhatItKnewOverATransientError: once the API server said a
// kind keeps totals (or cannot), a check that cannot tell does not undo
// it; before anything was known, the kind is not served.
func TestGateKeepsWhatItKnewOverATransientError(t *testing.T) {
	pools := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Ledger: "status.tallyLedger",
		Counts: map[config.Count]string{config.CompletedTotal: "status.completedTotal"}}
	transient := unknown("schema-unknown", errors.New("reading the API server's schemas: connection refused"))
	undeclared := &Problem{Name: "totals-not-in-schema", Err: errors.New("not declared")}
	tests := []struct {
		name    string
		answers answers
		serves  []bool
	}{
		{"served, then a failed read", answers{nil, transient, nil}, []bool{true, true, true}},
		{"not served, then a failed read", answers{undeclared, transient, nil}, []bool{false, false, true}},
		{"a failed read first", answers{transient, nil}, []bool{false, true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewGate(&tt.answers, []config.Parent{pools}, logr.Discard())
			for i, want := range tt.serves {
				g.Check()
				assert.Equal(t, want, g.Serves(pools.GroupKind()), "after check %d", i+1)
			}
		})
	}
}
