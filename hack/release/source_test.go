package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheckSource(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, dir string)
		err   string
	}{
		{name: "tagged and clean", setup: func(t *testing.T, dir string) { gitIn(t, dir, "tag", "v1.2.3") }},
		{name: "no tag", err: "HEAD does not carry the tag v1.2.3"},
		{name: "another version's tag", setup: func(t *testing.T, dir string) { gitIn(t, dir, "tag", "v1.2.2") }, err: "HEAD does not carry the tag v1.2.3"},
		{name: "tag on an older commit", setup: func(t *testing.T, dir string) {
			gitIn(t, dir, "tag", "v1.2.3")
			gitIn(t, dir, "commit", "--allow-empty", "-m", "after the tag")
		}, err: "HEAD does not carry the tag v1.2.3"},
		{name: "modified file", setup: func(t *testing.T, dir string) {
			gitIn(t, dir, "tag", "v1.2.3")
			require.NoError(t, os.WriteFile(filepath.Join(dir, "README.md"), []byte("changed\n"), 0o644))
		}, err: "the tree is not clean"},
		{name: "untracked file", setup: func(t *testing.T, dir string) {
			gitIn(t, dir, "tag", "v1.2.3")
			require.NoError(t, os.WriteFile(filepath.Join(dir, "stray.go"), []byte("package stray\n"), 0o644))
		}, err: "?? stray.go"},
		{name: "ignored file", setup: func(t *testing.T, dir string) {
			gitIn(t, dir, "tag", "v1.2.3")
			require.NoError(t, os.WriteFile(filepath.Join(dir, "build.out"), []byte("output\n"), 0o644))
		}},
		{name: "not a checkout", setup: func(t *testing.T, dir string) { require.NoError(t, os.RemoveAll(filepath.Join(dir, ".git"))) }, err: "git status"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			gitIn(t, dir, "init", "--quiet")
			require.NoError(t, os.WriteFile(filepath.Join(dir, "README.md"), []byte("readme\n"), 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(dir, ".gitignore"), []byte("*.out\n"), 0o644))
			gitIn(t, dir, "add", ".")
			gitIn(t, dir, "commit", "--quiet", "-m", "first")
			if tt.setup != nil {
				tt.setup(t, dir)
			}
			err := checkSource(dir, "1.2.3")
			if tt.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.err)
		})
	}
}

func gitIn(t *testing.T, dir string, args ...string) {
	t.Helper()
	c := exec.Command("git", args...)
	c.Dir = dir
	c.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=t",
		"GIT_COMMITTER_EMAIL=t@example.com", "GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1")
	out, err := c.CombinedOutput()
	require.NoError(t, err, "git %v: %s", args, out)
}
