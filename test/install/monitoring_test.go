package install

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/test/framework"
)

// scrape returns what the metrics endpoint at addr serves.
func scrape(t *testing.T, addr string) string {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// assertMonitoringReadsExportedMetrics checks the chart's dashboard and
// alerts against what the running binaries (and the API server) export
// after a demo run: every tally and leader election metric they read is
// served, and the lease's series carries the name the alert selects.
func assertMonitoringReadsExportedMetrics(t *testing.T, ctx context.Context, tally string) {
	t.Helper()
	cs, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)
	apiserver, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	require.NoError(t, err)
	exported := framework.ExposedMetrics(tally)
	fromAPIServer := framework.ExposedMetrics(string(apiserver))

	check := func(what, expr string) {
		for _, name := range framework.MetricNames(expr) {
			if strings.HasPrefix(name, "apiserver_") {
				// The API server creates its admission webhook series on
				// their first event; the demo's calls may not fail.
				if !fromAPIServer[name] {
					t.Logf("%s reads %s, which the API server has not exported in this run", what, name)
				}
				continue
			}
			assert.True(t, exported[name], "%s reads %s, which neither binary exports", what, name)
		}
	}
	d, err := framework.ReadDashboard()
	require.NoError(t, err)
	for title, exprs := range d.Queries() {
		for _, expr := range exprs {
			check("dashboard panel "+title, expr)
		}
	}
	groups, err := framework.AlertRules()
	require.NoError(t, err)
	for _, g := range groups {
		for _, r := range g.Rules {
			check("alert "+r.Alert, r.Expr)
		}
	}
	assert.Contains(t, tally, `leader_election_master_status{name="`+release+`-aggregator"} 1`,
		"TallyAggregatorNoLeader selects the lease by name")
}
