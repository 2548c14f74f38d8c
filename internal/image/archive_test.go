package image

import (
	"archive/tar"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestOpenArchiveReadsWhatWriteArchiveWrote(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "webhook")
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755))
	created := time.Unix(1764547200, 0).UTC()
	idx, err := Index(Options{Created: created, Platforms: []Platform{
		{OS: "linux", Architecture: "amd64", Binaries: map[string]string{"webhook": bin}},
		{OS: "linux", Architecture: "arm64", Binaries: map[string]string{"webhook": bin}},
	}})
	require.NoError(t, err)
	tag, err := name.NewTag("registry.example/team/tally:1.2.3")
	require.NoError(t, err)
	path := filepath.Join(dir, "image.tar")
	require.NoError(t, WriteArchive(idx, tag, "amd64", created, path))

	a, err := OpenArchive(path)
	require.NoError(t, err)
	want, err := idx.Digest()
	require.NoError(t, err)
	got, err := a.Index.Digest()
	require.NoError(t, err)
	assert.Equal(t, want, got)
	assert.Equal(t, "registry.example/team/tally:1.2.3", a.Ref)
	require.NoError(t, a.Close())
	assert.NoDirExists(t, a.dir)
}

func TestOpenArchiveRefusesBadArchives(t *testing.T) {
	tests := []struct {
		name    string
		entries map[string]string
		err     string
	}{
		{name: "entry outside", entries: map[string]string{"../escape": "x"}, err: `entry "../escape" leaves the archive`},
		{name: "absolute entry", entries: map[string]string{"/etc/x": "x"}, err: "leaves the archive"},
		{name: "no layout", entries: map[string]string{"manifest.json": "[]"}, err: "reading image archive"},
		{name: "empty index", entries: map[string]string{"oci-layout": `{"imageLayoutVersion":"1.0.0"}`, "index.json": `{"schemaVersion":2,"manifests":[]}`}, err: "exactly one image index"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "bad.tar")
			f, err := os.Create(path)
			require.NoError(t, err)
			tw := tar.NewWriter(f)
			for n, body := range tt.entries {
				require.NoError(t, tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}))
				_, err := tw.Write([]byte(body))
				require.NoError(t, err)
			}
			require.NoError(t, tw.Close())
			require.NoError(t, f.Close())
			_, err = OpenArchive(path)
			require.ErrorContains(t, err, tt.err)
		})
	}
}
