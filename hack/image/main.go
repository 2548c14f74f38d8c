// Command image builds tally's container image without a container engine
// (`make image`, `make push`): the commands of cmd/ that ship in it,
// statically linked for linux/amd64 and linux/arm64, in one OCI index,
// tagged <image.repository>:<appVersion> from the chart's values and
// Chart.yaml (the chart's default image is this one; make release sets
// --version and --tag), the version stamped into every command (--version
// prints it). It writes an archive
// (--out) or pushes to a registry (--push). The same sources give the same
// digest: binaries are built with -trimpath and no build ID, and every
// timestamp is the last commit's. Every image holds the repository's
// LICENSE and NOTICE beside the commands, the licence and NOTICE files of
// every module its commands link under /licenses (internal/notices; a
// module whose licence is not allowed stops the build), and carries its
// licence (license) in the org.opencontainers.image.licenses label. With --cmd it builds the same
// way an image of other commands of the repository (the one-node cluster's
// pause image, the WorkerPool example's operator and worker).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/image"
	"tally.dev/tally/internal/notices"
	"tally.dev/tally/internal/repo"
	tallyversion "tally.dev/tally/internal/version"
)

// license is the SPDX identifier of the repository's licence (LICENSE),
// the image's org.opencontainers.image.licenses label.
const license = "Apache-2.0"

// licenseFile and noticeFile are the repository's licence and notice,
// which every image holds at its root under the same names.
const (
	licenseFile = "LICENSE"
	noticeFile  = "NOTICE"
)

func main() {
	out := flag.String("out", "", "write the image as an OCI layout archive to this file")
	push := flag.String("push", "", "push the image index to this reference (registry/repository:tag)")
	root := flag.String("root", ".", "the repository's root")
	cmds := flag.String("cmd", "", "comma-separated packages to build into the image instead of tally's commands (./examples/workerpool/cmd/worker,...)")
	tag := flag.String("tag", "", "the image's reference in the archive (default <image.repository>:<appVersion> of the chart)")
	entrypoint := flag.String("entrypoint", "", "the image's entrypoint (default none: the pod names the command)")
	arches := flag.String("arch", "amd64,arm64", "comma-separated architectures")
	source := flag.String("source", "", "the project's home page, the image's org.opencontainers.image.source label (default: no such label)")
	ver := flag.String("version", "", "the image's version, stamped into its commands and labels (default the chart's appVersion)")
	flag.Parse()
	if (*out == "") == (*push == "") {
		fmt.Fprintln(os.Stderr, "image: give exactly one of --out FILE and --push REF")
		os.Exit(2)
	}
	b := build{root: *root, source: *source, tag: *tag, entrypoint: *entrypoint, version: *ver, arches: strings.Split(*arches, ",")}
	if *cmds != "" {
		b.packages = strings.Split(*cmds, ",")
	}
	if err := b.run(*out, *push); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

// build is what to build: tally's image, or (packages set) an image of other
// commands of the repository, such as the examples' operator and worker.
type build struct {
	root, source, tag, entrypoint, version string
	packages, arches                       []string
}

func (b build) run(out, push string) error {
	version, repository, err := chartImage(b.root)
	if err != nil {
		return err
	}
	if b.version != "" {
		version = b.version
	}
	revision, created, err := repo.LastCommit(b.root)
	if err != nil {
		return err
	}
	var own []image.File
	for _, name := range []string{licenseFile, noticeFile} {
		data, err := os.ReadFile(filepath.Join(b.root, name))
		if err != nil {
			return fmt.Errorf("the image holds the repository's %s: %w", name, err)
		}
		own = append(own, image.File{Name: name, Mode: 0o644, Data: data})
	}
	dir, err := os.MkdirTemp("", "tally-image-build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	title, packages := "tally", b.packages
	if packages == nil {
		packages = notices.Commands
	} else {
		title = path.Base(packages[0])
	}
	opts := image.Options{
		Created: created,
		Labels: map[string]string{
			"org.opencontainers.image.version":  version,
			"org.opencontainers.image.revision": revision,
			"org.opencontainers.image.title":    title,
			"org.opencontainers.image.licenses": license,
		},
	}
	if b.source != "" {
		opts.Labels["org.opencontainers.image.source"] = b.source
	}
	if b.entrypoint != "" {
		opts.Entrypoint = []string{b.entrypoint}
	}
	for _, arch := range b.arches {
		files, err := bundledNotices(b.root, arch, packages)
		if err != nil {
			return err
		}
		p := image.Platform{OS: "linux", Architecture: arch, Binaries: map[string]string{}, Files: append(slices.Clone(own), files...)}
		for _, pkg := range packages {
			name := path.Base(pkg)
			bin := filepath.Join(dir, arch, name)
			if err := goBuild(b.root, arch, version, pkg, bin); err != nil {
				return err
			}
			p.Binaries[name] = bin
		}
		opts.Platforms = append(opts.Platforms, p)
	}
	idx, err := image.Index(opts)
	if err != nil {
		return err
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	if push != "" {
		ref, err := name.ParseReference(push)
		if err != nil {
			return err
		}
		if err := remote.WriteIndex(ref, idx, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return fmt.Errorf("pushing %s: %w", ref, err)
		}
		fmt.Printf("pushed %s@%s\n", ref, digest)
		return nil
	}
	ref := b.tag
	if ref == "" {
		ref = repository + ":" + version
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	hostArch := runtime.GOARCH
	if !slices.Contains(b.arches, hostArch) {
		hostArch = b.arches[0]
	}
	if err := image.WriteArchive(idx, tag, hostArch, created, out); err != nil {
		return err
	}
	fmt.Printf("wrote %s: %s@%s\n", out, tag, digest)
	return nil
}

// goBuild builds the package pkg statically for linux/arch, reproducibly,
// stamped with version.
func goBuild(root, arch, version, pkg, out string) error {
	c := exec.Command("go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w -buildid= "+tallyversion.LinkerFlag(version), "-o", out, pkg)
	c.Dir = root
	c.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	if b, err := c.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s for linux/%s: %w: %s", pkg, arch, err, b)
	}
	return nil
}

// chartImage reads the chart's appVersion (the image's tag and version)
// and its default image.repository.
func chartImage(root string) (version, repository string, err error) {
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	var values struct {
		Image struct {
			Repository string `json:"repository"`
		} `json:"image"`
	}
	for file, into := range map[string]any{"Chart.yaml": &chart, "values.yaml": &values} {
		data, err := os.ReadFile(filepath.Join(root, "charts", "tally", file))
		if err != nil {
			return "", "", err
		}
		if err := yaml.Unmarshal(data, into); err != nil {
			return "", "", fmt.Errorf("charts/tally/%s: %w", file, err)
		}
	}
	if chart.AppVersion == "" || values.Image.Repository == "" {
		return "", "", errors.New("charts/tally needs an appVersion (Chart.yaml) and an image.repository (values.yaml)")
	}
	return chart.AppVersion, values.Image.Repository, nil
}

// bundledNotices returns the licence and NOTICE files of the modules that
// packages link on linux/arch, with the directories that hold them; an
// error if a module's licence is missing or not allowed.
func bundledNotices(root, arch string, packages []string) ([]image.File, error) {
	found, err := notices.Ship(context.Background(), root, []string{"linux/" + arch}, packages)
	if err != nil {
		return nil, fmt.Errorf("the image's licences: %w", err)
	}
	var files []image.File
	dirs := map[string]bool{}
	for _, f := range found {
		for d := path.Dir(f.Name); d != "." && !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
			files = append(files, image.File{Name: d, Mode: 0o755, Dir: true})
		}
		files = append(files, image.File{Name: f.Name, Mode: 0o644, Data: f.Data})
	}
	return files, nil
}
