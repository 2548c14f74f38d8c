package docs

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
)

// TestCustomCountExamples: the custom counts docs/configuration.md shows are
// valid, and evaluate without an error both on a bare pod (one container,
// no labels, no annotations, no status) and on a pod that has labels,
// annotations and statuses other than those they read: an example that
// fails on either would undercount the pods a user has.
func TestCustomCountExamples(t *testing.T) {
	doc, err := os.ReadFile(repo.Path("docs", "configuration.md"))
	require.NoError(t, err)
	_, block, found := strings.Cut(string(doc), "```yaml\ncustomCounts:\n")
	require.True(t, found, "docs/configuration.md shows its custom counts in a ```yaml block that starts with customCounts:")
	block, _, _ = strings.Cut(block, "```")
	var indented strings.Builder
	for line := range strings.Lines(block) {
		indented.WriteString("    " + line)
	}
	cfg, err := config.Check([]byte("parents:\n  - group: example.tally.dev\n    version: v1\n    kind: WorkerPool\n    customCounts:\n" + indented.String()))
	require.NoError(t, err)
	p := cfg.Parents[0]
	require.GreaterOrEqual(t, len(p.CustomCounts), 4)
	programs, errs := p.Programs()
	spec := corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "worker"}}}
	pods := map[string]*corev1.Pod{
		"bare": {Spec: spec},
		"other keys": {
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "w"}, Annotations: map[string]string{"note": "x"}},
			Spec:       spec,
			Status: corev1.PodStatus{
				Phase:             corev1.PodRunning,
				Conditions:        []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}},
				ContainerStatuses: []corev1.ContainerStatus{{Name: "c"}},
			},
		},
	}
	for i, prg := range programs {
		require.NoError(t, errs[i])
		for name, pod := range pods {
			_, err := prg.Match(pod)
			assert.NoError(t, err, "the documented count %q fails on a %s pod", p.CustomCounts[i].Name, name)
		}
	}
}
