package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
)

func TestSetValue(t *testing.T) {
	tests := []struct {
		name, values, path, want, err string
	}{
		{
			name:   "comment between",
			values: "a: 1\nimage:\n  # -- the image\n  repository: old.example/tally # default\n  tag: \"\"\nother:\n  repository: keep\n",
			path:   "image.repository",
			want:   "a: 1\nimage:\n  # -- the image\n  repository: r.example/ns/tally # default\n  tag: \"\"\nother:\n  repository: keep\n",
		},
		{name: "first key", values: "image:\n  repository: old\n", path: "image.repository", want: "image:\n  repository: r.example/ns/tally\n"},
		{name: "empty value", values: "image:\n  repository: \"\"\n", path: "image.repository", want: "image:\n  repository: r.example/ns/tally\n"},
		{
			name:   "deeper",
			values: "metrics:\n  prometheusRule:\n    labels: {}\n    runbookURL: \"\"\n  runbookURL: keep\n",
			path:   "metrics.prometheusRule.runbookURL",
			want:   "metrics:\n  prometheusRule:\n    labels: {}\n    runbookURL: r.example/ns/tally\n  runbookURL: keep\n",
		},
		{name: "a grandchild of that name", values: "image:\n  other:\n    repository: x\n", path: "image.repository", err: "no image.repository"},
		{name: "repository elsewhere only", values: "other:\n  repository: x\nimage:\n  tag: v\n", path: "image.repository", err: "no image.repository"},
		{name: "no image", values: "a: 1\n", path: "image.repository", err: "no image.repository"},
		{name: "not a scalar", values: "image:\n  repository:\n    a: b\n", path: "image.repository", err: "not a scalar"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := setValue([]byte(tt.values), tt.path, "r.example/ns/tally")
			if tt.err != "" {
				require.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, string(got))
		})
	}
}

// TestSetValueOnTheChart checks the chart's own values.yaml: only the
// values a release sets change.
func TestSetValueOnTheChart(t *testing.T) {
	values, err := os.ReadFile(filepath.Join(repo.Root(), "charts", "tally", "values.yaml"))
	require.NoError(t, err)
	got, err := setValue(values, "image.repository", "r.example/ns/tally")
	require.NoError(t, err)
	got, err = setValue(got, "metrics.prometheusRule.runbookURL", "https://docs.example/operating.md")
	require.NoError(t, err)
	var before, after map[string]any
	require.NoError(t, yaml.Unmarshal(values, &before))
	require.NoError(t, yaml.Unmarshal(got, &after))
	before["image"].(map[string]any)["repository"] = "r.example/ns/tally"
	before["metrics"].(map[string]any)["prometheusRule"].(map[string]any)["runbookURL"] = "https://docs.example/operating.md"
	assert.Equal(t, before, after)
}

func TestStampChartArchive(t *testing.T) {
	write := func(modified time.Time) string {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Header.Comment = "Helm"
		tw := tar.NewWriter(zw)
		for _, f := range []string{"tally/Chart.yaml", "tally/values.yaml"} {
			require.NoError(t, tw.WriteHeader(&tar.Header{Name: f, Mode: 0o644, Size: 2, ModTime: modified}))
			_, err := tw.Write([]byte("x\n"))
			require.NoError(t, err)
		}
		require.NoError(t, tw.Close())
		require.NoError(t, zw.Close())
		path := filepath.Join(t.TempDir(), "tally-0.1.0.tgz")
		require.NoError(t, os.WriteFile(path, b.Bytes(), 0o644))
		return path
	}
	commit := time.Unix(1764547200, 0)
	a, b := write(time.Now()), write(time.Now().Add(time.Hour))
	for _, p := range []string{a, b} {
		require.NoError(t, stampChartArchive(p, commit))
	}
	da, err := os.ReadFile(a)
	require.NoError(t, err)
	db, err := os.ReadFile(b)
	require.NoError(t, err)
	assert.Equal(t, da, db, "the same chart packaged at two times")

	zr, err := gzip.NewReader(bytes.NewReader(da))
	require.NoError(t, err)
	assert.Equal(t, "Helm", zr.Header.Comment)
	tr := tar.NewReader(zr)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		names = append(names, h.Name)
		assert.True(t, h.ModTime.Equal(commit), h.Name)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		assert.Equal(t, "x\n", string(data))
	}
	assert.Equal(t, []string{"tally/Chart.yaml", "tally/values.yaml"}, names)
}
