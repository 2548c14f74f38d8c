package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"

	"tally.dev/tally/internal/image"
	"tally.dev/tally/internal/repo"
)

// record is release.json: what a release holds and where publish puts it.
type record struct {
	Version string `json:"version"`
	// Registry is where publish pushes both.
	Registry string `json:"registry"`
	// Image is <registry>/tally:<version>, the chart's default image.
	Image        string `json:"image"`
	ImageDigest  string `json:"imageDigest"`
	ImageArchive string `json:"imageArchive"`
	// Chart is oci://<registry>/charts/tally, helm install's reference.
	Chart        string `json:"chart"`
	ChartArchive string `json:"chartArchive"`
}

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
	_, created, err := repo.LastCommit(root)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(staging); err != nil {
		return err
	}
	rec := record{
		Version:      b.version,
		Registry:     b.registry,
		Image:        ref.String(),
		ImageArchive: "tally-image_" + b.version + ".tar",
		Chart:        chartRepository(b.registry) + "/tally",
		ChartArchive: "tally-" + b.version + ".tgz",
	}

	fmt.Printf(">> chart %s, default image %s\n", rec.ChartArchive, ref.Context())
	chartDir := filepath.Join(staging, "chart", "tally")
	set := map[string]string{"image.repository": ref.Context().String()}
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

	fmt.Printf(">> image %s\n", rec.Image)
	imageArchive := filepath.Join(staging, rec.ImageArchive)
	if err := run(root, nil, "go", "run", "./hack/image", "--root", root, "--version", b.version, "--source", b.project, "--tag", rec.Image, "--out", imageArchive); err != nil {
		return err
	}
	if rec.ImageDigest, err = archiveDigest(imageArchive); err != nil {
		return err
	}

	fmt.Println(">> goreleaser: kubectl-tally archives, SBOMs, krew manifest, checksums")
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
		"PATH=" + path,
		"SYFT_CHECK_FOR_APP_UPDATE=false",
		"COMMIT_TIMESTAMP=" + strconv.FormatInt(created.Unix(), 10),
		"COMMIT_DATE=" + created.Format(time.RFC3339),
	}
	if err := run(root, env, b.goreleaser, "release", "--snapshot", "--clean"); err != nil {
		return err
	}
	for _, f := range []string{chartArchive, imageArchive} {
		if err := copyFile(f, filepath.Join(dist, filepath.Base(f))); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(dist, "release-notes.md"), []byte(notes), 0o644); err != nil {
		return err
	}
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dist, recordFile), append(data, '\n'), 0o644); err != nil {
		return err
	}
	return summary(dist, rec)
}

// archiveDigest returns the digest of the image index in an image archive.
func archiveDigest(path string) (string, error) {
	a, err := image.OpenArchive(path)
	if err != nil {
		return "", err
	}
	defer a.Close()
	d, err := a.Index.Digest()
	if err != nil {
		return "", err
	}
	return d.String(), nil
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
		if e.IsDir() && e.Name() != "krew" || slices.Contains(goreleaserFiles, e.Name()) {
			continue
		}
		name := e.Name()
		if e.IsDir() {
			name = filepath.Join("krew", "tally.yaml")
		}
		info, err := os.Stat(filepath.Join(dist, name))
		if err != nil {
			return err
		}
		fmt.Printf("  %-48s %10s\n", name, size(info.Size()))
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
