package repo

import (
	"bufio"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sharedBuildModules are the go.mod files whose builds make test runs in one
// build cache: tally's commands and test binaries, kube-apiserver and etcd
// (hack/envtest), helm (hack/helm).
var sharedBuildModules = []string{"go.mod", "hack/envtest/go.mod", "hack/helm/go.mod"}

// TestBuildModulesAgree: a module that two of these builds compile is at
// one version in both, so the build cache compiles its packages once. A
// package compiled at another version, or over a dependency at another
// version, is compiled again: helm alone took 111 s on two cores after
// kube-apiserver with its Kubernetes modules one patch behind, 47 s at the
// same versions (2026-12-04).
func TestBuildModulesAgree(t *testing.T) {
	type seen struct{ version, file string }
	first := map[string]seen{} // by module path
	for _, file := range sharedBuildModules {
		versions := requiredVersions(t, filepath.Join(Root(), file))
		require.NotEmpty(t, versions, file)
		for path, version := range versions {
			s, ok := first[path]
			if !ok {
				first[path] = seen{version, file}
				continue
			}
			assert.Equal(t, s.version, version,
				"%s is at %s in %s and at %s in %s: raise the lower one (go get %s@<version> in its folder)", path, s.version, s.file, version, file, path)
		}
	}
}

// requiredVersions reads the version a go.mod selects for each module it
// requires: its require lines, with a replace's version in place of the one
// required.
func requiredVersions(t *testing.T, gomod string) map[string]string {
	t.Helper()
	f, err := os.Open(gomod)
	require.NoError(t, err)
	defer f.Close()
	required, replaced := map[string]string{}, map[string]string{}
	record := func(directive string, fields []string) {
		switch directive {
		case "require": // path version
			if len(fields) == 2 {
				required[fields[0]] = fields[1]
			}
		case "replace": // path [version] => path version
			if i := slices.Index(fields, "=>"); i > 0 && len(fields) == i+3 {
				replaced[fields[0]] = fields[i+2]
			}
		}
	}
	block := ""
	s := bufio.NewScanner(f)
	for s.Scan() {
		line, _, _ := strings.Cut(s.Text(), "//")
		fields := strings.Fields(line)
		switch {
		case len(fields) == 0:
		case fields[0] == ")":
			block = ""
		case fields[0] == "require" || fields[0] == "replace":
			if len(fields) == 2 && fields[1] == "(" {
				block = fields[0]
			} else {
				record(fields[0], fields[1:])
			}
		default:
			record(block, fields)
		}
	}
	require.NoError(t, s.Err(), gomod)
	for path, version := range replaced {
		if _, ok := required[path]; ok {
			required[path] = version
		}
	}
	return required
}
