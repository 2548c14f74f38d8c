package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// scrapeSetup is what the Prometheus server needs besides the chart's
// ServiceMonitor: where it runs its discovery from and the credentials the
// ServiceMonitor's bearerTokenFile names inside a Prometheus pod.
type scrapeSetup struct {
	// Interval is the global scrape and rule evaluation interval.
	Interval time.Duration
	// Kubeconfig is what Kubernetes service discovery reads the cluster
	// with.
	Kubeconfig string
	// TokenFile holds the token of the ServiceAccount Prometheus scrapes
	// as: it stands for the bearerTokenFile of the ServiceMonitor.
	TokenFile string
	// RulesFile is where the PrometheusRule's groups are written.
	RulesFile string
}

// labelName is how Prometheus' service discovery turns a Kubernetes label
// into a label name.
var labelName = regexp.MustCompile(`[^a-zA-Z0-9_]`)

// prometheusConfig returns the Prometheus configuration the Prometheus
// Operator generates for serviceMonitor (as the API server returns it) and
// for the API server itself: Kubernetes service discovery of endpoint
// slices in the ServiceMonitor's namespace, kept when the Service matches
// its selector and the port its endpoint's name, with the target labels the
// Operator sets (namespace, service, pod, container, endpoint, job).
func prometheusConfig(serviceMonitor *unstructured.Unstructured, s scrapeSetup) ([]byte, error) {
	ns := serviceMonitor.GetNamespace()
	selector, _, err := unstructured.NestedStringMap(serviceMonitor.Object, "spec", "selector", "matchLabels")
	if err != nil || len(selector) == 0 {
		return nil, fmt.Errorf("ServiceMonitor %s/%s: no spec.selector.matchLabels (%v)", ns, serviceMonitor.GetName(), err)
	}
	endpoints, _, err := unstructured.NestedSlice(serviceMonitor.Object, "spec", "endpoints")
	if err != nil || len(endpoints) == 0 {
		return nil, fmt.Errorf("ServiceMonitor %s/%s: no spec.endpoints (%v)", ns, serviceMonitor.GetName(), err)
	}
	discovery := func(namespace string) []any {
		return []any{map[string]any{"role": "endpointslice", "kubeconfig_file": s.Kubeconfig,
			"namespaces": map[string]any{"names": []any{namespace}}}}
	}
	var jobs []any
	for i, e := range endpoints {
		ep, ok := e.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("ServiceMonitor %s/%s: endpoint %d is not an object", ns, serviceMonitor.GetName(), i)
		}
		port, _ := ep["port"].(string)
		if port == "" {
			return nil, fmt.Errorf("ServiceMonitor %s/%s: endpoint %d names no port", ns, serviceMonitor.GetName(), i)
		}
		var relabel []any
		for _, k := range slices.Sorted(maps.Keys(selector)) {
			name := labelName.ReplaceAllString(k, "_")
			relabel = append(relabel, map[string]any{"action": "keep",
				"source_labels": []any{"__meta_kubernetes_service_label_" + name, "__meta_kubernetes_service_labelpresent_" + name},
				"regex":         "(" + regexp.QuoteMeta(selector[k]) + ");true"})
		}
		relabel = append(relabel,
			map[string]any{"action": "keep", "source_labels": []any{"__meta_kubernetes_endpointslice_port_name"}, "regex": port},
			// The Operator leaves out pods that have finished.
			map[string]any{"action": "drop", "source_labels": []any{"__meta_kubernetes_pod_phase"}, "regex": "(Failed|Succeeded)"})
		for target, source := range map[string]string{"namespace": "__meta_kubernetes_namespace", "service": "__meta_kubernetes_service_name",
			"pod": "__meta_kubernetes_pod_name", "container": "__meta_kubernetes_pod_container_name", "job": "__meta_kubernetes_service_name"} {
			relabel = append(relabel, map[string]any{"source_labels": []any{source}, "target_label": target})
		}
		relabel = append(relabel, map[string]any{"target_label": "endpoint", "replacement": port})
		job := map[string]any{
			"job_name":              fmt.Sprintf("serviceMonitor/%s/%s/%d", ns, serviceMonitor.GetName(), i),
			"kubernetes_sd_configs": discovery(ns),
			"relabel_configs":       relabel,
		}
		if interval, _ := ep["interval"].(string); interval != "" {
			job["scrape_interval"] = interval
		}
		if scheme, _ := ep["scheme"].(string); scheme != "" {
			job["scheme"] = scheme
		}
		if file, _ := ep["bearerTokenFile"].(string); file != "" {
			job["authorization"] = map[string]any{"credentials_file": s.TokenFile}
		}
		if skip, _, _ := unstructured.NestedBool(ep, "tlsConfig", "insecureSkipVerify"); skip {
			job["tls_config"] = map[string]any{"insecure_skip_verify": true}
		}
		jobs = append(jobs, job)
	}
	// The API server, as kube-prometheus scrapes it: the kubernetes
	// Service's https port, with the same ServiceAccount's token.
	jobs = append(jobs, map[string]any{
		"job_name":              "apiserver",
		"scheme":                "https",
		"authorization":         map[string]any{"credentials_file": s.TokenFile},
		"tls_config":            map[string]any{"insecure_skip_verify": true},
		"kubernetes_sd_configs": discovery("default"),
		"relabel_configs": []any{
			map[string]any{"action": "keep", "source_labels": []any{"__meta_kubernetes_service_name", "__meta_kubernetes_endpointslice_port_name"}, "regex": "kubernetes;https"},
			map[string]any{"target_label": "job", "replacement": "apiserver"},
		},
	})
	return yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": s.Interval.String(), "evaluation_interval": s.Interval.String()},
		"rule_files":     []any{s.RulesFile},
		"scrape_configs": jobs,
	})
}

// ruleFile returns the rule file the Prometheus Operator writes for
// prometheusRule (as the API server returns it): its groups.
func ruleFile(prometheusRule *unstructured.Unstructured) ([]byte, error) {
	groups, _, err := unstructured.NestedSlice(prometheusRule.Object, "spec", "groups")
	if err != nil || len(groups) == 0 {
		return nil, fmt.Errorf("PrometheusRule %s/%s: no spec.groups (%v)", prometheusRule.GetNamespace(), prometheusRule.GetName(), err)
	}
	return yaml.Marshal(map[string]any{"groups": groups})
}

// prometheus is a Prometheus server run on the host.
type prometheus struct {
	url  string
	log  string
	cmd  *exec.Cmd
	done chan error
}

// startPrometheus runs the Prometheus binary with config in dir, its data
// and log there too, listening on a free local port.
func startPrometheus(binary, dir string, config []byte) (*prometheus, error) {
	configFile := filepath.Join(dir, "prometheus.yaml")
	if err := os.WriteFile(configFile, config, 0o600); err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.Close()
	logFile, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(binary, "--config.file", configFile, "--storage.tsdb.path", filepath.Join(dir, "data"),
		"--web.listen-address", addr, "--log.level", "info")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("starting prometheus: %w", err)
	}
	p := &prometheus{url: "http://" + addr, log: logFile.Name(), cmd: cmd, done: make(chan error, 1)}
	go func() {
		p.done <- cmd.Wait()
		logFile.Close()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		if err := p.get(ctx, "/-/ready", nil, nil); err == nil {
			return p, nil
		}
		select {
		case err := <-p.done:
			return nil, fmt.Errorf("prometheus exited: %v; its log: %s", err, p.tail())
		case <-ctx.Done():
			p.stop()
			return nil, fmt.Errorf("prometheus not ready within a minute; its log: %s", p.tail())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// stop ends the server.
func (p *prometheus) stop() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// tail returns the end of the server's log.
func (p *prometheus) tail() string {
	raw, _ := os.ReadFile(p.log)
	if len(raw) > 4000 {
		raw = raw[len(raw)-4000:]
	}
	return string(raw)
}

// get reads path from the server and fails unless it answers 200; under
// /api/, out receives the answer's data (JSON).
func (p *prometheus) get(ctx context.Context, path string, query url.Values, out any) error {
	u := p.url + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	if !strings.HasPrefix(path, "/api/") {
		return nil
	}
	var body struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	if body.Status != "success" {
		return fmt.Errorf("GET %s: %s", path, body.Error)
	}
	return json.Unmarshal(body.Data, out)
}

// target is one scrape target as the targets API shows it.
type target struct {
	Labels     map[string]string `json:"labels"`
	Health     string            `json:"health"`
	LastError  string            `json:"lastError"`
	LastScrape time.Time         `json:"lastScrape"`
}

// targets returns the active scrape targets.
func (p *prometheus) targets(ctx context.Context) ([]target, error) {
	var data struct {
		Active []target `json:"activeTargets"`
	}
	err := p.get(ctx, "/api/v1/targets", url.Values{"state": {"active"}}, &data)
	return data.Active, err
}

// ruleGroup is one rule group as the rules API shows it.
type ruleGroup struct {
	Name           string    `json:"name"`
	LastEvaluation time.Time `json:"lastEvaluation"`
	Rules          []struct {
		Name      string `json:"name"`
		Health    string `json:"health"`
		LastError string `json:"lastError"`
	} `json:"rules"`
}

// rules returns the alerting rule groups.
func (p *prometheus) rules(ctx context.Context) ([]ruleGroup, error) {
	var data struct {
		Groups []ruleGroup `json:"groups"`
	}
	err := p.get(ctx, "/api/v1/rules", url.Values{"type": {"alert"}}, &data)
	return data.Groups, err
}

// alerts returns the alerts pending or firing.
func (p *prometheus) alerts(ctx context.Context) ([]alert, error) {
	var data struct {
		Alerts []struct {
			Labels   map[string]string `json:"labels"`
			State    string            `json:"state"`
			ActiveAt time.Time         `json:"activeAt"`
		} `json:"alerts"`
	}
	if err := p.get(ctx, "/api/v1/alerts", nil, &data); err != nil {
		return nil, err
	}
	out := make([]alert, 0, len(data.Alerts))
	for _, a := range data.Alerts {
		out = append(out, alert{Name: a.Labels["alertname"], Severity: a.Labels["severity"], State: a.State,
			ActiveAt: a.ActiveAt, Labels: labelsString(a.Labels)})
	}
	return out, nil
}

// labelsString writes labels but alertname and severity as name="value",
// sorted.
func labelsString(labels map[string]string) string {
	var parts []string
	for k, v := range labels {
		if k != "alertname" && k != "severity" {
			parts = append(parts, fmt.Sprintf("%s=%q", k, v))
		}
	}
	slices.Sort(parts)
	return strings.Join(parts, ", ")
}
