package servable

import (
	"errors"
	"testing"
	"time"

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

// TestNotServedOnlyOnceSaidForAWhile: the API server's "not served" (a
// restarted one says so for every custom resource until it has read the
// CRDs) makes a kind not served only once it has lasted NotServedAfter in a
// row; until then the gate keeps what it knew.
func TestNotServedOnlyOnceSaidForAWhile(t *testing.T) {
	pools := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Ledger: "status.tallyLedger",
		Counts: map[config.Count]string{config.CompletedTotal: "status.completedTotal"}}
	notServed := &Problem{Name: "not-served", Err: errors.New("the server could not find the requested resource")}
	tests := []struct {
		name    string
		answers answers
		at      []time.Duration
		serves  []bool
		final   bool // the last check's problem is known
	}{
		{"served, then not served for a moment", answers{nil, notServed, notServed, nil}, []time.Duration{0, 1, 20, 22}, []bool{true, true, true, true}, true},
		{"served, then not served for good", answers{nil, notServed, notServed, notServed}, []time.Duration{0, 1, 20, 31}, []bool{true, true, true, false}, true},
		{"not served from the start", answers{notServed, notServed}, []time.Duration{0, 30}, []bool{false, false}, true},
		{"not served at the first check only", answers{notServed}, []time.Duration{0}, []bool{false}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewGate(&tt.answers, []config.Parent{pools}, logr.Discard())
			start := time.Now()
			for i, want := range tt.serves {
				g.now = func() time.Time { return start.Add(tt.at[i] * time.Second) }
				g.Check()
				assert.Equal(t, want, g.Serves(pools.GroupKind()), "after check %d", i+1)
			}
			problem := g.Problem(pools.GroupKind())
			assert.Equal(t, tt.final, problem == nil || !problem.Unknown, "the last problem: %v", problem)
		})
	}
}
