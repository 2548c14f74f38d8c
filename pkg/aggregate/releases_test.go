package aggregate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/ledger"
)

// TestReleasesOutliveAStaleParent: a released pod is remembered while
// either ledger holds it, so that a reconcile reading a parent one write
// behind (the fold not yet cached) neither reads nor lists it.
func TestReleasesOutliveAStaleParent(t *testing.T) {
	r := newReleases()
	r.add("parent", "p")
	folded := &ledger.Book{UnexpectedTotal: 1}
	stale := &ledger.Book{Unexpected: []types.UID{"p"}}
	remembered := func() bool { _, ok := r.of("parent")["p"]; return ok }
	r.settle("parent", nil, stale, folded)
	assert.True(t, remembered(), "the cached parent still shows it in its ledger")
	r.settle("parent", nil, &ledger.Book{Unexpected: []types.UID{"p"}, UnexpectedTotal: 0}, &ledger.Book{Unexpected: []types.UID{"p"}})
	assert.True(t, remembered(), "just recorded and released")
	r.settle("parent", nil, folded, folded)
	assert.False(t, remembered(), "folded, and the cache shows it")
}
