package cluster

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// The alert scenarios' settings: scrapes and rule evaluations every 5 s,
// thresholds lowered so that a fault shows within a minute or two, and the
// for of the two alerts whose for is longest of those the faults fire (5m
// each) lowered to 1m.
const (
	alertsNS       = "alerts"
	monitoringNS   = "monitoring"
	scraperName    = "prometheus"
	scrapeInterval = 5 * time.Second
	samplePeriod   = 2 * time.Second
	// discoveryBatch is how long Prometheus' discovery manager may hold a
	// change of targets (a pod gone) before the scrapers see it.
	discoveryBatch  = 5 * time.Second
	healthyFor      = 10 * time.Minute
	trackingGrace   = 20 * time.Second
	heldPodSeconds  = 40
	watchStaleAfter = 20
	// unservableAfter is above the minute within which the aggregator
	// checks a kind again: the healthy install's CRD comes 10 s in.
	unservableAfter = 90
)

// alertValues are the chart values of the alert scenarios.
func alertValues() map[string]any {
	return map[string]any{
		"aggregator": map[string]any{"trackingGrace": trackingGrace.String()},
		"metrics": map[string]any{
			"reader":         map[string]any{"name": scraperName, "namespace": monitoringNS},
			"serviceMonitor": map[string]any{"enabled": true, "interval": scrapeInterval.String()},
			"prometheusRule": map[string]any{
				"enabled":    true,
				"thresholds": map[string]any{"podWatchStaleSeconds": watchStaleAfter, "heldPodSeconds": heldPodSeconds, "unservableSeconds": unservableAfter},
				"overrides": map[string]any{
					"TallyParentKindUnservable": map[string]any{"for": "1m"},
					"TallyPodsHeldByFinalizer":  map[string]any{"for": "1m"},
				},
			},
		},
	}
}

// alertSuite is the cluster, the Prometheus server watching it and the
// timeline of its alerts.
type alertSuite struct {
	c        client.Client
	cs       *kubernetes.Clientset
	dir      string
	cluster  *demo.Cluster
	prom     *prometheus
	timeline *timeline
	rows     []string
}

// TestAlertsOnRealPrometheus installs the chart with its ServiceMonitor and
// PrometheusRule, runs a Prometheus server configured from them as the
// Prometheus Operator would be, and watches its alerts: none pending or
// firing through ten healthy minutes (the parent kind's CRD applied after
// tally, 10 s into the window; a rollout of both Deployments), then, one
// fault at a time, the alert that names the fault fires within its for plus
// two scrape intervals (and a rule evaluation, discovery's batching of
// target changes and a sample) of its condition holding, no other critical
// alert fires, and it resolves once the fault is removed.
func TestAlertsOnRealPrometheus(t *testing.T) {
	dir := os.Getenv("TALLY_CLUSTER_DIR")
	if dir == "" {
		t.Skip("TALLY_CLUSTER_DIR is not set: run make e2e-cluster (root, Linux)")
	}
	binary := framework.Tool(t, "PROMETHEUS", "e2e-cluster")
	crds := framework.Tool(t, "PROMETHEUS_OPERATOR_CRDS", "e2e-cluster")
	ctx := context.Background()
	kubeconfig, _, c, cs := connect(t, dir)
	s := &alertSuite{c: c, cs: cs, dir: dir, timeline: &timeline{}}

	// The Prometheus Operator's CRDs, so that the chart creates its
	// ServiceMonitor and PrometheusRule for real, and the scraper's
	// ServiceAccount, which metrics.reader binds to the metrics reader.
	files, err := filepath.Glob(filepath.Join(crds, "*.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, files, "no CRD in %s", crds)
	for _, f := range files {
		s.apply(ctx, t, f)
	}
	require.True(t, poll(time.Minute, func() bool {
		list := &unstructured.UnstructuredList{}
		list.SetGroupVersionKind(monitoringGVK("ServiceMonitorList"))
		return c.List(ctx, list) == nil
	}), "the ServiceMonitor CRD was not served within a minute")
	for _, o := range []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: monitoringNS}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: monitoringNS, Name: scraperName}},
	} {
		require.NoError(t, c.Create(ctx, o))
	}
	work := t.TempDir()
	token, err := cs.CoreV1().ServiceAccounts(monitoringNS).CreateToken(ctx, scraperName,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3 * 3600)}}, metav1.CreateOptions{})
	require.NoError(t, err)
	tokenFile := filepath.Join(work, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(token.Status.Token), 0o600))

	// tally first: the parent kind's CRD comes later.
	values, err := demo.WriteClusterValues(work, nil, alertValues())
	require.NoError(t, err)
	s.cluster = &demo.Cluster{Kubeconfig: kubeconfig, Client: c, Values: values,
		OperatorImage: demo.OperatorImage, WorkerImage: demo.WorkerImage}
	t.Cleanup(func() { s.cleanup(t) })
	require.NoError(t, s.cluster.InstallChart())

	// Prometheus, configured from what the API server holds.
	sm := &unstructured.Unstructured{}
	sm.SetGroupVersionKind(monitoringGVK("ServiceMonitor"))
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release}, sm))
	rule := &unstructured.Unstructured{}
	rule.SetGroupVersionKind(monitoringGVK("PrometheusRule"))
	require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: helm.Namespace, Name: helm.Release}, rule))
	rules, err := ruleFile(rule)
	require.NoError(t, err)
	rulesFile := filepath.Join(work, "rules.yaml")
	require.NoError(t, os.WriteFile(rulesFile, rules, 0o600))
	promCfg, err := prometheusConfig(sm, scrapeSetup{Interval: scrapeInterval, Kubeconfig: kubeconfig, TokenFile: tokenFile, RulesFile: rulesFile})
	require.NoError(t, err)
	s.prom, err = startPrometheus(binary, work, promCfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("prometheus' log (end):\n%s", s.prom.tail())
		}
		s.prom.stop()
	})
	stopRecording := s.record(t)
	defer stopRecording()

	start := s.scraped(ctx, t)
	t.Run("healthy for 10 minutes: no alert pending or firing", func(t *testing.T) {
		s.healthy(ctx, t, start)
	})
	s.rows = append(s.rows,
		"| fault | alert (severity, for) | fault in effect | pending | firing | fault removed | resolved | other alerts seen meanwhile |",
		"|---|---|---|---|---|---|---|---|")
	flood := s.memoryFlood(ctx, t)
	// Both alerts look for a sign of life over the last minute: their
	// condition holds a minute after the last pod is gone.
	for _, down := range []struct{ component, alert string }{{"aggregator", "TallyAggregatorNoLeader"}, {"webhook", "TallyWebhookDown"}} {
		t.Run(down.component+" scaled to 0", func(t *testing.T) {
			s.fault(t, fault{name: down.component + " scaled to 0", alert: down.alert, severity: "critical", for_: time.Minute,
				apply: func() time.Time {
					s.scale(ctx, t, down.component, 0)
					return time.Now().Add(time.Minute)
				},
				remove: func() { s.scale(ctx, t, down.component, 2) }})
		})
	}
	t.Run("finished pod held: the aggregator may not patch pods", func(t *testing.T) {
		var restore func()
		s.fault(t, fault{name: "a finished pod held: the aggregator's permission to patch pods revoked", alert: "TallyPodsHeldByFinalizer", severity: "critical", for_: time.Minute,
			apply: func() time.Time {
				restore = s.revokePods(ctx, t, "patch")
				require.NoError(t, c.Patch(ctx, operator.Pool(alertsNS, "a", 0), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"replicas":1}}`))))
				var finished time.Time
				require.True(t, poll(2*time.Minute, func() bool {
					var pods corev1.PodList
					if c.List(ctx, &pods, client.InNamespace(alertsNS)) != nil {
						return false
					}
					for _, p := range pods.Items {
						if (p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed) && slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
							finished = time.Now()
							t.Logf("pod %s finished (%s), held by %s", p.Name, p.Status.Phase, keys.TrackingFinalizer)
							return true
						}
					}
					return false
				}), "no pod of pool a finished with the tracking finalizer after the scale-down")
				return finished.Add(heldPodSeconds * time.Second)
			},
			remove: func() { restore() }})
	})
	t.Run("pod watch broken: the aggregator may not list or watch pods, and its watch ends", func(t *testing.T) {
		var restore func()
		s.fault(t, fault{name: "pod watch broken: the aggregator's permission to list and watch pods revoked, kube-apiserver restarted", alert: "TallyPodWatchStale", severity: "critical", for_: time.Minute,
			// Both replicas' watches are broken: a leader whose pod view is
			// stale gives the lease up for a replica with a fresh one, and
			// a manager whose caches cannot sync does not run for it, so no
			// replica leads, which is what NoLeader says.
			alsoTrue: []string{"TallyAggregatorNoLeader"},
			apply: func() time.Time {
				restore = s.revokePods(ctx, t, "get", "list", "watch", "patch")
				// kube-apiserver ends its watches during its graceful
				// shutdown, seconds after it is told to stop: by the time
				// it answers again the pod watch has ended.
				s.outage(t, "3s")
				return time.Now().Add(watchStaleAfter * time.Second)
			},
			remove: func() { restore() }})
	})
	t.Run("a parent kind without a status subresource", func(t *testing.T) {
		s.fault(t, fault{name: "a parent kind mapped whose CRD has no status subresource (helm upgrade)", alert: "TallyParentKindUnservable", severity: "warning", for_: time.Minute,
			apply:  func() time.Time { return s.unservableKind(ctx, t, work).Add(unservableAfter * time.Second) },
			remove: func() { s.addStatusSubresource(ctx, t) }})
	})
	t.Run("a flood refused for memory: the alert resolves", func(t *testing.T) {
		s.resolved(t, flood)
	})
	t.Logf("alert timeline (scrape and evaluation every %s, alerts sampled every %s):\n%s", scrapeInterval, samplePeriod, strings.Join(s.rows, "\n"))
	var lines []string
	for _, tr := range s.timeline.transitions() {
		lines = append(lines, tr.String())
	}
	t.Logf("every alert state change:\n  %s", strings.Join(lines, "\n  "))
}

// monitoringGVK is a kind of the Prometheus Operator's API.
func monitoringGVK(kind string) schema.GroupVersionKind {
	return schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: kind}
}

// apply applies the objects of a manifest file with server-side apply.
func (s *alertSuite) apply(ctx context.Context, t *testing.T, file string) {
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	objs, err := helm.Objects(string(raw))
	require.NoError(t, err)
	for _, o := range objs {
		require.NoError(t, s.c.Apply(ctx, client.ApplyConfigurationFromUnstructured(o), client.FieldOwner("tally-e2e"), client.ForceOwnership), "applying %s", file)
	}
}

// record samples Prometheus' alerts into the timeline until the returned
// func is called.
func (s *alertSuite) record(t *testing.T) func() {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			actx, done := context.WithTimeout(ctx, samplePeriod)
			alerts, err := s.prom.alerts(actx)
			done()
			if err == nil {
				s.timeline.add(time.Now(), alerts)
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(samplePeriod):
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
	}
}

// scraped waits until Prometheus scrapes every replica of both components
// and the API server, through secure metrics and the metrics reader's
// binding, has evaluated the rules since, and shows no alert pending or
// firing: the start of the healthy window. (Before the first scrapes, the
// alerts that look for a sign of life find none and go pending; they are
// inactive again at an evaluation or two after them.)
func (s *alertSuite) scraped(ctx context.Context, t *testing.T) time.Time {
	var last string
	ok := poll(2*time.Minute, func() bool {
		targets, err := s.prom.targets(ctx)
		if err != nil {
			last = err.Error()
			return false
		}
		up := map[string]int{}
		var down []string
		for _, tg := range targets {
			if tg.Health == "up" {
				up[tg.Labels["job"]]++
			} else {
				down = append(down, fmt.Sprintf("%s %s: %s %s", tg.Labels["job"], tg.Labels["pod"], tg.Health, tg.LastError))
			}
		}
		last = fmt.Sprintf("up by job %v; not up: %v", up, down)
		return len(down) == 0 && up[helm.Release+"-webhook"] == 2 && up[helm.Release+"-aggregator-metrics"] == 2 && up["apiserver"] == 1
	})
	require.True(t, ok, "Prometheus does not scrape tally and the API server: %s", last)
	allUp := time.Now()
	t.Logf("Prometheus scrapes every target: %s", last)
	ok = poll(time.Minute, func() bool {
		groups, err := s.prom.rules(ctx)
		return err == nil && len(groups) == 1 && groups[0].LastEvaluation.After(allUp)
	})
	require.True(t, ok, "the rules were not evaluated after the first scrapes")
	var active []alert
	ok = poll(time.Minute, func() bool {
		alerts, err := s.prom.alerts(ctx)
		active = alerts
		return err == nil && len(alerts) == 0
	})
	require.True(t, ok, "alerts still pending or firing a minute after the first scrapes and their evaluation:\n  %s", describe(active))
	t.Logf("no alert pending or firing %s after every target was up", time.Since(allUp).Round(time.Second))
	return time.Now()
}

// healthy runs ten minutes of a healthy install from start: the WorkerPool
// CRD applied 10 s in, the operator and two pools, a scale-down (pods
// completed and counted in the totals) and a pod deleted, a rollout of both
// Deployments; no alert may be pending or firing meanwhile, and every rule
// evaluates without error.
func (s *alertSuite) healthy(ctx context.Context, t *testing.T, start time.Time) {
	c := s.c
	time.Sleep(time.Until(start.Add(10 * time.Second)))
	require.NoError(t, s.cluster.ApplyCRD(ctx))
	require.NoError(t, s.cluster.InstallOperator(ctx))
	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: alertsNS}}))
	for _, p := range []string{"a", "b"} {
		require.NoError(t, c.Create(ctx, operator.Pool(alertsNS, p, 3)))
	}
	settled := func(pools ...string) bool {
		for _, p := range pools {
			if ok, _, err := snapshotIn(ctx, c, alertsNS, p); err != nil || !ok {
				return false
			}
		}
		return true
	}
	require.True(t, poll(3*time.Minute, func() bool { return settled("a", "b") }), "the pools did not settle")
	t.Logf("%s: the CRD, the operator and two pools of 3, settled", time.Since(start).Round(time.Second))

	time.Sleep(time.Until(start.Add(3 * time.Minute)))
	require.NoError(t, c.Patch(ctx, operator.Pool(alertsNS, "a", 0), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"replicas":3}}`))))
	var pods corev1.PodList
	require.NoError(t, c.List(ctx, &pods, client.InNamespace(alertsNS)))
	for _, p := range pods.Items {
		if strings.HasPrefix(p.Name, "b-") && p.Status.Phase == corev1.PodRunning {
			require.NoError(t, c.Delete(ctx, &p))
			break
		}
	}
	require.NoError(t, c.Patch(ctx, operator.Pool(alertsNS, "a", 0), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"replicas":2}}`))))
	require.True(t, poll(3*time.Minute, func() bool { return settled("a", "b") }), "the pools did not settle after a scale-down and a deletion")
	t.Logf("%s: pool a scaled 3 -> 2, a pod of b deleted, settled", time.Since(start).Round(time.Second))

	// A tally.dev/ key on tally's own pods: the registration leaves the
	// release namespace out, so they start again later while the webhook
	// is scaled to zero.
	time.Sleep(time.Until(start.Add(4 * time.Minute)))
	restart := fmt.Appendf(nil, `{"spec":{"template":{"metadata":{"annotations":{"tally.dev/restarted-at":%q}}}}}`, time.Now().Format(time.RFC3339))
	for _, d := range []string{"webhook", "aggregator"} {
		require.NoError(t, c.Patch(ctx, deployment(d), client.RawPatch(types.StrategicMergePatchType, restart)))
	}
	for _, d := range []string{"webhook", "aggregator"} {
		require.NoError(t, demo.WaitDeploymentReady(ctx, c, helm.Namespace, helm.Release+"-"+d, 3*time.Minute))
	}
	t.Logf("%s: both Deployments rolled out", time.Since(start).Round(time.Second))

	end := start.Add(healthyFor)
	time.Sleep(time.Until(end))
	groups, err := s.prom.rules(ctx)
	require.NoError(t, err)
	for _, g := range groups {
		for _, r := range g.Rules {
			assert.Equal(t, "ok", r.Health, "rule %s: %s", r.Name, r.LastError)
		}
	}
	seen := s.timeline.seen(start, end, nil)
	assert.Empty(t, seen, "alerts pending or firing on a healthy install:\n  %s", describe(seen))
	s.rows = append(s.rows, fmt.Sprintf("healthy install, %s from %s (CRD 10 s in, a scale-down, a pod deleted, both Deployments rolled at 4 min): %d alerts pending or firing",
		healthyFor, start.Format("15:04:05"), len(seen)), "")
}

// fault is one fault an alert names.
type fault struct {
	name, alert, severity string
	for_                  time.Duration
	// apply breaks the install and returns when the alert's condition
	// holds (for a threshold, when it is crossed).
	apply func() time.Time
	// remove repairs it.
	remove func()
	// alsoTrue are critical alerts the fault makes true as well, which may
	// fire beside its own.
	alsoTrue []string
}

// fault applies f, waits for its alert to fire (within its for, two scrape
// intervals, a rule evaluation, the batching of discovery updates and a
// sample from the moment its condition holds), removes it, waits for the
// alert to resolve, and checks that no other critical alert fired
// meanwhile. It adds a row to the timeline.
func (s *alertSuite) fault(t *testing.T, f fault) {
	start := time.Now()
	holds := f.apply()
	// Rules are evaluated at the scrape interval.
	bound := holds.Add(f.for_ + 2*scrapeInterval + scrapeInterval + discoveryBatch + samplePeriod)
	var firing time.Time
	var fired alert
	ok := poll(time.Until(bound)+time.Minute, func() bool {
		var seen bool
		firing, fired, seen = s.timeline.first(f.alert, "firing", start)
		return seen
	})
	if !ok {
		f.remove()
		require.Fail(t, "alert did not fire", "%s: %s not firing %s after the fault; seen: \n  %s", f.name, f.alert, time.Since(start).Round(time.Second),
			describe(s.timeline.seen(start, time.Now(), nil)))
	}
	assert.False(t, firing.After(bound), "%s fired at %s, after its bound %s (condition from %s + for %s + two scrapes, an evaluation, discovery's batching and a sample)",
		f.alert, firing.Format("15:04:05"), bound.Format("15:04:05"), holds.Format("15:04:05"), f.for_)
	removed := time.Now()
	f.remove()
	var resolved time.Time
	ok = poll(4*time.Minute, func() bool {
		var gone bool
		resolved, gone = s.timeline.gone(f.alert, removed)
		return gone
	})
	require.True(t, ok, "%s still pending or firing 4 minutes after the fault was removed", f.alert)
	at := func(tm time.Time) string { return fmt.Sprintf("+%ds", int(tm.Sub(start).Seconds())) }
	s.rows = append(s.rows, fmt.Sprintf("| %s | %s (%s, %s) | %s | %s | %s | %s | %s | %s |", f.name, f.alert, f.severity, f.for_,
		at(holds), at(fired.ActiveAt), at(firing), at(removed), at(resolved), s.others(t, f.name, f.alert, f.alsoTrue, start, resolved)))
}

// others checks that no critical alert but own and alsoTrue fired from
// from to to, and lists the alerts but own seen meanwhile, with their
// states.
func (s *alertSuite) others(t *testing.T, fault, own string, alsoTrue []string, from, to time.Time) string {
	var names []string
	for _, a := range s.timeline.seen(from, to, func(a alert) bool { return a.Name != own }) {
		if !slices.Contains(alsoTrue, a.Name) {
			assert.False(t, a.Severity == "critical" && a.State == "firing", "%s: another critical alert fired: %s", fault, describe([]alert{a}))
		}
		names = append(names, fmt.Sprintf("%s %s", a.Name, a.State))
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// flood is a memory flood that ended: when it began, when the webhook
// first refused a request, and when it ended.
type flood struct {
	start, refused, ended time.Time
}

// memoryFlood floods a webhook pod for 15 s with 40 clients announcing
// 6 MiB bodies and trickling them (the webhook refuses what its large
// bodies' memory cannot hold): TallyWebhookMemoryRefusals (warning, for 0m)
// must fire within two scrape intervals, an evaluation and a sample of the
// first refusal, and no critical alert. Its window is 10 minutes: s.resolved
// checks that it resolves after the other faults.
func (s *alertSuite) memoryFlood(ctx context.Context, t *testing.T) flood {
	var pods corev1.PodList
	require.NoError(t, s.c.List(ctx, &pods, client.InNamespace(helm.Namespace), client.MatchingLabels{"app.kubernetes.io/component": "webhook"}))
	require.NotEmpty(t, pods.Items)
	addr := net.JoinHostPort(pods.Items[0].Status.PodIP, "9443")
	f := flood{start: time.Now()}
	fctx, stop := context.WithTimeout(ctx, 15*time.Second)
	defer stop()
	//nolint:gosec // an attacker does not check the certificate
	sent := framework.LargeBodyFlood(fctx, addr, &tls.Config{InsecureSkipVerify: true}, 40)
	f.ended = time.Now()
	require.NotZero(t, sent.Refused, "the flood of %s was not refused for memory (%d requests)", addr, sent.Requests)
	f.refused = sent.FirstRefused
	t.Logf("flood of %s: %d of %d requests refused for memory, the first %s in", addr, sent.Refused, sent.Requests, f.refused.Sub(f.start).Round(time.Millisecond))
	bound := f.refused.Add(3*scrapeInterval + samplePeriod)
	var firing time.Time
	ok := poll(time.Until(bound)+time.Minute, func() bool {
		var seen bool
		firing, _, seen = s.timeline.first("TallyWebhookMemoryRefusals", "firing", f.start)
		return seen
	})
	require.True(t, ok, "TallyWebhookMemoryRefusals did not fire after the flood; seen:\n  %s", describe(s.timeline.seen(f.start, time.Now(), nil)))
	assert.False(t, firing.After(bound), "TallyWebhookMemoryRefusals fired at %s, after %s", firing.Format("15:04:05"), bound.Format("15:04:05"))
	name := fmt.Sprintf("memory flood of one webhook pod, 15 s (%d of %d requests refused)", sent.Refused, sent.Requests)
	at := func(tm time.Time) string { return fmt.Sprintf("+%ds", int(tm.Sub(f.start).Seconds())) }
	s.rows = append(s.rows, fmt.Sprintf("| %s | TallyWebhookMemoryRefusals (warning, 0m, over 10m) | %s | %s | %s | %s | (after the faults below) | %s |",
		name, at(f.refused), at(firing), at(firing), at(f.ended), s.others(t, name, "TallyWebhookMemoryRefusals", nil, f.start, time.Now())))
	return f
}

// resolved checks that the flood's alert resolved, its window (10
// minutes) after the last refusal.
func (s *alertSuite) resolved(t *testing.T, f flood) {
	ok := poll(time.Until(f.ended.Add(12*time.Minute)), func() bool {
		_, gone := s.timeline.gone("TallyWebhookMemoryRefusals", f.ended)
		return gone
	})
	require.True(t, ok, "TallyWebhookMemoryRefusals still firing 12 minutes after the flood")
	gone, _ := s.timeline.gone("TallyWebhookMemoryRefusals", f.ended)
	s.rows = append(s.rows, fmt.Sprintf("| memory flood: resolved | TallyWebhookMemoryRefusals | | | | | +%ds after the flood began | |", int(gone.Sub(f.start).Seconds())))
}

// deployment names one of the chart's Deployments.
func deployment(component string) *unstructured.Unstructured {
	d := &unstructured.Unstructured{}
	d.SetAPIVersion("apps/v1")
	d.SetKind("Deployment")
	d.SetNamespace(helm.Namespace)
	d.SetName(helm.Release + "-" + component)
	return d
}

// scale sets the replicas of a component's Deployment and waits until its
// pods are all gone (0) or ready.
func (s *alertSuite) scale(ctx context.Context, t *testing.T, component string, replicas int) {
	patch := fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, replicas)
	require.NoError(t, s.c.Patch(ctx, deployment(component), client.RawPatch(types.MergePatchType, patch)))
	if replicas > 0 {
		require.NoError(t, demo.WaitDeploymentReady(ctx, s.c, helm.Namespace, helm.Release+"-"+component, 3*time.Minute))
		return
	}
	ok := poll(2*time.Minute, func() bool {
		var pods corev1.PodList
		return s.c.List(ctx, &pods, client.InNamespace(helm.Namespace), client.MatchingLabels{"app.kubernetes.io/component": component}) == nil && len(pods.Items) == 0
	})
	require.True(t, ok, "%s pods still there 2 minutes after scaling to 0", component)
}

// revokePods takes verbs on pods from the aggregator's ClusterRole and
// returns what puts them back, which also runs when t ends.
func (s *alertSuite) revokePods(ctx context.Context, t *testing.T, verbs ...string) func() {
	var role rbacv1.ClusterRole
	key := client.ObjectKey{Name: helm.Release + "-aggregator"}
	require.NoError(t, s.c.Get(ctx, key, &role))
	saved := slices.Clone(role.Rules)
	var rules []rbacv1.PolicyRule
	for _, r := range role.Rules {
		if slices.Equal(r.APIGroups, []string{""}) && slices.Contains(r.Resources, "pods") {
			r = *r.DeepCopy()
			r.Verbs = slices.DeleteFunc(r.Verbs, func(v string) bool { return slices.Contains(verbs, v) })
			if len(r.Verbs) == 0 {
				continue
			}
		}
		rules = append(rules, r)
	}
	role.Rules = rules
	require.NoError(t, s.c.Update(ctx, &role))
	restore := sync.OnceFunc(func() {
		var role rbacv1.ClusterRole
		require.NoError(t, s.c.Get(ctx, key, &role))
		role.Rules = saved
		require.NoError(t, s.c.Update(ctx, &role))
	})
	// A fault that fails half-way leaves the next ones a whole role.
	t.Cleanup(restore)
	return restore
}

// outage stops kube-apiserver for d and starts it again.
func (s *alertSuite) outage(t *testing.T, d string) {
	bin := os.Getenv("TALLY_CLUSTER_BIN")
	if bin == "" {
		t.Skip("TALLY_CLUSTER_BIN is not set: run make e2e-cluster")
	}
	cmd := exec.Command(bin, "outage", "--dir", s.dir, "--for", d)
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	require.NoError(t, cmd.Run())
}

// brokenPool is a copy of the WorkerPool CRD, kind BrokenPool, without a
// status subresource.
func brokenPool(t *testing.T) *unstructured.Unstructured {
	raw, err := os.ReadFile(repo.Path("examples", "workerpool", "crd", "workerpools.yaml"))
	require.NoError(t, err)
	text := strings.NewReplacer("workerpools", "brokenpools", "WorkerPoolList", "BrokenPoolList", "WorkerPool", "BrokenPool", "workerpool", "brokenpool", "[wp]", "[bp]").Replace(string(raw))
	crd := &unstructured.Unstructured{}
	require.NoError(t, yaml.Unmarshal([]byte(text), &crd.Object))
	versions, _, err := unstructured.NestedSlice(crd.Object, "spec", "versions")
	require.NoError(t, err)
	for _, v := range versions {
		delete(v.(map[string]any), "subresources")
	}
	require.NoError(t, unstructured.SetNestedSlice(crd.Object, versions, "spec", "versions"))
	return crd
}

// unservableKind creates BrokenPool's CRD and maps it as a second parent
// kind (helm upgrade, both Deployments rolled); it returns when the
// upgrade's pods are ready, from when the aggregator reports the kind (the
// alert's condition holds unservableAfter later).
func (s *alertSuite) unservableKind(ctx context.Context, t *testing.T, work string) time.Time {
	require.NoError(t, s.c.Apply(ctx, client.ApplyConfigurationFromUnstructured(brokenPool(t)), client.FieldOwner("tally-e2e"), client.ForceOwnership))
	broken := helm.WorkerPool(config.Completing, config.Active)
	broken.Kind, broken.Resource = "BrokenPool", "brokenpools"
	dir := filepath.Join(work, "upgrade")
	require.NoError(t, os.MkdirAll(dir, 0o700))
	values, err := demo.WriteClusterParents(dir, []config.Parent{helm.WorkerPool(slices.Concat(config.Counts, config.Totals)...), broken}, alertValues())
	require.NoError(t, err)
	_, err = s.cluster.Helm("upgrade", helm.Release, helm.Chart(), "--namespace", helm.Namespace, "-f", values, "--wait", "--timeout", "3m")
	require.NoError(t, err)
	for _, d := range []string{"webhook", "aggregator"} {
		require.NoError(t, demo.WaitDeploymentReady(ctx, s.c, helm.Namespace, helm.Release+"-"+d, 3*time.Minute))
	}
	return time.Now()
}

// addStatusSubresource gives BrokenPool's CRD its status subresource.
func (s *alertSuite) addStatusSubresource(ctx context.Context, t *testing.T) {
	crd := brokenPool(t)
	versions, _, err := unstructured.NestedSlice(crd.Object, "spec", "versions")
	require.NoError(t, err)
	for _, v := range versions {
		v.(map[string]any)["subresources"] = map[string]any{"status": map[string]any{}}
	}
	require.NoError(t, unstructured.SetNestedSlice(crd.Object, versions, "spec", "versions"))
	require.NoError(t, s.c.Apply(ctx, client.ApplyConfigurationFromUnstructured(crd), client.FieldOwner("tally-e2e"), client.ForceOwnership))
}

// cleanup removes what the scenarios installed, so that the next test
// starts from the bare cluster: the pools, tally and the operator, the
// CRDs the scenarios added and the monitoring namespace.
func (s *alertSuite) cleanup(t *testing.T) {
	ctx := context.Background()
	gone := func(o client.Object) bool {
		err := s.c.Get(ctx, client.ObjectKeyFromObject(o), o)
		return apierrors.IsNotFound(err)
	}
	for _, name := range []string{alertsNS, monitoringNS} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		assert.NoError(t, client.IgnoreNotFound(s.c.Delete(ctx, ns)))
	}
	assert.NoError(t, s.cluster.Uninstall(ctx))
	for _, name := range []string{alertsNS, monitoringNS, demo.OperatorNamespace} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		assert.True(t, poll(3*time.Minute, func() bool { return gone(ns) }), "namespace %s not deleted within 3 minutes", name)
	}
	for _, name := range []string{"brokenpools.example.tally.dev", "servicemonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com"} {
		crd := &unstructured.Unstructured{}
		crd.SetAPIVersion("apiextensions.k8s.io/v1")
		crd.SetKind("CustomResourceDefinition")
		crd.SetName(name)
		assert.NoError(t, client.IgnoreNotFound(s.c.Delete(ctx, crd)))
	}
}
