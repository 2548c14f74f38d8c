// Package image checks `make image` and `make push` (hack/image): the
// archive's index, manifests and config, the binaries, the LICENSE and
// NOTICE, and the licence and NOTICE files of every bundled module in its
// layer, the digest of two builds, and a push to a registry served by
// the test.
package image

import (
	"archive/tar"
	"context"
	"io"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/image"
	"tally.dev/tally/internal/notices"
	"tally.dev/tally/internal/repo"
)

func build(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"run", "./hack/image"}, args...)...)
	cmd.Dir = repo.Root()
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	return string(out)
}

// untar extracts the archive into a new directory.
func untar(t *testing.T, archive string) string {
	t.Helper()
	dir := t.TempDir()
	f, err := os.Open(archive)
	require.NoError(t, err)
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return dir
		}
		require.NoError(t, err)
		p := filepath.Join(dir, filepath.FromSlash(hdr.Name))
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, data, 0o644))
	}
}

func gitHead(t *testing.T) string {
	t.Helper()
	cmd := exec.Command("git", "rev-parse", "HEAD")
	cmd.Dir = repo.Root()
	out, err := cmd.Output()
	require.NoError(t, err)
	return strings.TrimSpace(string(out))
}

func appVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(repo.Path("charts", "tally", "Chart.yaml"))
	require.NoError(t, err)
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	require.NoError(t, yaml.Unmarshal(data, &chart))
	return chart.AppVersion
}

// source is the project home the test builds the image with.
const source = "https://source.example/tally"

func TestImage(t *testing.T) {
	dir := t.TempDir()
	first, second := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	build(t, "--out", first, "--source", source)
	build(t, "--out", second, "--source", source)
	a, err := os.ReadFile(first)
	require.NoError(t, err)
	b, err := os.ReadFile(second)
	require.NoError(t, err)
	require.Equal(t, a, b, "two builds of the same sources differ")

	lp, err := layout.ImageIndexFromPath(untar(t, first))
	require.NoError(t, err)
	outer, err := lp.IndexManifest()
	require.NoError(t, err)
	require.Len(t, outer.Manifests, 1)
	assert.Equal(t, appVersion(t), outer.Manifests[0].Annotations["org.opencontainers.image.ref.name"])
	assert.Equal(t, "tally.local/tally:"+appVersion(t), outer.Manifests[0].Annotations["io.containerd.image.name"],
		"the chart's default image (image.repository, tag = appVersion)")
	idx, err := lp.ImageIndex(outer.Manifests[0].Digest)
	require.NoError(t, err)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	assert.Equal(t, types.OCIImageIndex, im.MediaType)
	var platforms []string
	for _, d := range im.Manifests {
		platforms = append(platforms, d.Platform.OS+"/"+d.Platform.Architecture)
		img, err := idx.Image(d.Digest)
		require.NoError(t, err)
		mt, err := img.MediaType()
		require.NoError(t, err)
		assert.Equal(t, types.OCIManifestSchema1, mt)
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		assert.Equal(t, image.User, cfg.Config.User)
		assert.Empty(t, cfg.Config.Entrypoint)
		assert.Equal(t, map[string]string{
			"org.opencontainers.image.source":   source,
			"org.opencontainers.image.version":  appVersion(t),
			"org.opencontainers.image.revision": gitHead(t),
			"org.opencontainers.image.title":    "tally",
			"org.opencontainers.image.licenses": "Apache-2.0",
		}, cfg.Config.Labels)
		files := layerFiles(t, img)
		for _, name := range []string{"LICENSE", "NOTICE"} {
			own, err := os.ReadFile(repo.Path(name))
			require.NoError(t, err)
			assert.Equal(t, string(own), string(files[name]), "the image holds the repository's %s", name)
			delete(files, name)
		}
		// The licence and NOTICE files of every module its commands link.
		mods, err := notices.Bundled(context.Background(), repo.Root(), []string{"linux/" + d.Platform.Architecture}, notices.Commands)
		require.NoError(t, err)
		shipped := 0
		for _, m := range mods {
			require.NotEmpty(t, m.Files, m.Path)
			for _, name := range m.Files {
				want, err := os.ReadFile(filepath.Join(m.Dir, name))
				require.NoError(t, err)
				got, ok := files[path.Join(notices.Dir, m.Path, name)]
				if assert.True(t, ok, "%s: no %s of %s %s", d.Platform.Architecture, name, m.Path, m.Version) {
					assert.Equal(t, want, got)
				}
				shipped++
			}
		}
		assert.Contains(t, files, notices.Dir+"/github.com/prometheus/client_golang/NOTICE")
		assert.Greater(t, shipped, 50)
		for name := range files {
			if strings.HasPrefix(name, notices.Dir+"/") {
				delete(files, name)
			}
		}
		assert.Contains(t, files, "webhook")
		assert.Contains(t, files, "aggregator")
		assert.Contains(t, files, "kubectl-tally")
		if d.Platform.Architecture == runtime.GOARCH {
			for name, data := range files {
				bin := filepath.Join(t.TempDir(), name)
				require.NoError(t, os.WriteFile(bin, data, 0o755))
				out, err := exec.Command(bin, "--help").CombinedOutput()
				require.NoError(t, err, "%s --help: %s", name, out)
				assert.Contains(t, string(out), "-config", name)
			}
		}
	}
	assert.ElementsMatch(t, []string{"linux/amd64", "linux/arm64"}, platforms)
	digest, err := idx.Digest()
	require.NoError(t, err)

	// make push to a registry, and pull it back.
	reg := httptest.NewServer(registry.New())
	defer reg.Close()
	u, err := url.Parse(reg.URL)
	require.NoError(t, err)
	ref := u.Host + "/tally:test"
	build(t, "--push", ref, "--source", source)
	pulled, err := remote.Index(mustRef(t, ref))
	require.NoError(t, err)
	pulledDigest, err := pulled.Digest()
	require.NoError(t, err)
	assert.Equal(t, digest, pulledDigest)
}

func mustRef(t *testing.T, s string) name.Reference {
	t.Helper()
	ref, err := name.ParseReference(s, name.Insecure)
	require.NoError(t, err)
	return ref
}

// layerFiles returns the files of the image's only layer.
func layerFiles(t *testing.T, img v1.Image) map[string][]byte {
	t.Helper()
	layers, err := img.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	rc, err := layers[0].Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return files
		}
		require.NoError(t, err)
		switch {
		case hdr.Typeflag == tar.TypeDir:
			assert.Equal(t, int64(0o755), hdr.Mode, hdr.Name)
			continue
		case hdr.Name == "LICENSE" || hdr.Name == "NOTICE" || strings.HasPrefix(hdr.Name, notices.Dir+"/"):
			assert.Equal(t, int64(0o644), hdr.Mode, hdr.Name)
		default:
			assert.Equal(t, int64(0o755), hdr.Mode, hdr.Name)
		}
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		files[hdr.Name] = data
	}
}
