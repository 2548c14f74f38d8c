package image

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLayerHoldsBinariesFilesDirectoriesAndLinks(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "agnhost")
	require.NoError(t, os.WriteFile(bin, []byte("binary"), 0o755))
	created := time.Unix(1764547200, 0).UTC()
	idx, err := Index(Options{Created: created, User: "0", Env: []string{"PATH=/bin"}, Entrypoint: []string{"/agnhost"}, Cmd: []string{"pause"},
		Platforms: []Platform{{OS: "linux", Architecture: "amd64", Binaries: map[string]string{"agnhost": bin}, Files: []File{
			{Name: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0::/:/bin/sh\n")},
			{Name: "bin/sh", Mode: 0o777, Link: "/bin/busybox"},
			{Name: "etc", Mode: 0o755, Dir: true},
			{Name: "tmp", Mode: 0o1777, Dir: true},
		}}}})
	require.NoError(t, err)
	img, cfg := firstImage(t, idx)
	assert.Equal(t, "0", cfg.Config.User)
	assert.Equal(t, []string{"PATH=/bin"}, cfg.Config.Env)
	assert.Equal(t, []string{"/agnhost"}, cfg.Config.Entrypoint)
	assert.Equal(t, []string{"pause"}, cfg.Config.Cmd)

	layers, err := img.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	rc, err := layers[0].Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	type entry struct {
		name     string
		typeflag byte
		mode     int64
		link     string
		data     string
	}
	var got []entry
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		assert.Equal(t, created, hdr.ModTime.UTC(), hdr.Name)
		got = append(got, entry{hdr.Name, hdr.Typeflag, hdr.Mode, hdr.Linkname, string(data)})
	}
	assert.Equal(t, []entry{
		{"agnhost", tar.TypeReg, 0o755, "", "binary"},
		{"bin/sh", tar.TypeSymlink, 0o777, "/bin/busybox", ""},
		{"etc/", tar.TypeDir, 0o755, "", ""},
		{"etc/passwd", tar.TypeReg, 0o644, "", "root:x:0:0::/:/bin/sh\n"},
		{"tmp/", tar.TypeDir, 0o1777, "", ""},
	}, got, "in name order, each with its type")
}

func TestDefaultsAreTallysImage(t *testing.T) {
	idx, err := Index(Options{Platforms: []Platform{{OS: "linux", Architecture: "arm64"}}})
	require.NoError(t, err)
	_, cfg := firstImage(t, idx)
	assert.Equal(t, User, cfg.Config.User)
	assert.Equal(t, []string{"PATH=/"}, cfg.Config.Env)
}

func TestSameNameTwiceIsRefused(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "sh")
	require.NoError(t, os.WriteFile(bin, []byte("x"), 0o755))
	_, err := Index(Options{Platforms: []Platform{{OS: "linux", Architecture: "amd64",
		Binaries: map[string]string{"sh": bin}, Files: []File{{Name: "sh", Link: "/bin/busybox"}}}}})
	assert.ErrorContains(t, err, "sh is in the layer twice")
}

// firstImage returns the first image of idx and its config.
func firstImage(t *testing.T, idx v1.ImageIndex) (v1.Image, *v1.ConfigFile) {
	t.Helper()
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	img, err := idx.Image(im.Manifests[0].Digest)
	require.NoError(t, err)
	cfg, err := img.ConfigFile()
	require.NoError(t, err)
	return img, cfg
}
