package mutate

import (
	"testing"

	"tally.dev/tally/pkg/config"
)

// BenchmarkMatchConditions evaluates the registration's match conditions
// with the API server's own matcher, as it does for the CREATE of a pod its
// operator stamped, which the webhook is not called for: what tally costs
// the API server on such a CREATE, beside finding the registration.
func BenchmarkMatchConditions(b *testing.B) {
	cfg := config.Config{Parents: []config.Parent{poolKind}}
	m := compileConditions(b, MatchConditions(&cfg))
	in := Input{Operation: Create, Pod: prestamped(controllerRef("example.tally.dev/v1", "WorkerPool", "pool-a", uid)), User: user}
	if m.calls(b, in) {
		b.Fatal("the webhook would be called for a stamped pod")
	}
	for b.Loop() {
		m.calls(b, in)
	}
}
