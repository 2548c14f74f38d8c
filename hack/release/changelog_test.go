package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCheckVersion(t *testing.T) {
	for _, v := range []string{"0.1.0", "1.22.333", "1.0.0-rc.1", "2.0.0-alpha-2"} {
		assert.NoError(t, checkVersion(v), v)
	}
	for _, v := range []string{"", "v0.1.0", "0.1", "01.2.3", "1.2.3+build", "1.2.3-", "latest"} {
		assert.Error(t, checkVersion(v), v)
	}
}

func TestReleaseNotes(t *testing.T) {
	const log = "# Changelog\n\nIntro.\n\n## [0.2.0] - 2026-12-24\n\n### Fixed\n- a thing\n\n## [0.1.0] - 2026-12-01\n\nFirst.\n"
	tests := []struct {
		name, changelog, version, want, err string
	}{
		{name: "newest section", changelog: log, version: "0.2.0", want: "### Fixed\n- a thing\n"},
		{name: "the only section", changelog: "## [0.1.0] - 2026-12-01\nFirst.\n", version: "0.1.0", want: "First.\n"},
		{name: "older version", changelog: log, version: "0.1.0", err: "the newest section is 0.2.0, not 0.1.0"},
		{name: "unknown version", changelog: log, version: "0.3.0", err: `add a section "## [0.3.0] - YYYY-MM-DD"`},
		{name: "unreleased heading", changelog: "## Unreleased\n- x\n## [0.1.0] - 2026-12-01\n", version: "0.1.0", err: `heading "## Unreleased"`},
		{name: "a version not yet released", changelog: "## [0.1.0] - Unreleased\nFirst.\n", version: "0.1.0", want: "First.\n"},
		{name: "heading without date", changelog: "## [0.1.0]\n- x\n", version: "0.1.0", err: "is not"},
		{name: "no section", changelog: "# Changelog\n", version: "0.1.0", err: "has no section"},
		{name: "empty section", changelog: "## [0.1.0] - 2026-12-01\n\n## [0.0.9] - 2026-11-01\n", version: "0.1.0", err: "the section of 0.1.0 is empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := releaseNotes(tt.changelog, tt.version)
			if tt.err != "" {
				require.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}
