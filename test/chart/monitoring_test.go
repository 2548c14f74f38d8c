package chart

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
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/test/framework"
)

// promtool returns the promtool binary make test builds.
func promtool(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("PROMTOOL")
	require.NotEmpty(t, bin, "PROMTOOL is not set: run the chart tests through make test, which builds promtool")
	return bin
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
	groups, err := framework.AlertRules()
	require.NoError(t, err)
	rules, err := yaml.Marshal(map[string]any{"groups": groups})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), rules, 0o644))
	testFile, err := os.ReadFile(repo.Path("test", "chart", "testdata", "alerts_test.yaml"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "alerts_test.yaml"), testFile, 0o644))

	runPromtool(t, dir, "check", "rules", "rules.yaml")
	runPromtool(t, dir, "test", "rules", "alerts_test.yaml")

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
			for _, a := range []string{"summary", "description", "runbook_url"} {
				assert.NotEmpty(t, r.Annotations[a], "%s has no %s", r.Alert, a)
			}
			assert.True(t, strings.HasSuffix(r.Annotations["runbook_url"], "#"+strings.ToLower(r.Alert)), "%s: runbook_url %s", r.Alert, r.Annotations["runbook_url"])
			assert.True(t, regexp.MustCompile(`(?m)^### `+r.Alert+`$`).Match(runbook), "docs/operating.md has no section ### %s", r.Alert)
		}
	}
	assert.GreaterOrEqual(t, alerts, 10)
}

// TestAlertRulesWithoutLeaderElection: a single aggregator without leader
// election exports no lease metric; the alert looks for the aggregator
// itself.
func TestAlertRulesWithoutLeaderElection(t *testing.T) {
	groups, err := framework.AlertRules("aggregator.leaderElect=false")
	require.NoError(t, err)
	var found bool
	for _, g := range groups {
		for _, r := range g.Rules {
			if r.Alert == "TallyAggregatorNoLeader" {
				found = true
				assert.Equal(t, `absent(tally_aggregator_reconciles_total{namespace="tally-system"})`, r.Expr)
			}
		}
	}
	assert.True(t, found)
}

// TestAlertRulesExtend: a user's labels and annotations reach every alert,
// and thresholds reach the queries.
func TestAlertRulesExtend(t *testing.T) {
	groups, err := framework.AlertRules("metrics.prometheusRule.alertLabels.team=platform",
		"metrics.prometheusRule.alertAnnotations.dashboard=https://grafana.example.com/d/tally-overview",
		"metrics.prometheusRule.thresholds.heldPodSeconds=900")
	require.NoError(t, err)
	require.NotEmpty(t, groups)
	var held bool
	for _, g := range groups {
		for _, r := range g.Rules {
			assert.Equal(t, "platform", r.Labels["team"], r.Alert)
			assert.NotEmpty(t, r.Labels["severity"], r.Alert)
			assert.Equal(t, "https://grafana.example.com/d/tally-overview", r.Annotations["dashboard"], r.Alert)
			if r.Alert == "TallyPodsHeldByFinalizer" {
				held = true
				assert.Contains(t, r.Expr, "> 900")
			}
		}
	}
	assert.True(t, held, "no TallyPodsHeldByFinalizer alert")
}

// TestDashboard: the dashboard parses, every panel but the rows has
// queries, promtool accepts every query, and the chart's ConfigMap carries
// the dashboard as it is in the repository. Whether the binaries export
// each metric it reads is checked against their real /metrics by
// test/install.
func TestDashboard(t *testing.T) {
	d, err := framework.ReadDashboard()
	require.NoError(t, err)
	require.Equal(t, "tally-overview", d.UID)
	for _, p := range d.Panels {
		if p.Type != "row" {
			assert.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		}
	}
	queries := d.Queries()
	require.NotEmpty(t, queries)

	// Each query as a recording rule: promtool parses it.
	var rules []map[string]string
	for title, exprs := range queries {
		for i, expr := range exprs {
			assert.NotEmpty(t, framework.MetricNames(expr), "panel %q reads no tally metric: %s", title, expr)
			rules = append(rules, map[string]string{"record": fmt.Sprintf("dashboard:query_%d:%d", len(rules), i), "expr": expr})
		}
	}
	out, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dashboard.yaml"), out, 0o644))
	runPromtool(t, dir, "check", "rules", "dashboard.yaml")

	var cm corev1.ConfigMap
	require.True(t, find(t, objects(t, render(t, "monitoring.yaml")), "ConfigMap", release+"-dashboard", &cm))
	assert.Equal(t, "monitoring", cm.Namespace)
	assert.Equal(t, "1", cm.Labels["grafana_dashboard"])
	want, err := os.ReadFile(framework.DashboardPath)
	require.NoError(t, err)
	assert.JSONEq(t, string(want), cm.Data["tally.json"])
}
