package repo

import (
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLastCommit(t *testing.T) {
	revision, at, err := LastCommit(Root())
	require.NoError(t, err)
	out, err := exec.Command("git", "-C", Root(), "rev-parse", "HEAD").Output()
	require.NoError(t, err)
	assert.Equal(t, strings.TrimSpace(string(out)), revision)
	assert.False(t, at.IsZero())
	assert.Equal(t, time.UTC, at.Location())

	_, _, err = LastCommit(t.TempDir())
	assert.ErrorContains(t, err, "reading the last commit")
}
