// Package release checks a release end to end without the internet: `make
// release` refuses a tree that is not a tagged, clean release, then runs
// twice as a snapshot signed with a key the test generates (the archives
// and the image come out byte-identical, each kubectl-tally archive holds
// LICENSE, NOTICE and the licences of the modules it bundles, checksums.txt covers every file
// and its signature verifies), `make publish` to a registry served by the
// test (signatures of the image index and the chart, the provenance and
// each platform's SBOM attested as referrers, checked with docs/releasing.md's
// own commands), `helm install` of the chart from its oci:// reference into
// a local control plane (running the image by digest), the static install
// manifest applied server-side, the image's commands pulled from the
// registry, and kubectl-tally installed by krew from the generated manifest
// and run through kubectl's plugin lookup.
package release

import (
	"archive/tar"
	"archive/zip"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"maps"
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
	"tally.dev/tally/internal/notices"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, controlplane.Options{CRDPaths: []string{framework.CertManagerCRDs()}}, &env))
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
	out, err := tryMake(args...)
	require.NoError(t, err, "make %s:\n%s", strings.Join(args, " "), out)
	return out
}

func tryMake(args ...string) (string, error) {
	cmd := exec.Command("make", args...)
	cmd.Dir = repo.Root()
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "MAKEFLAGS=") || strings.HasPrefix(kv, "MFLAGS=") || strings.HasPrefix(kv, "MAKELEVEL=")
	})
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// runCmd runs a command in dir and returns its standard output.
func runCmd(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	out, err := tryCmd(dir, name, args...)
	require.NoError(t, err, "%s %s:\n%s", filepath.Base(name), strings.Join(args, " "), out)
	return out
}

func tryCmd(dir, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out) + stderr.String(), err
	}
	return string(out), nil
}

type record struct {
	Version, Registry, Image, ImageDigest, ImageArchive, Chart, ChartArchive, InstallManifest string
	PlatformDigests                                                                           map[string]string
	Prerelease, Snapshot                                                                      bool
}

// notReleased are the files of dist/ a release does not publish:
// goreleaser's own, and the checksums and their signature.
var notReleased = []string{"artifacts.json", "config.yaml", "metadata.json", "checksums.txt", "checksums.txt.sigstore.json"}

// built is what a release wrote: the checksums it lists, verified against
// the files and covering every file, and its record.
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
	b.krew = fileSum(t, filepath.Join(dist, "tally.yaml"))
	assert.Equal(t, b.krew, fileSum(t, filepath.Join(dist, "krew", "tally.yaml")), "the published krew manifest is goreleaser's")
	b.sums = map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		sum, file, ok := strings.Cut(line, "  ")
		require.True(t, ok, "checksums.txt line %q", line)
		assert.Equal(t, sum, fileSum(t, filepath.Join(dist, file)), "checksums.txt's sum of %s", file)
		b.sums[file] = sum
	}
	entries, err := os.ReadDir(dist)
	require.NoError(t, err)
	var files []string
	for _, e := range entries {
		if !e.IsDir() && !slices.Contains(notReleased, e.Name()) {
			files = append(files, e.Name())
		}
	}
	assert.ElementsMatch(t, files, slices.Collect(maps.Keys(b.sums)), "checksums.txt covers every file of the release")
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
	krew, kubectl, cosign := tool(t, "KREW"), tool(t, "KUBECTL"), tool(t, "COSIGN")
	version := newestVersion(t)
	server := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true)))
	t.Cleanup(server.Close)
	reg := strings.TrimPrefix(server.URL, "http://") + "/team"
	dist := repo.Path("dist")
	// The release's signing key, and another one whose signatures must not verify.
	t.Setenv("COSIGN_PASSWORD", "release-test")
	keys, otherKeys := t.TempDir(), t.TempDir()
	runCmd(t, keys, cosign, "generate-key-pair")
	runCmd(t, otherKeys, cosign, "generate-key-pair")
	vars := []string{"VERSION=" + version, "REGISTRY=" + reg, "PROJECT_URL=https://source.example/tally",
		"DOWNLOAD_URL=https://source.example/tally/releases/v" + version, "COSIGN_KEY=" + filepath.Join(keys, "cosign.key")}

	// A checkout whose HEAD is not tagged v<version> with nothing else in
	// its tree is not a release (hack/release's tests cover each case).
	out, err := tryMake(append([]string{"release"}, vars...)...)
	require.Error(t, err, "make release of a checkout that is not a tagged, clean release:\n%s", out)
	assert.Regexp(t, `the tree is not clean|HEAD does not carry the tag v`+regexp.QuoteMeta(version), out)
	assert.Contains(t, out, "SNAPSHOT=true")
	vars = append(vars, "SNAPSHOT=true")

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
	for _, a := range append([]string{rec.ImageArchive, rec.ChartArchive, rec.InstallManifest}, plugins...) {
		require.Contains(t, first.sums, a, "checksums.txt lists every archive")
		assert.Equal(t, first.sums[a], second.sums[a], "%s: two builds of the same commit and version", a)
	}
	for _, a := range plugins {
		assert.Contains(t, first.sums, a+".spdx.json", "an SBOM of each kubectl-tally archive")
		assertNotices(t, filepath.Join(dist, a))
	}
	for _, sbom := range []string{"tally-image_" + version + "_linux_amd64.spdx.json", "tally-image_" + version + "_linux_arm64.spdx.json",
		"kubectl-tally_" + version + "_" + host + ".tar.gz.spdx.json"} {
		require.Contains(t, first.sums, sbom)
		assertSBOM(t, filepath.Join(dist, sbom))
	}
	assert.Equal(t, record{
		Version: version, Registry: reg, Image: reg + "/tally:" + version, ImageDigest: rec.ImageDigest, PlatformDigests: rec.PlatformDigests,
		ImageArchive: "tally-image_" + version + ".tar", Chart: "oci://" + reg + "/charts/tally", ChartArchive: "tally-" + version + ".tgz",
		InstallManifest: "tally-install_" + version + ".yaml", Prerelease: strings.Contains(version, "-"), Snapshot: true,
	}, rec)
	assert.Len(t, rec.PlatformDigests, 2)
	assert.Equal(t, first.record, second.record)
	assert.Equal(t, first.krew, second.krew, "the krew manifest of two builds")
	notes, err := os.ReadFile(filepath.Join(dist, "release-notes.md"))
	require.NoError(t, err)
	assert.NotEmpty(t, strings.TrimSpace(string(notes)))

	makeTarget(t, "publish", "REGISTRY="+reg, "PLAIN_HTTP=true", "COSIGN_KEY="+filepath.Join(keys, "cosign.key"))
	pulled := assertImagePublished(t, rec)

	t.Run("signatures and attestations", func(t *testing.T) {
		assertSigned(t, cosign, dist, keys, otherKeys, rec)
	})
	t.Run("docs/releasing.md's verification", func(t *testing.T) {
		runVerificationDocs(t, cosign, dist, keys, rec)
	})
	kubeconfig := adminKubeconfig(t)
	t.Run("helm install from the registry", func(t *testing.T) {
		assertHelmInstallFromRegistry(t, kubeconfig, rec)
	})
	t.Run("static install manifest", func(t *testing.T) {
		assertStaticManifestApplies(t, kubectl, kubeconfig, dist, rec)
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

// assertNotices checks that a kubectl-tally archive holds the repository's
// LICENSE and NOTICE, and the licence and NOTICE files of every module
// kubectl-tally links on the archive's platform.
func assertNotices(t *testing.T, archive string) {
	t.Helper()
	files := archiveFiles(t, archive)
	for _, name := range []string{"LICENSE", "NOTICE"} {
		own, err := os.ReadFile(repo.Path(name))
		require.NoError(t, err)
		assert.Equal(t, string(own), string(files[name]), "%s: the repository's %s", filepath.Base(archive), name)
	}
	platform := regexp.MustCompile(`_([a-z]+)_([a-z0-9]+)\.(tar\.gz|zip)$`).FindStringSubmatch(archive)
	require.NotNil(t, platform, archive)
	mods, err := notices.Bundled(context.Background(), repo.Root(), []string{platform[1] + "/" + platform[2]}, []string{"./cmd/kubectl-tally"})
	require.NoError(t, err)
	for _, m := range mods {
		require.NotEmpty(t, m.Files, m.Path)
		for _, name := range m.Files {
			want, err := os.ReadFile(filepath.Join(m.Dir, name))
			require.NoError(t, err)
			got, ok := files[notices.Dir+"/"+m.Path+"/"+name]
			if assert.True(t, ok, "%s: no %s of %s %s", filepath.Base(archive), name, m.Path, m.Version) {
				assert.Equal(t, want, got)
			}
		}
	}
}

// archiveFiles returns the regular files of a .tar.gz or .zip archive.
func archiveFiles(t *testing.T, archive string) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	if strings.HasSuffix(archive, ".zip") {
		zr, err := zip.OpenReader(archive)
		require.NoError(t, err)
		defer zr.Close()
		for _, f := range zr.File {
			if f.FileInfo().IsDir() {
				continue
			}
			rc, err := f.Open()
			require.NoError(t, err)
			data, err := io.ReadAll(rc)
			require.NoError(t, err)
			require.NoError(t, rc.Close())
			files[f.Name] = data
		}
		return files
	}
	f, err := os.Open(archive)
	require.NoError(t, err)
	defer f.Close()
	gz, err := gzip.NewReader(f)
	require.NoError(t, err)
	tr := tar.NewReader(gz)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return files
		}
		require.NoError(t, err)
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		files[hdr.Name] = data
	}
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

// adminKubeconfig writes a kubeconfig of an administrator of the control
// plane.
func adminKubeconfig(t *testing.T) string {
	t.Helper()
	admin, err := env.AddUser(envtest.User{Name: "release-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	adminConfig, err := admin.KubeConfig()
	require.NoError(t, err)
	kubeconfig := filepath.Join(t.TempDir(), "admin.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, adminConfig, 0o600))
	return kubeconfig
}

// assertHelmInstallFromRegistry installs the chart with helm from its
// oci:// reference, and checks the release's objects run the published
// image by digest.
func assertHelmInstallFromRegistry(t *testing.T, kubeconfig string, rec record) {
	dir := t.TempDir()
	valuesFile, err := helm.WriteValues(dir, []config.Parent{helm.WorkerPool(config.Counts...)}, helm.LocalCertificates)
	require.NoError(t, err)

	// No Job controller runs here to run the chart's configuration check.
	out, err := helm.Run("install", helm.Release, rec.Chart, "--version", rec.Version, "--plain-http",
		"--namespace", helm.Namespace, "--create-namespace", "-f", valuesFile, "--kubeconfig", kubeconfig, "--no-hooks")
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
	assertRunsByDigest(t, helm.Namespace, helm.Release, rec)
}

// assertRunsByDigest checks both Deployments of an install run the
// release's image by its digest.
func assertRunsByDigest(t *testing.T, namespace, release string, rec record) {
	t.Helper()
	repository, _, _ := strings.Cut(rec.Image, ":"+rec.Version)
	for _, name := range []string{release + "-webhook", release + "-aggregator"} {
		var d appsv1.Deployment
		require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: namespace, Name: name}, &d))
		for _, c := range d.Spec.Template.Spec.Containers {
			assert.Equal(t, repository+"@"+rec.ImageDigest, c.Image, "%s's container %s runs the published image by digest", name, c.Name)
		}
	}
}

// assertStaticManifestApplies removes the chart's install (without its
// uninstall hook: no pod runs here) and applies the release's static
// manifest server-side in its place.
func assertStaticManifestApplies(t *testing.T, kubectl, kubeconfig, dist string, rec record) {
	_, err := helm.Run("uninstall", helm.Release, "--namespace", helm.Namespace, "--no-hooks", "--kubeconfig", kubeconfig)
	require.NoError(t, err)
	out := runCmd(t, dist, kubectl, "apply", "--server-side", "--kubeconfig", kubeconfig, "-f", rec.InstallManifest)
	for _, applied := range []string{"namespace/tally-system serverside-applied", "deployment.apps/tally-webhook serverside-applied",
		"deployment.apps/tally-aggregator serverside-applied", "mutatingwebhookconfiguration.admissionregistration.k8s.io/tally serverside-applied",
		"certificate.cert-manager.io/tally-webhook serverside-applied"} {
		assert.Contains(t, out, applied)
	}
	assertRunsByDigest(t, "tally-system", "tally", rec)
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

// statement is the in-toto statement an attestation signs.
type statement struct {
	Subject []struct {
		Digest map[string]string `json:"digest"`
	} `json:"subject"`
	PredicateType string          `json:"predicateType"`
	Predicate     json.RawMessage `json:"predicate"`
}

// verifyAttestation verifies ref's attestations of predicateType with the
// public key in keys and returns their statements.
func verifyAttestation(t *testing.T, cosign, keys, ref, predicateType string) []statement {
	t.Helper()
	out := runCmd(t, keys, cosign, "verify-attestation", "--key", "cosign.pub", "--insecure-ignore-tlog=true", "--type", predicateType, ref)
	var statements []statement
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var envelope struct{ Payload []byte }
		require.NoError(t, json.Unmarshal([]byte(line), &envelope), "cosign verify-attestation's output %q", line)
		var s statement
		require.NoError(t, json.Unmarshal(envelope.Payload, &s))
		statements = append(statements, s)
	}
	return statements
}

// assertSigned checks with cosign and the release's public key: the
// checksums' signature (and that a changed checksums.txt or another key
// fails it), the image index's and the chart's signatures, the provenance
// attested to the index (its subject the pushed index's digest, its
// byproducts the release's files) and each platform's SBOM attested to its
// image, all stored as OCI referrers.
func assertSigned(t *testing.T, cosign, dist, keys, otherKeys string, rec record) {
	verifyBlob := func(dir, checksums string) error {
		_, err := tryCmd(dir, cosign, "verify-blob", "--key", "cosign.pub", "--insecure-ignore-tlog=true",
			"--bundle", filepath.Join(dist, "checksums.txt.sigstore.json"), checksums)
		return err
	}
	require.NoError(t, verifyBlob(keys, filepath.Join(dist, "checksums.txt")))
	assert.Error(t, verifyBlob(otherKeys, filepath.Join(dist, "checksums.txt")), "checksums.txt's signature verifies with another key")
	changed := filepath.Join(t.TempDir(), "checksums.txt")
	data, err := os.ReadFile(filepath.Join(dist, "checksums.txt"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(changed, append(data, []byte(strings.Repeat("0", 64)+"  extra.tar\n")...), 0o644))
	assert.Error(t, verifyBlob(keys, changed), "a changed checksums.txt verifies")

	repository, _, _ := strings.Cut(rec.Image, ":"+rec.Version)
	index := repository + "@" + rec.ImageDigest
	chartTag, err := name.NewTag(strings.TrimPrefix(rec.Chart, "oci://")+":"+rec.Version, name.Insecure)
	require.NoError(t, err)
	chart, err := remote.Head(chartTag)
	require.NoError(t, err)
	for _, ref := range []string{index, chartTag.Context().Digest(chart.Digest.String()).String()} {
		runCmd(t, keys, cosign, "verify", "--key", "cosign.pub", "--insecure-ignore-tlog=true", ref)
		_, err := tryCmd(otherKeys, cosign, "verify", "--key", "cosign.pub", "--insecure-ignore-tlog=true", ref)
		assert.Error(t, err, "%s's signature verifies with another key", ref)
	}

	statements := verifyAttestation(t, cosign, keys, index, "slsaprovenance1")
	require.Len(t, statements, 1)
	s := statements[0]
	require.Len(t, s.Subject, 1)
	assert.Equal(t, rec.ImageDigest, "sha256:"+s.Subject[0].Digest["sha256"], "the provenance's subject is the pushed index")
	assert.Equal(t, "https://slsa.dev/provenance/v1", s.PredicateType)
	var provenance struct {
		BuildDefinition struct {
			ExternalParameters struct{ Version, Registry string }
		}
		RunDetails struct {
			Byproducts []struct {
				Name   string
				Digest map[string]string
			}
		}
	}
	require.NoError(t, json.Unmarshal(s.Predicate, &provenance))
	assert.Equal(t, rec.Version, provenance.BuildDefinition.ExternalParameters.Version)
	assert.Equal(t, rec.Registry, provenance.BuildDefinition.ExternalParameters.Registry)
	products := map[string]string{}
	for _, p := range provenance.RunDetails.Byproducts {
		products[p.Name] = p.Digest["sha256"]
	}
	for _, f := range []string{rec.ImageArchive, rec.ChartArchive, rec.InstallManifest, "release.json", "tally.yaml"} {
		assert.Equal(t, fileSum(t, filepath.Join(dist, f)), products[f], "the provenance's byproduct %s", f)
	}

	for platform, digest := range rec.PlatformDigests {
		ref, err := name.NewDigest(repository+"@"+digest, name.Insecure)
		require.NoError(t, err)
		referrers, err := remote.Referrers(ref)
		require.NoError(t, err)
		im, err := referrers.IndexManifest()
		require.NoError(t, err)
		assert.NotEmpty(t, im.Manifests, "%s's image has referrers", platform)
		statements := verifyAttestation(t, cosign, keys, ref.String(), "spdxjson")
		require.Len(t, statements, 1, platform)
		assert.Equal(t, digest, "sha256:"+statements[0].Subject[0].Digest["sha256"], "%s's SBOM is attested to its image", platform)
		assert.Equal(t, "https://spdx.dev/Document", statements[0].PredicateType)
		assert.Contains(t, string(statements[0].Predicate), `"k8s.io/client-go"`, "%s's SBOM lists tally's dependencies", platform)
	}
	ref, err := name.NewDigest(index, name.Insecure)
	require.NoError(t, err)
	referrers, err := remote.Referrers(ref)
	require.NoError(t, err)
	im, err := referrers.IndexManifest()
	require.NoError(t, err)
	assert.Len(t, im.Manifests, 2, "the image index's referrers: its signature and its provenance")
}

// runVerificationDocs runs the block of docs/releasing.md that verifies a
// release signed with a key, as written, in the release's folder with its
// public key beside it.
func runVerificationDocs(t *testing.T, cosign, dist, keys string, rec record) {
	data, err := os.ReadFile(repo.Path("docs", "releasing.md"))
	require.NoError(t, err)
	const marker = "<!-- test/release runs the next block -->\n```sh\n"
	_, after, ok := strings.Cut(string(data), marker)
	require.True(t, ok, "docs/releasing.md has no block after %q", marker)
	block, _, ok := strings.Cut(after, "\n```\n")
	require.True(t, ok, "the block does not end")

	dir := t.TempDir()
	require.NoError(t, os.Symlink(cosign, filepath.Join(dir, "cosign")))
	pub, err := os.ReadFile(filepath.Join(keys, "cosign.pub"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dist, "cosign.pub"), pub, 0o644))
	t.Cleanup(func() { os.Remove(filepath.Join(dist, "cosign.pub")) })
	cmd := exec.Command("bash", "-euo", "pipefail", "-c", block)
	cmd.Dir = dist
	cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"),
		"REGISTRY="+rec.Registry, "VERSION="+rec.Version)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "docs/releasing.md's verification:\n%s\n%s", block, out)
	for _, verified := range []string{"Verified OK", "tally-image_" + rec.Version + ".tar: OK", "tally.yaml: OK"} {
		assert.Contains(t, string(out), verified)
	}
}
