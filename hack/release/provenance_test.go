package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestChecksumsCoverEveryReleaseFile(t *testing.T) {
	dist := t.TempDir()
	for name, content := range map[string]string{
		"release.json": "{}", "tally.yaml": "krew", "provenance.json": "{}", "tally-1.0.0.tgz": "chart",
		// goreleaser's own files, and a previous run's checksums and signature: not release files.
		"artifacts.json": "[]", "config.yaml": "", "metadata.json": "{}", checksumsFile: "old", checksumsBundle: "old",
	} {
		require.NoError(t, os.WriteFile(filepath.Join(dist, name), []byte(content), 0o644))
	}
	require.NoError(t, os.MkdirAll(filepath.Join(dist, "krew"), 0o755))

	files, err := releaseFiles(dist)
	require.NoError(t, err)
	assert.Equal(t, []string{"provenance.json", "release.json", "tally-1.0.0.tgz", "tally.yaml"}, files)
	require.NoError(t, writeChecksums(dist, files))
	data, err := os.ReadFile(filepath.Join(dist, checksumsFile))
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	require.Len(t, lines, len(files))
	// sha256sum's format: the hex sum, two spaces, the name.
	assert.Equal(t, sum(t, "{}")+"  provenance.json", lines[0])
	assert.Equal(t, sum(t, "krew")+"  tally.yaml", lines[3])
}

func TestProvenance(t *testing.T) {
	b := builder{version: "1.2.0-rc.1", registry: "registry.example/team", project: "https://source.example/tally/",
		download: "https://source.example/tally/releases/v1.2.0-rc.1", builderID: "https://ci.example/release.yaml@refs/tags/v1.2.0-rc.1",
		invocationID: "https://ci.example/runs/7"}
	started := time.Now().UTC().Add(-time.Minute)
	products := []descriptor{{Name: "release.json", Digest: map[string]string{"sha256": "ab"}}}
	p := b.provenance("0123abcd", started, products)

	assert.Equal(t, "https://source.example/tally/blob/0123abcd/docs/releasing.md#provenance", p.BuildDefinition.BuildType)
	assert.Equal(t, externalParameters{Version: "1.2.0-rc.1", Registry: "registry.example/team", ProjectURL: "https://source.example/tally/",
		DownloadURL: "https://source.example/tally/releases/v1.2.0-rc.1"}, p.BuildDefinition.ExternalParameters)
	assert.Equal(t, []descriptor{{URI: "git+https://source.example/tally@refs/tags/v1.2.0-rc.1", Digest: map[string]string{"gitCommit": "0123abcd"}}},
		p.BuildDefinition.ResolvedDependencies)
	assert.Equal(t, "https://ci.example/release.yaml@refs/tags/v1.2.0-rc.1", p.RunDetails.Builder.ID)
	assert.Equal(t, "https://ci.example/runs/7", p.RunDetails.Metadata.InvocationID)
	assert.Equal(t, started.Truncate(time.Second), p.RunDetails.Metadata.StartedOn)
	assert.False(t, p.RunDetails.Metadata.FinishedOn.Before(p.RunDetails.Metadata.StartedOn))
	assert.Equal(t, products, p.RunDetails.Byproducts)
}

func TestInstallManifestCreatesItsNamespaceFirst(t *testing.T) {
	m := installManifest("---\napiVersion: v1\nkind: ServiceAccount\n")
	ns := strings.Index(m, "kind: Namespace\nmetadata:\n  name: tally-system\n")
	require.GreaterOrEqual(t, ns, 0)
	assert.Less(t, ns, strings.Index(m, "kind: ServiceAccount"))
}

func sum(t *testing.T, s string) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(f, []byte(s), 0o644))
	h, err := sha256File(f)
	require.NoError(t, err)
	return h
}
