package framework

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
)

// DashboardPath is the chart's Grafana dashboard.
var DashboardPath = repo.Path("charts", "tally", "files", "dashboards", "tally.json")

// Dashboard is the part of a Grafana dashboard the suites check.
type Dashboard struct {
	Title  string  `json:"title"`
	UID    string  `json:"uid"`
	Panels []Panel `json:"panels"`
}

// Panel is a dashboard panel (rows are panels without targets).
type Panel struct {
	Type    string `json:"type"`
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// ReadDashboard parses the chart's Grafana dashboard.
func ReadDashboard() (*Dashboard, error) {
	raw, err := os.ReadFile(DashboardPath)
	if err != nil {
		return nil, err
	}
	var d Dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("parsing %s: %w", DashboardPath, err)
	}
	return &d, nil
}

// Queries returns the dashboard's PromQL expressions with Grafana's
// variables replaced by what Prometheus accepts, by panel title.
func (d *Dashboard) Queries() map[string][]string {
	vars := strings.NewReplacer(`$namespace`, `.*`, `$__rate_interval`, `5m`)
	out := map[string][]string{}
	for _, p := range d.Panels {
		for _, t := range p.Targets {
			out[p.Title] = append(out[p.Title], vars.Replace(t.Expr))
		}
	}
	return out
}

// AlertRule is one alerting rule of the chart's PrometheusRule.
type AlertRule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for,omitempty"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

// RuleGroup is a group of a PrometheusRule, in Prometheus' rule file format.
type RuleGroup struct {
	Name  string      `json:"name"`
	Rules []AlertRule `json:"rules"`
}

// AlertRules renders the chart's PrometheusRule (release helm.Release in
// helm.Namespace) with the given --set values added, and returns its groups.
func AlertRules(set ...string) ([]RuleGroup, error) {
	args := []string{"template", helm.Release, helm.Chart(), "--namespace", helm.Namespace,
		"--set", "metrics.prometheusRule.enabled=true", "--show-only", "templates/prometheusrule.yaml"}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	out, err := helm.Run(args...)
	if err != nil {
		return nil, err
	}
	var rule struct {
		Spec struct {
			Groups []RuleGroup `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal([]byte(out), &rule); err != nil {
		return nil, fmt.Errorf("parsing the rendered PrometheusRule: %w", err)
	}
	return rule.Spec.Groups, nil
}

// metricName matches the metric names the dashboard and the alerts read:
// tally's, leader election's and the API server's.
var metricName = regexp.MustCompile(`\b(?:tally|leader_election|apiserver)_[a-zA-Z0-9_]+`)

// quoted matches PromQL's double-quoted strings (label values and regular
// expressions), which name no metric.
var quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// MetricNames returns the metric names expr reads, sorted and unique.
func MetricNames(expr string) []string {
	names := metricName.FindAllString(quoted.ReplaceAllString(expr, `""`), -1)
	slices.Sort(names)
	return slices.Compact(names)
}

// ExposedMetrics returns the names of the samples in a Prometheus text
// exposition (histograms' _bucket, _sum and _count included).
func ExposedMetrics(exposition string) map[string]bool {
	names := map[string]bool{}
	for line := range strings.Lines(exposition) {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
	}
	return names
}
