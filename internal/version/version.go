// Package version holds the version tally's commands report. A release sets
// it at link time (-X tally.dev/tally/internal/version.version=x.y.z); a
// build from source reports the module's version, or "dev".
package version

import "runtime/debug"

// version is set by the release build's linker flags.
var version string

// String returns the version of the running binary.
func String() string {
	if version != "" {
		return version
	}
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" && info.Main.Version != "(devel)" {
		return info.Main.Version
	}
	return "dev"
}

// LinkerFlag returns the -X flag that stamps v into a build.
func LinkerFlag(v string) string {
	return "-X tally.dev/tally/internal/version.version=" + v
}
