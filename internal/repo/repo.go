// Package repo locates files of the tally source tree (the chart, the
// example's CRD, the commands) for the programs that run from a checkout:
// the demo, the suites, the bench programs, and the image and release
// builds, which also read the last commit.
package repo

import (
	"path/filepath"
	"runtime"
)

// Root returns the repository's root directory.
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Path returns a path relative to the repository's root.
func Path(elem ...string) string {
	return filepath.Join(append([]string{Root()}, elem...)...)
}
