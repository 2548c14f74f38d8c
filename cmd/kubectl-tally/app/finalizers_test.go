package app

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestWithin: the namespaces finalizers remove goes through, from -A or
// --namespaces (given together, or a name that is not a namespace's,
// refused).
func TestWithin(t *testing.T) {
	o := &options{}
	got, err := o.within(true, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{""}, got)
	got, err = o.within(false, []string{"workers", "batch"})
	require.NoError(t, err)
	assert.Equal(t, []string{"workers", "batch"}, got)
	_, err = o.within(true, []string{"workers"})
	assert.ErrorContains(t, err, "--all-namespaces and --namespaces cannot be given together")
	_, err = o.within(false, []string{"Workers"})
	assert.ErrorContains(t, err, `--namespaces: "Workers" is not a namespace name`)
}
