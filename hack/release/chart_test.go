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

func TestSetImageRepository(t *testing.T) {
	tests := []struct {
		name, values, want, err string
	}{
		{
			name:   "comment between",
			values: "a: 1\nimage:\n  # -- the image\n  repository: ghcr.io/tally-dev/tally # default\n  tag: \"\"\nother:\n  repository: keep\n",
			want:   "a: 1\nimage:\n  # -- the image\n  repository: r.example/ns/tally # default\n  tag: \"\"\nother:\n  repository: keep\n",
		},
		{
			name:   "first key",
			values: "image:\n  repository: old\n",
			want:   "image:\n  repository: r.example/ns/tally\n",
		},
		{name: "repository elsewhere only", values: "other:\n  repository: x\nimage:\n  tag: v\n", err: "no image.repository"},
		{name: "no image", values: "a: 1\n", err: "no image.repository"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := setImageRepository([]byte(tt.values), "r.example/ns/tally")
			if tt.err != "" {
				require.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, string(got))
		})
	}
}

// TestSetImageRepositoryOnTheChart checks the chart's own values.yaml: only
// image.repository changes.
func TestSetImageRepositoryOnTheChart(t *testing.T) {
	values, err := os.ReadFile(filepath.Join(repo.Root(), "charts", "tally", "values.yaml"))
	require.NoError(t, err)
	got, err := setImageRepository(values, "r.example/ns/tally")
	require.NoError(t, err)
	var before, after map[string]any
	require.NoError(t, yaml.Unmarshal(values, &before))
	require.NoError(t, yaml.Unmarshal(got, &after))
	before["image"].(map[string]any)["repository"] = "r.example/ns/tally"
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
