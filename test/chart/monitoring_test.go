package chart

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"tally.dev/tally/test/framework"
)

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
				assert.Equal(t, `absent_over_time(tally_aggregator_pod_watch_stale_seconds{namespace="tally-system"}[1m])`, r.Expr)
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
		"metrics.prometheusRule.thresholds.heldPodSeconds=900",
		"metrics.prometheusRule.runbookURL=https://docs.example/tally/operating.md")
	require.NoError(t, err)
	require.NotEmpty(t, groups)
	var held bool
	for _, g := range groups {
		for _, r := range g.Rules {
			assert.Equal(t, "platform", r.Labels["team"], r.Alert)
			assert.NotEmpty(t, r.Labels["severity"], r.Alert)
			assert.Equal(t, "https://grafana.example.com/d/tally-overview", r.Annotations["dashboard"], r.Alert)
			assert.Equal(t, "https://docs.example/tally/operating.md#"+strings.ToLower(r.Alert), r.Annotations["runbook_url"], r.Alert)
			if r.Alert == "TallyPodsHeldByFinalizer" {
				held = true
				assert.Contains(t, r.Expr, "> 900")
			}
		}
	}
	assert.True(t, held, "no TallyPodsHeldByFinalizer alert")
}

// TestAlertRulesOverrides: an alert's for and severity can be changed, or
// the alert left out, by name; its description states the for it has.
func TestAlertRulesOverrides(t *testing.T) {
	defaults, err := framework.AlertRules()
	require.NoError(t, err)
	groups, err := framework.AlertRules("metrics.prometheusRule.overrides.TallyWebhookDown.for=30s",
		"metrics.prometheusRule.overrides.TallyWebhookDown.severity=warning",
		"metrics.prometheusRule.overrides.TallyPodsHeldByFinalizer.for=0m",
		"metrics.prometheusRule.overrides.TallyWebhookCallsFail.enabled=false")
	require.NoError(t, err)
	rules := func(groups []framework.RuleGroup) map[string]framework.AlertRule {
		out := map[string]framework.AlertRule{}
		for _, g := range groups {
			for _, r := range g.Rules {
				out[r.Alert] = r
			}
		}
		return out
	}
	before, after := rules(defaults), rules(groups)
	require.Contains(t, before, "TallyWebhookCallsFail")
	assert.NotContains(t, after, "TallyWebhookCallsFail")
	assert.Len(t, after, len(before)-1)

	down := after["TallyWebhookDown"]
	assert.Equal(t, "30s", down.For)
	assert.Equal(t, "warning", down.Labels["severity"])
	assert.Contains(t, down.Annotations["description"], "in the last minute, for 30s")
	assert.Equal(t, "1m", before["TallyWebhookDown"].For)
	assert.Contains(t, before["TallyWebhookDown"].Annotations["description"], "in the last minute, for 1m")

	assert.Empty(t, after["TallyPodsHeldByFinalizer"].For, "for 0m: no for")
	assert.Equal(t, before["TallyPodsHeldByFinalizer"].Expr, after["TallyPodsHeldByFinalizer"].Expr)
	for name, r := range after {
		if name != "TallyWebhookDown" && name != "TallyPodsHeldByFinalizer" {
			assert.Equal(t, before[name], r, name)
		}
	}
}

// TestDashboard: the dashboard parses, every panel but the rows has
// queries that read tally's metrics, and the chart's ConfigMap carries the
// dashboard as it is in the repository. test/alerts has promtool parse
// every query; test/install checks the binaries export each metric it
// reads.
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

	for title, exprs := range queries {
		for _, expr := range exprs {
			assert.NotEmpty(t, framework.MetricNames(expr), "panel %q reads no tally metric: %s", title, expr)
		}
	}

	var cm corev1.ConfigMap
	require.True(t, find(t, objects(t, render(t, "monitoring.yaml")), "ConfigMap", release+"-dashboard", &cm))
	assert.Equal(t, "monitoring", cm.Namespace)
	assert.Equal(t, "1", cm.Labels["grafana_dashboard"])
	want, err := os.ReadFile(framework.DashboardPath)
	require.NoError(t, err)
	assert.JSONEq(t, string(want), cm.Data["tally.json"])
}
