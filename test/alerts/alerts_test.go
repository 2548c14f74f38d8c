// Package alerts checks the chart's alerting rules and the dashboard's
// queries with promtool, which make test-release builds: the rules parse,
// their unit tests (testdata/alerts_test.yaml) make every alert fire on one
// series and keep it quiet on a healthy one, every alert has a runbook
// section, and every dashboard query parses.
package alerts

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/test/framework"
)

// promtool returns the promtool binary make test builds.
func promtool(t *testing.T) string {
	t.Helper()
	return framework.Tool(t, "PROMTOOL", "test-release")
}

func runPromtool(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
}

// alertTests is the part of testdata/alerts_test.yaml (promtool's rule
// unit-test format) that says which alerts each test expects.
type alertTests struct {
	Tests []struct {
		Name          string `json:"name"`
		AlertRuleTest []struct {
			Alertname string            `json:"alertname"`
			ExpAlerts []json.RawMessage `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// TestAlertRules checks the rendered alerts with promtool and runs their
// unit tests (testdata/alerts_test.yaml), which must make every alert fire
// on one series and stay quiet on a healthy one; every alert has its
// runbook section in docs/operating.md.
func TestAlertRules(t *testing.T) {
	groups, testFile := promtoolTest(t, "alerts_test.yaml")

	var tests alertTests
	require.NoError(t, yaml.Unmarshal(testFile, &tests))
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tt := range tests.Tests {
		for _, a := range tt.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	runbook, err := os.ReadFile(repo.Path("docs", "operating.md"))
	require.NoError(t, err)
	var alerts int
	for _, g := range groups {
		for _, r := range g.Rules {
			alerts++
			assert.True(t, fires[r.Alert], "no test makes %s fire", r.Alert)
			assert.True(t, quiet[r.Alert], "no test keeps %s quiet", r.Alert)
			assert.Contains(t, []string{"critical", "warning"}, r.Labels["severity"], "%s: severity", r.Alert)
			for _, a := range []string{"summary", "description", "runbook"} {
				assert.NotEmpty(t, r.Annotations[a], "%s has no %s", r.Alert, a)
			}
			assert.Equal(t, "docs/operating.md#"+strings.ToLower(r.Alert), r.Annotations["runbook"], r.Alert)
			assert.NotContains(t, r.Annotations, "runbook_url", "%s: without runbookURL there is no runbook_url", r.Alert)
			assert.True(t, regexp.MustCompile(`(?m)^### `+r.Alert+`$`).Match(runbook), "docs/operating.md has no section ### %s", r.Alert)
		}
	}
	assert.GreaterOrEqual(t, alerts, 10)
}

// TestDashboardQueries: promtool parses every query of the dashboard, each
// taken as a recording rule.
func TestDashboardQueries(t *testing.T) {
	d, err := framework.ReadDashboard()
	require.NoError(t, err)
	var rules []map[string]string
	for _, exprs := range d.Queries() {
		for i, expr := range exprs {
			rules = append(rules, map[string]string{"record": fmt.Sprintf("dashboard:query_%d:%d", len(rules), i), "expr": expr})
		}
	}
	require.NotEmpty(t, rules)
	out, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dashboard.yaml"), out, 0o644))
	runPromtool(t, dir, "check", "rules", "dashboard.yaml")
}

// TestAlertsWithoutLeaderElection runs testdata/without_leader_election_test.yaml
// on the rules rendered with aggregator.leaderElect=false: TallyAggregatorNoLeader
// reads a series every running aggregator exposes from its start.
func TestAlertsWithoutLeaderElection(t *testing.T) {
	promtoolTest(t, "without_leader_election_test.yaml", "aggregator.leaderElect=false")
}

// promtoolTest renders the chart's alerts with the --set values set, checks
// them with promtool and runs the rule unit tests of testdata/name on them;
// it returns the rules' groups and the tests file.
func promtoolTest(t *testing.T, name string, set ...string) ([]framework.RuleGroup, []byte) {
	t.Helper()
	groups, err := framework.AlertRules(set...)
	require.NoError(t, err)
	rules, err := yaml.Marshal(map[string]any{"groups": groups})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), rules, 0o644))
	testFile, err := os.ReadFile(repo.Path("test", "alerts", "testdata", name))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "alerts_test.yaml"), testFile, 0o644))
	runPromtool(t, dir, "check", "rules", "rules.yaml")
	runPromtool(t, dir, "test", "rules", "alerts_test.yaml")
	return groups, testFile
}
