package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"

	"tally.dev/tally/internal/image"
	"tally.dev/tally/internal/notices"
	"tally.dev/tally/internal/repo"
)

// record is release.json: what a release holds and where publish puts it.
type record struct {
	Version string `json:"version"`
	// Registry is where publish pushes both.
	Registry string `json:"registry"`
	// Image is <registry>/tally:<version>, the chart's default image.
	Image       string `json:"image"`
	ImageDigest string `json:"imageDigest"`
	// PlatformDigests are the digests of the index's images by platform
	// (linux/amd64): each one's SBOM is attested to it.
	PlatformDigests map[string]string `json:"platformDigests"`
	ImageArchive    string            `json:"imageArchive"`
	// Chart is oci://<registry>/charts/tally, helm install's reference.
	// The packaged chart runs the image by ImageDigest.
	Chart        string `json:"chart"`
	ChartArchive string `json:"chartArchive"`
	// InstallManifest is the chart rendered with its defaults (cert-manager
	// certificates) for kubectl apply --server-side, with its namespace.
	InstallManifest string `json:"installManifest"`
	// Prerelease: the version has a pre-release part (1.2.0-rc.1).
	Prerelease bool `json:"prerelease"`
	// Snapshot: built without the clean-tree and tag checks; not a release.
	Snapshot bool `json:"snapshot"`
}

// krewManifest is the name of the krew manifest in a release.
const krewManifest = "tally.yaml"

// installNamespace is the namespace of the static install manifest.
const installNamespace = "tally-system"

// chartRepository is the OCI repository helm push pushes a chart to: its
// charts live under <registry>/charts.
func chartRepository(registry string) string { return "oci://" + registry + "/charts" }

// recordFile is the name of the record in the release's folder.
const recordFile = "release.json"

// builder builds a release.
type builder struct {
	version, registry      string
	project, download      string
	runbook                string
	root, staging          string
	helm, goreleaser, syft string
	// snapshot skips the clean-tree and tag checks (checkSource).
	snapshot bool
	// builderID and invocationID are the provenance's builder.id and
	// metadata.invocationId.
	builderID, invocationID string
	sign                    signer
}

func (b builder) build() error {
	if err := checkVersion(b.version); err != nil {
		return err
	}
	if b.registry == "" {
		return errors.New("REGISTRY is empty: name where publish will push (registry.example.com/team)")
	}
	if b.project == "" {
		return errors.New("PROJECT_URL is empty: name the project's home page (the image's source label, the krew manifest's homepage)")
	}
	if b.download == "" {
		return errors.New("DOWNLOAD_URL is empty: name where the release's files will be downloaded from (the krew manifest points there)")
	}
	ref, err := name.NewTag(b.registry + "/tally:" + b.version)
	if err != nil {
		return fmt.Errorf("REGISTRY %q: %w", b.registry, err)
	}
	if filepath.Base(b.syft) != "syft" {
		return fmt.Errorf("--syft %q: goreleaser runs the command named syft", b.syft)
	}
	root, err := filepath.Abs(b.root)
	if err != nil {
		return err
	}
	if !b.snapshot {
		if err := checkSource(root, b.version); err != nil {
			return err
		}
	}
	started := time.Now().UTC()
	abs := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(root, p)
	}
	// goreleaser writes to dist/ (emptying it first).
	dist, staging := filepath.Join(root, "dist"), abs(b.staging)
	// goreleaser globs extra files relative to the root, staging among them.
	relStaging, err := filepath.Rel(root, staging)
	if err != nil || !filepath.IsLocal(relStaging) {
		return fmt.Errorf("--staging %q must be below the repository's root", b.staging)
	}
	changelog, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		return err
	}
	notes, err := releaseNotes(string(changelog), b.version)
	if err != nil {
		return err
	}
	revision, created, err := repo.LastCommit(root)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(staging); err != nil {
		return err
	}
	if err := os.MkdirAll(staging, 0o755); err != nil {
		return err
	}
	rec := record{
		Version:         b.version,
		Registry:        b.registry,
		Image:           ref.String(),
		ImageArchive:    "tally-image_" + b.version + ".tar",
		Chart:           chartRepository(b.registry) + "/tally",
		ChartArchive:    "tally-" + b.version + ".tgz",
		InstallManifest: "tally-install_" + b.version + ".yaml",
		Prerelease:      strings.Contains(b.version, "-"),
		Snapshot:        b.snapshot,
	}

	fmt.Printf(">> image %s\n", rec.Image)
	imageArchive := filepath.Join(staging, rec.ImageArchive)
	if err := run(root, nil, "go", "run", "./hack/image", "--root", root, "--version", b.version, "--source", b.project, "--tag", rec.Image, "--out", imageArchive); err != nil {
		return err
	}
	if rec.ImageDigest, rec.PlatformDigests, err = archiveDigests(imageArchive); err != nil {
		return err
	}

	fmt.Printf(">> chart %s, default image %s@%s\n", rec.ChartArchive, ref.Context(), rec.ImageDigest)
	chartDir := filepath.Join(staging, "chart", "tally")
	set := map[string]string{"image.repository": ref.Context().String(), "image.digest": rec.ImageDigest}
	if b.runbook != "" {
		set["metrics.prometheusRule.runbookURL"] = b.runbook
	}
	if err := stageChart(filepath.Join(root, "charts", "tally"), chartDir, set); err != nil {
		return err
	}
	if err := run(root, nil, b.helm, "package", chartDir, "--version", b.version, "--app-version", b.version, "--destination", staging); err != nil {
		return err
	}
	chartArchive := filepath.Join(staging, rec.ChartArchive)
	if err := stampChartArchive(chartArchive, created); err != nil {
		return err
	}

	fmt.Println(">> licences of the modules kubectl-tally bundles")
	licenses := filepath.Join(staging, notices.Dir)
	if err := stageNotices(root, licenses); err != nil {
		return err
	}

	fmt.Println(">> goreleaser: kubectl-tally archives, SBOMs, krew manifest")
	path := os.Getenv("PATH")
	if strings.ContainsRune(b.syft, os.PathSeparator) {
		path = filepath.Dir(abs(b.syft)) + string(os.PathListSeparator) + path
	}
	env := []string{
		"VERSION=" + b.version,
		"PROJECT_URL=" + b.project,
		"DOWNLOAD_URL=" + strings.TrimSuffix(b.download, "/"),
		"IMAGE_ARCHIVE=" + filepath.Join(relStaging, rec.ImageArchive),
		"CHART_ARCHIVE=" + filepath.Join(relStaging, rec.ChartArchive),
		"LICENSES_DIR=" + filepath.Join(relStaging, notices.Dir),
		"PATH=" + path,
		"SYFT_CHECK_FOR_APP_UPDATE=false",
		"COMMIT_TIMESTAMP=" + strconv.FormatInt(created.Unix(), 10),
		"COMMIT_DATE=" + created.Format(time.RFC3339),
	}
	if err := run(root, env, b.goreleaser, "release", "--snapshot", "--clean"); err != nil {
		return err
	}
	// The krew manifest is published as tally.yaml (krew install
	// --manifest-url takes the plugin's name from it) beside the rest.
	for src, dst := range map[string]string{chartArchive: rec.ChartArchive, imageArchive: rec.ImageArchive, filepath.Join(dist, "krew", "tally.yaml"): krewManifest} {
		if err := copyFile(src, filepath.Join(dist, dst)); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(dist, "release-notes.md"), []byte(notes), 0o644); err != nil {
		return err
	}
	fmt.Printf(">> static install manifest %s\n", rec.InstallManifest)
	manifest, err := output(root, b.helm, "template", "tally", chartArchive, "--namespace", installNamespace, "--no-hooks")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dist, rec.InstallManifest), []byte(installManifest(manifest)), 0o644); err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(dist, recordFile), rec); err != nil {
		return err
	}
	if err := b.seal(dist, revision, started); err != nil {
		return err
	}
	return summary(dist, rec)
}

// seal writes the provenance, which names every other file of the release,
// then checksums.txt over every file, the provenance included, and signs
// it.
func (b builder) seal(dist, revision string, started time.Time) error {
	files, err := releaseFiles(dist)
	if err != nil {
		return err
	}
	products, err := byproducts(dist, files)
	if err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(dist, provenanceFile), b.provenance(revision, started, products)); err != nil {
		return err
	}
	if files, err = releaseFiles(dist); err != nil {
		return err
	}
	if err := writeChecksums(dist, files); err != nil {
		return err
	}
	fmt.Printf(">> signing %s %s\n", checksumsFile, b.sign.describe())
	return b.sign.signBlob(filepath.Join(dist, checksumsFile), filepath.Join(dist, checksumsBundle))
}

// provenance returns the release's SLSA provenance predicate.
func (b builder) provenance(revision string, started time.Time, products []descriptor) provenance {
	source := "git+" + strings.TrimSuffix(b.project, "/")
	return provenance{
		BuildDefinition: buildDefinition{
			BuildType: strings.TrimSuffix(b.project, "/") + "/blob/" + revision + "/docs/releasing.md#provenance",
			ExternalParameters: externalParameters{
				Version: b.version, Registry: b.registry, ProjectURL: b.project,
				DownloadURL: b.download, RunbookURL: b.runbook, Snapshot: b.snapshot,
			},
			InternalParameters: map[string]string{"go": runtime.Version(), "goos": runtime.GOOS, "goarch": runtime.GOARCH},
			ResolvedDependencies: []descriptor{{
				URI: source + "@refs/tags/v" + b.version, Digest: map[string]string{"gitCommit": revision},
			}},
		},
		RunDetails: runDetails{
			Builder:    slsaBuilder{ID: b.builderID},
			Metadata:   metadata{InvocationID: b.invocationID, StartedOn: started.Truncate(time.Second), FinishedOn: time.Now().UTC().Truncate(time.Second)},
			Byproducts: products,
		},
	}
}

// installManifest is helm template's output with the namespace it installs
// into first, for kubectl apply.
func installManifest(rendered string) string {
	return "# tally's chart rendered with its default values (cert-manager certificates,\n" +
		"# the WorkerPool example as its parent kind) for kubectl apply --server-side.\n" +
		"---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: " + installNamespace + "\n" + rendered
}

// writeJSON writes v as indented JSON.
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

// archiveDigests returns the digest of the image index in an image archive
// and those of its images by platform.
func archiveDigests(path string) (index string, platforms map[string]string, err error) {
	a, err := image.OpenArchive(path)
	if err != nil {
		return "", nil, err
	}
	defer a.Close()
	d, err := a.Index.Digest()
	if err != nil {
		return "", nil, err
	}
	im, err := a.Index.IndexManifest()
	if err != nil {
		return "", nil, err
	}
	platforms = map[string]string{}
	for _, m := range im.Manifests {
		if m.Platform == nil {
			return "", nil, fmt.Errorf("%s: the index's manifest %s names no platform", path, m.Digest)
		}
		platforms[m.Platform.OS+"/"+m.Platform.Architecture] = m.Digest.String()
	}
	return d.String(), platforms, nil
}

// goreleaserFiles are what goreleaser writes for itself; a release does not
// publish them.
var goreleaserFiles = []string{"artifacts.json", "config.yaml", "metadata.json"}

// summary prints the files of the release with their sizes.
func summary(dist string, rec record) error {
	entries, err := os.ReadDir(dist)
	if err != nil {
		return err
	}
	fmt.Printf("\nrelease %s in %s:\n", rec.Version, dist)
	for _, e := range entries {
		if e.IsDir() || slices.Contains(goreleaserFiles, e.Name()) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		fmt.Printf("  %-48s %10s\n", e.Name(), size(info.Size()))
	}
	fmt.Printf("image %s@%s\nchart %s --version %s\n", rec.Image, rec.ImageDigest, rec.Chart, rec.Version)
	return nil
}

func size(n int64) string {
	switch {
	case n >= 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB"
	case n >= 1<<10:
		return strconv.FormatFloat(float64(n)/(1<<10), 'f', 1, 64) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " B"
}

// output runs a command in dir and returns its standard output (its
// standard error on ours).
func output(dir, name string, args ...string) (string, error) {
	c := exec.Command(name, args...)
	c.Dir = dir
	c.Stderr = os.Stderr
	out, err := c.Output()
	if err != nil {
		return "", fmt.Errorf("%s %s: %w", filepath.Base(name), args[0], err)
	}
	return string(out), nil
}

// run runs a command in dir with env added, its output on ours.
func run(dir string, env []string, name string, args ...string) error {
	c := exec.Command(name, args...)
	c.Dir = dir
	c.Env = append(os.Environ(), env...)
	c.Stdout, c.Stderr = os.Stdout, os.Stderr
	if err := c.Run(); err != nil {
		return fmt.Errorf("%s %s: %w", filepath.Base(name), args[0], err)
	}
	return nil
}

func copyFile(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o644)
}

// stageNotices writes into dir the licence and NOTICE files of every
// module kubectl-tally links on any platform a release builds, which each
// of its archives carries (.goreleaser.yaml); an error if a module's
// licence is missing or not allowed.
func stageNotices(root, dir string) error {
	files, err := notices.Ship(context.Background(), root, notices.Platforms, []string{"./cmd/kubectl-tally"})
	if err != nil {
		return fmt.Errorf("kubectl-tally's licences: %w", err)
	}
	for _, f := range files {
		p := filepath.Join(dir, filepath.FromSlash(strings.TrimPrefix(f.Name, notices.Dir+"/")))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, f.Data, 0o644); err != nil {
			return err
		}
	}
	return nil
}
