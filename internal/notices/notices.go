// Package notices finds the licence and NOTICE files of every module a
// build of tally bundles, from the module graph of the packages it links,
// and checks each module's licence against the licences tally may ship.
// make image and make release copy what it finds beside the binaries, as
// Apache-2.0 §4(d) and the other licences ask.
package notices

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Commands are the packages tally's image and release archives bundle.
var Commands = []string{"./cmd/webhook", "./cmd/aggregator", "./cmd/kubectl-tally"}

// Platforms are the GOOS/GOARCH pairs a release builds: the modules a
// platform links (golang.org/x/sys/windows, say) differ from another's.
var Platforms = []string{"linux/amd64", "linux/arm64", "darwin/amd64", "darwin/arm64", "windows/amd64"}

// Allowed are the licences (SPDX identifiers) a bundled module may carry:
// permissive ones, and MPL-2.0, whose files tally ships unmodified.
var Allowed = []string{"Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "MIT", "MPL-2.0"}

// Dir is the folder of an image or an archive that holds the notices:
// Dir/<module path>/<file>.
const Dir = "licenses"

// Module is one module a build bundles.
type Module struct {
	// Path and Version name the module; the standard library is "std", at
	// the go command's version.
	Path, Version string
	// Dir is where the module's files are (the module cache).
	Dir string
	// Files are the licence and NOTICE files, as slash-separated paths
	// relative to Dir, of the module's root and of every folder between it
	// and a package the build links (a package forked from elsewhere keeps
	// its own licence beside it), in lexical order.
	Files []string
	// Licenses are the SPDX identifiers its licence files match.
	Licenses []string
	// Unknown are the licence files that match no licence Classify knows.
	Unknown []string
}

// File is one file to ship: its path in the image or archive, and its
// content.
type File struct {
	Name string
	Data []byte
}

// Bundled returns the modules that the packages pkgs, built in root for
// each of platforms, link, the standard library among them, in path order.
func Bundled(ctx context.Context, root string, platforms, pkgs []string) ([]Module, error) {
	byPath := map[string]*Module{}
	// pkgDirs are the folders of the packages linked, by module path.
	pkgDirs := map[string]map[string]bool{}
	for _, p := range platforms {
		goos, goarch, ok := strings.Cut(p, "/")
		if !ok {
			return nil, fmt.Errorf("platform %q is not GOOS/GOARCH", p)
		}
		if err := linked(ctx, root, goos, goarch, pkgs, byPath, pkgDirs); err != nil {
			return nil, err
		}
	}
	std, err := standardLibrary(ctx, root)
	if err != nil {
		return nil, err
	}
	byPath[std.Path] = std
	var out []Module
	for _, m := range byPath {
		if err := m.read(pkgDirs[m.Path]); err != nil {
			return nil, err
		}
		out = append(out, *m)
	}
	slices.SortFunc(out, func(a, b Module) int { return strings.Compare(a.Path, b.Path) })
	return out, nil
}

// listed is what go list -json=Dir,Module says of a package.
type listed struct {
	Dir    string
	Module *struct {
		Path, Version, Dir string
		Main               bool
		Replace            *struct{ Path, Version, Dir string }
	}
}

// linked adds to byPath the modules of the packages pkgs and their
// dependencies for one platform, and to pkgDirs the folders of those
// packages.
func linked(ctx context.Context, root, goos, goarch string, pkgs []string, byPath map[string]*Module, pkgDirs map[string]map[string]bool) error {
	cmd := exec.CommandContext(ctx, "go", append([]string{"list", "-deps", "-json=Dir,Module"}, pkgs...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOOS="+goos, "GOARCH="+goarch, "CGO_ENABLED=0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("go list -deps for %s/%s: %w: %s", goos, goarch, err, strings.TrimSpace(stderr.String()))
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var l listed
		if err := dec.Decode(&l); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return fmt.Errorf("reading go list's output: %w", err)
		}
		m := l.Module
		if m == nil || m.Main { // the standard library, or tally itself
			continue
		}
		mod := byPath[m.Path]
		if mod == nil {
			mod = &Module{Path: m.Path, Version: m.Version, Dir: m.Dir}
			if r := m.Replace; r != nil {
				mod.Version, mod.Dir = r.Version, r.Dir
			}
			if mod.Dir == "" {
				return fmt.Errorf("module %s %s is not in the module cache (go mod download)", mod.Path, mod.Version)
			}
			byPath[m.Path] = mod
			pkgDirs[m.Path] = map[string]bool{}
		}
		pkgDirs[m.Path][l.Dir] = true
	}
}

// standardLibrary is Go's own: every binary links its runtime. Its
// licence, at GOROOT, covers the packages it forks too.
func standardLibrary(ctx context.Context, root string) (*Module, error) {
	cmd := exec.CommandContext(ctx, "go", "env", "GOROOT", "GOVERSION")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go env GOROOT GOVERSION: %w", err)
	}
	lines := strings.Fields(string(out))
	if len(lines) != 2 {
		return nil, fmt.Errorf("go env GOROOT GOVERSION printed %q", out)
	}
	return &Module{Path: "std", Version: lines[1], Dir: lines[0]}, nil
}

// noticeFile matches the names of licence and NOTICE files: LICENSE,
// LICENCE, COPYING, NOTICE, with a suffix such as .txt, .md or -APACHE;
// not source files such as license.go.
var noticeFile = regexp.MustCompile(`(?i)^(licen[cs]e|copying|notice)([._-][a-z0-9._-]*)?$`)

// sourceFile matches the names noticeFile must not take.
var sourceFile = regexp.MustCompile(`(?i)\.(go|s|c|h|py|sh|json|ya?ml|proto)$`)

// read finds m's licence and NOTICE files, in its root and in every folder
// from a linked package's (in pkgDirs) up to the root, and classifies its
// licences.
func (m *Module) read(pkgDirs map[string]bool) error {
	dirs := map[string]bool{".": true}
	for d := range pkgDirs {
		rel, err := filepath.Rel(m.Dir, d)
		if err != nil || !filepath.IsLocal(rel) && rel != "." {
			continue // a package outside its module's folder: none is
		}
		for ; rel != "."; rel = filepath.Dir(rel) {
			dirs[filepath.ToSlash(rel)] = true
		}
	}
	for dir := range dirs {
		entries, err := os.ReadDir(filepath.Join(m.Dir, filepath.FromSlash(dir)))
		if err != nil {
			return fmt.Errorf("module %s %s: %w", m.Path, m.Version, err)
		}
		for _, e := range entries {
			if e.Type().IsRegular() && noticeFile.MatchString(e.Name()) && !sourceFile.MatchString(e.Name()) {
				m.Files = append(m.Files, path.Join(dir, e.Name()))
			}
		}
	}
	slices.Sort(m.Files)
	for _, name := range m.Files {
		if isNotice(name) {
			continue
		}
		text, err := os.ReadFile(filepath.Join(m.Dir, filepath.FromSlash(name)))
		if err != nil {
			return fmt.Errorf("module %s %s: %w", m.Path, m.Version, err)
		}
		ids := Classify(text)
		if len(ids) == 0 {
			m.Unknown = append(m.Unknown, name)
		}
		for _, id := range ids {
			if !slices.Contains(m.Licenses, id) {
				m.Licenses = append(m.Licenses, id)
			}
		}
	}
	slices.Sort(m.Licenses)
	return nil
}

func isNotice(name string) bool { return strings.HasPrefix(strings.ToUpper(path.Base(name)), "NOTICE") }

// licenceMarks are phrases only the licence's text holds, all of which a
// file must hold to be that licence, and none of the phrases that make it
// another. BSD-2-Clause is the BSD text without BSD-3-Clause's third
// clause, BSD-3-Clause without BSD-4-Clause's advertising clause. The
// licences tally may not ship are known too, so that a file that adds
// one to an allowed text (MIT with "good, not evil", Apache-2.0 with the
// Commons Clause) is refused rather than taken for the allowed one.
var licenceMarks = []struct {
	id    string
	marks []string
	not   []string
}{
	{id: "Apache-2.0", marks: []string{"apache license", "version 2.0"}},
	{id: "MIT", marks: []string{"permission is hereby granted, free of charge, to any person obtaining a copy"}},
	{id: "BSD-4-Clause", marks: []string{"redistribution and use in source and binary forms", "all advertising materials mentioning features or use of this software"}},
	{id: "BSD-3-Clause", marks: []string{"redistribution and use in source and binary forms", "endorse or promote products derived from this software"},
		not: []string{"all advertising materials mentioning features or use of this software"}},
	{id: "BSD-2-Clause", marks: []string{"redistribution and use in source and binary forms"},
		not: []string{"endorse or promote products derived from this software", "all advertising materials mentioning features or use of this software"}},
	{id: "ISC", marks: []string{"permission to use, copy, modify, and/or distribute this software for any purpose"}},
	{id: "MPL-2.0", marks: []string{"mozilla public license", "2.0"}},
	{id: "JSON", marks: []string{"the software shall be used for good, not evil"}},
	{id: "Commons-Clause", marks: []string{"commons clause"}},
	// MPL-2.0 names the GNU licences as its "Secondary Licenses".
	{id: "GPL", marks: []string{"gnu general public license"}, not: []string{"mozilla public license"}},
	{id: "LGPL", marks: []string{"gnu lesser general public license"}, not: []string{"mozilla public license"}},
	{id: "AGPL", marks: []string{"gnu affero general public license"}, not: []string{"mozilla public license"}},
	{id: "SSPL", marks: []string{"server side public license"}},
	{id: "BUSL", marks: []string{"business source license"}},
	{id: "Elastic", marks: []string{"elastic license"}},
	{id: "PolyForm", marks: []string{"polyform"}},
	{id: "CC-NC/SA", marks: []string{"creative commons"}, not: []string{"cc0"}},
	{id: "Confluent", marks: []string{"confluent community license"}},
	{id: "RSAL", marks: []string{"redis source available license"}},
	{id: "FSL", marks: []string{"functional source license"}},
	{id: "NonCommercial", marks: []string{"noncommercial"}},
}

var space = regexp.MustCompile(`\s+`)

// Classify returns the SPDX identifiers of the licences text holds (a
// file may hold several), or none it knows.
func Classify(text []byte) []string {
	t := space.ReplaceAllString(strings.ToLower(string(text)), " ")
	var ids []string
	for _, l := range licenceMarks {
		if containsAll(t, l.marks) && !containsAny(t, l.not) {
			ids = append(ids, l.id)
		}
	}
	return ids
}

func containsAll(t string, marks []string) bool {
	for _, m := range marks {
		if !strings.Contains(t, m) {
			return false
		}
	}
	return true
}

func containsAny(t string, marks []string) bool {
	return slices.ContainsFunc(marks, func(m string) bool { return strings.Contains(t, m) })
}

// Check returns an error naming every module that carries no licence file,
// a licence file that matches no licence tally knows, or a licence that is
// not Allowed.
func Check(mods []Module) error {
	var errs []error
	for _, m := range mods {
		switch {
		case !slices.ContainsFunc(m.Files, func(f string) bool { return !isNotice(f) }):
			errs = append(errs, fmt.Errorf("module %s %s has no licence file", m.Path, m.Version))
		case len(m.Unknown) > 0:
			errs = append(errs, fmt.Errorf("module %s %s: its licence files %s match no licence tally knows", m.Path, m.Version, strings.Join(m.Unknown, ", ")))
		case len(m.Licenses) == 0:
			errs = append(errs, fmt.Errorf("module %s %s: its licence files match no licence tally knows", m.Path, m.Version))
		default:
			for _, id := range m.Licenses {
				if !slices.Contains(Allowed, id) {
					errs = append(errs, fmt.Errorf("module %s %s is licensed %s, not one of %s", m.Path, m.Version, id, strings.Join(Allowed, ", ")))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// Ship returns the files to ship with a build of pkgs for platforms
// (Bundled, then Files), or an error if a module's licence is missing or
// not allowed (Check).
func Ship(ctx context.Context, root string, platforms, pkgs []string) ([]File, error) {
	mods, err := Bundled(ctx, root, platforms, pkgs)
	if err != nil {
		return nil, err
	}
	if err := Check(mods); err != nil {
		return nil, fmt.Errorf("the build would bundle modules it may not ship: %w", err)
	}
	return Files(mods)
}

// Files returns the files to ship for mods: each module's licence and
// NOTICE files under Dir/<module path>/ (at their own paths in the module),
// and Dir/README listing every module with its version and licences.
func Files(mods []Module) ([]File, error) {
	var files []File
	var index strings.Builder
	index.WriteString("The licence and NOTICE files of the modules this build bundles, one folder per module.\n\n")
	for _, m := range mods {
		fmt.Fprintf(&index, "%s %s %s\n", m.Path, m.Version, strings.Join(m.Licenses, " AND "))
		for _, name := range m.Files {
			data, err := os.ReadFile(filepath.Join(m.Dir, filepath.FromSlash(name)))
			if err != nil {
				return nil, fmt.Errorf("module %s %s: %w", m.Path, m.Version, err)
			}
			files = append(files, File{Name: path.Join(Dir, m.Path, name), Data: data})
		}
	}
	return append(files, File{Name: path.Join(Dir, "README"), Data: []byte(index.String())}), nil
}
