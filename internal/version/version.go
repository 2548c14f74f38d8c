// Package version holds the version tally's commands report. A release sets
// it at link time (-X tally.dev/tally/internal/version.version=x.y.z); a
// build from source reports the module's version, or "dev".
package version

import (
	"fmt"
	"runtime/debug"

	k8sversion "k8s.io/apimachinery/pkg/util/version"
)

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

// MinKubernetes is the oldest Kubernetes minor tally supports, the oldest
// make test-compat runs. Its aggregator's freshness barrier reads a
// resourceVersion and waits for the pod watch to reach it. An API server
// whose watch cache requests progress from etcd (ConsistentListFromCache,
// on by default from 1.31, with etcd 3.5.13 or 3.4.31 and later) gets
// there within about a second; an older one's watch cache does not move
// past the pods' last change, so the proof waits for the next change of a
// pod, and in a quiet cluster never comes: no count is written.
const MinKubernetes = "1.31"

// CheckKubernetes returns an error naming the API server's version
// (gitVersion, such as v1.30.4-eks-1234) when it is older than
// MinKubernetes, or cannot be read.
func CheckKubernetes(gitVersion string) error {
	v, err := k8sversion.ParseGeneric(gitVersion)
	if err != nil {
		return fmt.Errorf("the API server's version %q cannot be read: %w", gitVersion, err)
	}
	if v.LessThan(k8sversion.MustParseGeneric(MinKubernetes)) {
		return fmt.Errorf("the API server is Kubernetes %s, older than %s: tally needs an API server whose watch cache requests progress from etcd "+
			"(the ConsistentListFromCache feature, on by default from 1.31); without it the aggregator proves its pod view fresh only once a pod changes, "+
			"and writes no count in a cluster whose pods do not",
			gitVersion, MinKubernetes)
	}
	return nil
}
