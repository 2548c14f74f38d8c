// Package release checks a release end to end without the internet: `make
// release` twice (the archives and the image come out byte-identical), `make
// publish` to a registry served by the test, `helm install` of the chart
// from its oci:// reference into a local control plane, the image's
// commands pulled from the registry, and kubectl-tally installed by krew
// from the generated manifest and run through kubectl's plugin lookup.
package release

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, controlplane.Options{}, &env))
}

// tool returns the path the Makefile exported for a tool of the release.
func tool(t *testing.T, name string) string {
	t.Helper()
	return framework.Tool(t, name, "test-release")
}

// newestVersion is the version of CHANGELOG.md's newest section.
func newestVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(repo.Path("CHANGELOG.md"))
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^## \[([^\]]+)\]`).FindSubmatch(data)
	require.NotNil(t, m, "CHANGELOG.md has no release section")
	return string(m[1])
}

// makeTarget runs make in the repository's root, outside the make that may
// run this test.
func makeTarget(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("make", args...)
	cmd.Dir = repo.Root()
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "MAKEFLAGS=") || strings.HasPrefix(kv, "MFLAGS=") || strings.HasPrefix(kv, "MAKELEVEL=")
	})
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "make %s:\n%s", strings.Join(args, " "), out)
	return string(out)
}

type record struct {
	Version, Registry, Image, ImageDigest, ImageArchive, Chart, ChartArchive string
}

// built is what a release wrote: the checksums it lists, verified against
// the files, and its record.
type built struct {
	sums   map[string]string
	krew   string
	record record
}

func readRelease(t *testing.T, dist string) built {
	t.Helper()
	var b built
	data, err := os.ReadFile(filepath.Join(dist, "release.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(data, &b.record))
	data, err = os.ReadFile(filepath.Join(dist, "checksums.txt"))
	require.NoError(t, err)
	b.krew = fileSum(t, filepath.Join(dist, "krew", "tally.yaml"))
	b.sums = map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		sum, file, ok := strings.Cut(line, "  ")
		require.True(t, ok, "checksums.txt line %q", line)
		assert.Equal(t, sum, fileSum(t, filepath.Join(dist, file)), "checksums.txt's sum of %s", file)
		b.sums[file] = sum
	}
	return b
}

func fileSum(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	require.NoError(t, err)
	return hex.EncodeToString(h.Sum(nil))
}

func TestReleasePublishInstall(t *testing.T) {
	krew, kubectl := tool(t, "KREW"), tool(t, "KUBECTL")
	version := newestVersion(t)
	server := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(server.Close)
	reg := strings.TrimPrefix(server.URL, "http://") + "/team"
	dist := repo.Path("dist")
	vars := []string{"VERSION=" + version, "REGISTRY=" + reg, "PROJECT_URL=https://source.example/tally",
		"DOWNLOAD_URL=https://source.example/tally/releases/v" + version}

	t.Log(makeTarget(t, append([]string{"release"}, vars...)...))
	first := readRelease(t, dist)
	makeTarget(t, append([]string{"release"}, vars...)...)
	second := readRelease(t, dist)

	rec := first.record
	host := "linux_" + runtime.GOARCH
	var plugins []string
	for _, p := range []string{"linux_amd64", "linux_arm64", "darwin_amd64", "darwin_arm64"} {
		plugins = append(plugins, "kubectl-tally_"+version+"_"+p+".tar.gz")
	}
	plugins = append(plugins, "kubectl-tally_"+version+"_windows_amd64.zip")
	for _, a := range append([]string{rec.ImageArchive, rec.ChartArchive}, plugins...) {
		require.Contains(t, first.sums, a, "checksums.txt lists every archive")
		assert.Equal(t, first.sums[a], second.sums[a], "%s: two builds of the same commit and version", a)
	}
	for _, a := range plugins {
		assert.Contains(t, first.sums, a+".spdx.json", "an SBOM of each kubectl-tally archive")
	}
	for _, sbom := range []string{"tally-image_" + version + "_linux_amd64.spdx.json", "tally-image_" + version + "_linux_arm64.spdx.json",
		"kubectl-tally_" + version + "_" + host + ".tar.gz.spdx.json"} {
		require.Contains(t, first.sums, sbom)
		assertSBOM(t, filepath.Join(dist, sbom))
	}
	assert.Equal(t, record{
		Version: version, Registry: reg, Image: reg + "/tally:" + version, ImageDigest: rec.ImageDigest, ImageArchive: "tally-image_" + version + ".tar",
		Chart: "oci://" + reg + "/charts/tally", ChartArchive: "tally-" + version + ".tgz",
	}, rec)
	assert.Equal(t, first.record, second.record)
	assert.Equal(t, first.krew, second.krew, "the krew manifest of two builds")
	notes, err := os.ReadFile(filepath.Join(dist, "release-notes.md"))
	require.NoError(t, err)
	assert.NotEmpty(t, strings.TrimSpace(string(notes)))

	makeTarget(t, "publish", "REGISTRY="+reg, "PLAIN_HTTP=true")
	pulled := assertImagePublished(t, rec)

	t.Run("helm install from the registry", func(t *testing.T) {
		assertHelmInstallFromRegistry(t, rec)
	})
	t.Run("the published image's commands", func(t *testing.T) {
		cmds := extract(t, pulled, "webhook", "aggregator", "kubectl-tally")
		for cmd, path := range cmds {
			out, err := exec.Command(path, "--version").CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Contains(t, string(out), version, cmd)
		}
	})
	t.Run("krew install", func(t *testing.T) {
		assertKrewInstall(t, krew, kubectl, dist, version, host)
	})
}

// assertSBOM checks an SPDX document lists packages, tally's dependencies
// among them.
func assertSBOM(t *testing.T, path string) {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		SPDXVersion string `json:"spdxVersion"`
		Packages    []struct {
			Name string `json:"name"`
		} `json:"packages"`
	}
	require.NoError(t, json.Unmarshal(data, &doc), path)
	assert.True(t, strings.HasPrefix(doc.SPDXVersion, "SPDX-"), path)
	var names []string
	for _, p := range doc.Packages {
		names = append(names, p.Name)
	}
	assert.Contains(t, names, "k8s.io/client-go", path)
}

// assertImagePublished checks the registry serves the release's image index
// under its tag, and returns the host platform's image.
func assertImagePublished(t *testing.T, rec record) v1.Image {
	t.Helper()
	ref, err := name.NewTag(rec.Image, name.Insecure)
	require.NoError(t, err)
	idx, err := remote.Index(ref)
	require.NoError(t, err)
	digest, err := idx.Digest()
	require.NoError(t, err)
	assert.Equal(t, rec.ImageDigest, digest.String(), "the pushed index is the archive's")
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	var platforms []string
	var host v1.Hash
	for _, d := range im.Manifests {
		platforms = append(platforms, d.Platform.OS+"/"+d.Platform.Architecture)
		if d.Platform.Architecture == runtime.GOARCH {
			host = d.Digest
		}
	}
	assert.ElementsMatch(t, []string{"linux/amd64", "linux/arm64"}, platforms)
	img, err := idx.Image(host)
	require.NoError(t, err)
	return img
}

// extract writes the files cmds of the image's layers to a temporary
// directory and returns their paths.
func extract(t *testing.T, img v1.Image, cmds ...string) map[string]string {
	t.Helper()
	dir := t.TempDir()
	paths := map[string]string{}
	layers, err := img.Layers()
	require.NoError(t, err)
	for _, l := range layers {
		rc, err := l.Uncompressed()
		require.NoError(t, err)
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			require.NoError(t, err)
			cmd := strings.TrimPrefix(h.Name, "/")
			if !slices.Contains(cmds, cmd) {
				continue
			}
			paths[cmd] = filepath.Join(dir, cmd)
			f, err := os.OpenFile(paths[cmd], os.O_CREATE|os.O_WRONLY, 0o755)
			require.NoError(t, err)
			_, err = io.Copy(f, tr)
			require.NoError(t, err)
			require.NoError(t, f.Close())
		}
		require.NoError(t, rc.Close())
	}
	for _, cmd := range cmds {
		require.Contains(t, paths, cmd, "the image holds /%s", cmd)
	}
	return paths
}

// assertHelmInstallFromRegistry installs the chart with helm from its
// oci:// reference, and checks the release's objects run the published
// image.
func assertHelmInstallFromRegistry(t *testing.T, rec record) {
	ctx := context.Background()
	dir := t.TempDir()
	admin, err := env.AddUser(envtest.User{Name: "release-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, adminConfig, 0o600))
	valuesFile, err := helm.WriteValues(dir, []config.Parent{helm.WorkerPool(config.Counts...)}, helm.LocalCertificates)
	require.NoError(t, err)

	out, err := helm.Run("install", helm.Release, rec.Chart, "--version", rec.Version, "--plain-http",
		"--namespace", helm.Namespace, "--create-namespace", "-f", valuesFile, "--kubeconfig", kubeconfig)
	require.NoError(t, err)
	assert.Contains(t, out, "STATUS: deployed")
	out, err = helm.Run("list", "--namespace", helm.Namespace, "--kubeconfig", kubeconfig, "-o", "yaml")
	require.NoError(t, err)
	var releases []struct {
		Name, Chart, Status string
		AppVersion          string `json:"app_version"`
	}
	require.NoError(t, yaml.Unmarshal([]byte(out), &releases))
	require.Len(t, releases, 1)
	assert.Equal(t, "tally-"+rec.Version, releases[0].Chart)
	assert.Equal(t, rec.Version, releases[0].AppVersion)
	assert.Equal(t, "deployed", releases[0].Status)

	for _, name := range []string{helm.Release + "-webhook", helm.Release + "-aggregator"} {
		var d appsv1.Deployment
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: name}, &d))
		for _, c := range d.Spec.Template.Spec.Containers {
			assert.Equal(t, rec.Image, c.Image, "%s's container %s runs the published image", name, c.Name)
		}
	}
}

// assertKrewInstall installs kubectl-tally with krew from the release's
// manifest and the host's archive, and runs it as `kubectl tally`.
func assertKrewInstall(t *testing.T, krew, kubectl, dist, version, host string) {
	root := t.TempDir()
	environ := append(os.Environ(), "KREW_ROOT="+root, "PATH="+filepath.Join(root, "bin")+string(os.PathListSeparator)+os.Getenv("PATH"))
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Env = environ
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s %s:\n%s", filepath.Base(name), strings.Join(args, " "), out)
		return string(out)
	}
	run(krew, "install", "--manifest="+filepath.Join(dist, "krew", "tally.yaml"),
		"--archive="+filepath.Join(dist, "kubectl-tally_"+version+"_"+host+".tar.gz"))
	receipt, err := os.ReadFile(filepath.Join(root, "receipts", "tally.yaml"))
	require.NoError(t, err, "krew's receipt of the installed plugin")
	assert.Contains(t, string(receipt), "version: v"+version)
	assert.Contains(t, run(kubectl, "plugin", "list"), filepath.Join(root, "bin", "kubectl-tally"))
	help := run(kubectl, "tally", "--help")
	assert.Contains(t, help, "kubectl tally explains the counts")
	assert.Contains(t, help, "doctor")
	assert.Equal(t, fmt.Sprintf("kubectl tally version %s\n", version), run(kubectl, "tally", "--version"))
}
