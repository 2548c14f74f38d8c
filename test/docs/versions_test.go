package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	k8sversion "k8s.io/apimachinery/pkg/util/version"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/internal/version"
)

// TestKubernetesVersions: the Kubernetes versions tally claims are the
// ones it tests. The oldest minor make test-compat runs (hack/compat) is
// version.MinKubernetes, which the chart's kubeVersion requires, every
// "Kubernetes 1.N or later" in the docs says, and the README names with
// every other minor make test-compat runs.
func TestKubernetesVersions(t *testing.T) {
	entries, err := os.ReadDir(repo.Path("hack", "compat"))
	require.NoError(t, err)
	var minors []*k8sversion.Version
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		v, err := k8sversion.ParseGeneric(e.Name())
		require.NoError(t, err, "hack/compat/%s is not named for a Kubernetes minor", e.Name())
		minors = append(minors, v)
	}
	require.NotEmpty(t, minors, "hack/compat holds no Kubernetes minor")
	slices.SortFunc(minors, func(a, b *k8sversion.Version) int {
		switch {
		case a.LessThan(b):
			return -1
		case b.LessThan(a):
			return 1
		}
		return 0
	})
	assert.Equal(t, version.MinKubernetes, minors[0].String(), "the oldest minor make test-compat runs is not version.MinKubernetes")

	chart, err := os.ReadFile(repo.Path("charts", "tally", "Chart.yaml"))
	require.NoError(t, err)
	var meta struct{ KubeVersion string }
	require.NoError(t, yaml.Unmarshal(chart, &meta))
	assert.Equal(t, ">="+version.MinKubernetes+".0-0", meta.KubeVersion, "Chart.yaml's kubeVersion")

	readme, err := os.ReadFile(repo.Path("README.md"))
	require.NoError(t, err)
	for _, v := range minors {
		named := regexp.MustCompile(`\b` + regexp.QuoteMeta(v.String()) + `\b`).Match(readme)
		assert.True(t, named, "README.md does not name Kubernetes %s, which make test-compat runs", v)
	}

	claim := regexp.MustCompile(`Kubernetes\*{0,2}\s+(1\.\d+)\s+or\s+later`)
	docs, err := filepath.Glob(repo.Path("docs", "*.md"))
	require.NoError(t, err)
	docs = append(docs, repo.Path("README.md"), repo.Path("charts", "tally", "README.md"))
	claims := 0
	for _, p := range docs {
		data, err := os.ReadFile(p)
		require.NoError(t, err)
		text := strings.Join(strings.Fields(string(data)), " ")
		for _, m := range claim.FindAllStringSubmatch(text, -1) {
			claims++
			assert.Equal(t, version.MinKubernetes, m[1], "%s claims %q", filepath.Base(p), m[0])
		}
	}
	assert.NotZero(t, claims, "no doc says which Kubernetes tally needs")
}
