package cluster

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

func TestTimeline(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	down := func(state string) alert {
		return alert{Name: "TallyWebhookDown", Severity: "critical", State: state, ActiveAt: at(10)}
	}
	slow := alert{Name: "TallyWebhookSlow", Severity: "warning", State: "pending", Labels: `pod="a"`, ActiveAt: at(20)}
	var tl timeline
	tl.add(at(0), nil)
	tl.add(at(10), []alert{down("pending")})
	tl.add(at(20), []alert{down("pending"), slow})
	tl.add(at(30), []alert{down("firing"), slow})
	tl.add(at(40), []alert{slow})
	tl.add(at(50), nil)

	assert.Equal(t, []transition{
		{At: at(10), Alert: "TallyWebhookDown{}", Severity: "critical", To: "pending"},
		{At: at(20), Alert: `TallyWebhookSlow{pod="a"}`, Severity: "warning", To: "pending"},
		{At: at(30), Alert: "TallyWebhookDown{}", Severity: "critical", From: "pending", To: "firing"},
		{At: at(40), Alert: "TallyWebhookDown{}", Severity: "critical", From: "firing"},
		{At: at(50), Alert: `TallyWebhookSlow{pod="a"}`, Severity: "warning", From: "pending"},
	}, tl.transitions())

	firing, a, ok := tl.first("TallyWebhookDown", "firing", at(0))
	require.True(t, ok)
	assert.Equal(t, at(30), firing)
	assert.Equal(t, at(10), a.ActiveAt)
	_, _, ok = tl.first("TallyWebhookDown", "firing", at(31))
	assert.False(t, ok, "not firing after 30 s")

	gone, ok := tl.gone("TallyWebhookDown", at(10))
	require.True(t, ok)
	assert.Equal(t, at(40), gone)
	gone, ok = tl.gone("TallyWebhookSlow", at(20))
	require.True(t, ok)
	assert.Equal(t, at(50), gone)

	assert.Equal(t, []alert{down("pending"), slow, down("firing")}, tl.seen(at(0), at(50), nil))
	assert.Equal(t, []alert{slow}, tl.seen(at(25), at(50), func(a alert) bool { return a.Severity == "warning" }))
	assert.Empty(t, tl.seen(at(45), at(50), nil))
}

func TestPrometheusConfig(t *testing.T) {
	var sm unstructured.Unstructured
	require.NoError(t, yaml.Unmarshal([]byte(`
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: tally, namespace: tally-system}
spec:
  selector:
    matchLabels: {app.kubernetes.io/instance: tally}
  endpoints:
    - port: metrics
      interval: 5s
      scheme: https
      bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
      tlsConfig: {insecureSkipVerify: true}
`), &sm.Object))
	raw, err := prometheusConfig(&sm, scrapeSetup{Interval: 5 * time.Second, Kubeconfig: "/k", TokenFile: "/token", RulesFile: "/rules.yaml"})
	require.NoError(t, err)
	var cfg struct {
		ScrapeConfigs []struct {
			JobName        string `json:"job_name"`
			ScrapeInterval string `json:"scrape_interval"`
			Scheme         string `json:"scheme"`
			Authorization  struct {
				CredentialsFile string `json:"credentials_file"`
			} `json:"authorization"`
			TLSConfig struct {
				InsecureSkipVerify bool `json:"insecure_skip_verify"`
			} `json:"tls_config"`
			RelabelConfigs []map[string]any `json:"relabel_configs"`
		} `json:"scrape_configs"`
		RuleFiles []string `json:"rule_files"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &cfg))
	require.Len(t, cfg.ScrapeConfigs, 2)
	sc := cfg.ScrapeConfigs[0]
	assert.Equal(t, "serviceMonitor/tally-system/tally/0", sc.JobName)
	assert.Equal(t, "5s", sc.ScrapeInterval)
	assert.Equal(t, "https", sc.Scheme)
	assert.Equal(t, "/token", sc.Authorization.CredentialsFile)
	assert.True(t, sc.TLSConfig.InsecureSkipVerify)
	assert.Contains(t, sc.RelabelConfigs, map[string]any{"action": "keep",
		"source_labels": []any{"__meta_kubernetes_service_label_app_kubernetes_io_instance", "__meta_kubernetes_service_labelpresent_app_kubernetes_io_instance"},
		"regex":         "(tally);true"})
	assert.Contains(t, sc.RelabelConfigs, map[string]any{"source_labels": []any{"__meta_kubernetes_service_name"}, "target_label": "service"})
	assert.Equal(t, "apiserver", cfg.ScrapeConfigs[1].JobName)
	assert.Equal(t, []string{"/rules.yaml"}, cfg.RuleFiles)

	unstructured.RemoveNestedField(sm.Object, "spec", "selector")
	_, err = prometheusConfig(&sm, scrapeSetup{})
	assert.ErrorContains(t, err, "ServiceMonitor tally-system/tally: no spec.selector.matchLabels")
}
