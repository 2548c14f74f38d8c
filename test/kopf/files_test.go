package kopf

import (
	"bytes"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
)

var (
	valuesFile = repo.Path("examples", "kopf", "values.yaml")
	rbacFile   = repo.Path("examples", "kopf", "rbac.yaml")
)

// TestValuesMapWhatTheOperatorReads: examples/kopf/values.yaml is a valid
// configuration that maps every status field operator.py reads, so that
// none of them reads as absent (the restart budget would read 0 forever).
func TestValuesMapWhatTheOperatorReads(t *testing.T) {
	data, err := os.ReadFile(valuesFile)
	require.NoError(t, err)
	var values struct {
		Parents []map[string]any `json:"parents"`
	}
	require.NoError(t, yaml.Unmarshal(data, &values))
	doc, err := yaml.Marshal(map[string]any{"parents": values.Parents})
	require.NoError(t, err)
	cfg, err := config.Check(doc)
	require.NoError(t, err, "the values' parents are not a valid configuration")
	require.Len(t, cfg.Parents, 1)
	mapped := map[string]bool{}
	for _, f := range cfg.Parents[0].Fields() {
		mapped[strings.Join(f.Path, ".")] = true
	}

	source, err := os.ReadFile(operatorFile)
	require.NoError(t, err)
	reads := regexp.MustCompile(`status\.get\("([A-Za-z]+)"\)`).FindAllSubmatch(source, -1)
	require.NotEmpty(t, reads, "operator.py reads no status field")
	for _, m := range reads {
		assert.True(t, mapped["status."+string(m[1])], "operator.py reads status.%s, which examples/kopf/values.yaml does not map", m[1])
	}
}

// TestRBACGrantsWhatTheOperatorCalls: examples/kopf/rbac.yaml grants, in
// one namespace, every verb operator.py uses on pods, and what Kopf needs
// on the pools and for events; and nothing on pods cluster-wide.
func TestRBACGrantsWhatTheOperatorCalls(t *testing.T) {
	source, err := os.ReadFile(operatorFile)
	require.NoError(t, err)
	need := map[string][]string{"example.tally.dev/workerpools": {"get", "list", "watch", "patch"}, "/events": {"create"}, "/pods": {"watch"}}
	verbOf := map[string]string{"list": "list", "read": "get", "create": "create", "patch": "patch", "delete": "delete"}
	for _, m := range regexp.MustCompile(`core\.([a-z]+)_namespaced_pod\(`).FindAllSubmatch(source, -1) {
		verb, ok := verbOf[string(m[1])]
		require.True(t, ok, "operator.py calls %s_namespaced_pod, which this test does not know", m[1])
		need["/pods"] = append(need["/pods"], verb)
	}

	granted := map[string][]string{}
	data, err := os.ReadFile(rbacFile)
	require.NoError(t, err)
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		if u.GetKind() != "Role" && u.GetKind() != "ClusterRole" {
			continue
		}
		var role rbacv1.Role
		require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &role))
		for _, rule := range role.Rules {
			for _, g := range rule.APIGroups {
				for _, r := range rule.Resources {
					if u.GetKind() == "ClusterRole" {
						assert.NotEqual(t, "pods", r, "the ClusterRole grants pods in every namespace")
						continue
					}
					granted[g+"/"+r] = append(granted[g+"/"+r], rule.Verbs...)
				}
			}
		}
	}
	for resource, verbs := range need {
		for _, v := range verbs {
			assert.True(t, slices.Contains(granted[resource], v), "examples/kopf/rbac.yaml does not grant %s on %s", v, resource)
		}
	}
}
