package cluster

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/utils/ptr"

	"tally.dev/tally/internal/helm"
)

// aggregatorMetrics are the series worth keeping when a scenario fails:
// what holds pods, what fences writes, who leads.
var aggregatorMetrics = []string{
	"tally_aggregator_held_pods", "tally_aggregator_oldest_held_pod_seconds", "tally_aggregator_tracking_",
	"tally_aggregator_pod_watch_stale_seconds", "tally_aggregator_applies_fenced_total", "tally_aggregator_apply_errors_total",
	"tally_aggregator_manager_restarts_total", "tally_aggregator_parent_kind_problems", "leader_election_master_status",
}

// keepAggregatorsOnFailure logs, if t fails, what the aggregators knew:
// the lease and its holder, each replica's log (the previous container's
// too, after a restart) and its metrics about held pods, fencing and
// leadership.
func keepAggregatorsOnFailure(t *testing.T, cfg *rest.Config) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Logf("keeping the aggregators' state: %v", err)
			return
		}
		lease, err := cs.CoordinationV1().Leases(helm.Namespace).Get(ctx, helm.Release+"-aggregator", metav1.GetOptions{})
		if err != nil {
			t.Logf("the aggregators' lease: %v", err)
		} else {
			t.Logf("the aggregators' lease: %s", describeLease(lease))
		}
		pods, err := cs.CoreV1().Pods(helm.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=aggregator"})
		if err != nil {
			t.Logf("listing the aggregators: %v", err)
			return
		}
		token, err := metricsToken(ctx, cs)
		if err != nil {
			t.Logf("a token to read the aggregators' metrics: %v", err)
		}
		for _, p := range pods.Items {
			t.Logf("aggregator %s on %s, phase %s, deleting %t", p.Name, p.Spec.NodeName, p.Status.Phase, p.DeletionTimestamp != nil)
			for _, previous := range []bool{true, false} {
				raw, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Previous: previous, TailLines: ptr.To[int64](400)}).DoRaw(ctx)
				switch {
				case err != nil && previous:
				case err != nil:
					t.Logf("log of %s: %v", p.Name, err)
				default:
					t.Logf("log of %s (previous container: %t), last 400 lines:\n%s", p.Name, previous, raw)
				}
			}
			if token == "" || p.Status.Phase != corev1.PodRunning {
				continue
			}
			metrics, err := scrape(ctx, cfg, cs, p, token)
			if err != nil {
				t.Logf("metrics of %s: %v", p.Name, err)
				continue
			}
			t.Logf("metrics of %s:\n%s", p.Name, metrics)
		}
	})
}

func describeLease(l *coordinationv1.Lease) string {
	at := func(t *metav1.MicroTime) string {
		if t == nil {
			return "never"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	return fmt.Sprintf("holder %s, acquired %s, renewed %s, transitions %d", ptr.Deref(l.Spec.HolderIdentity, "none"),
		at(l.Spec.AcquireTime), at(l.Spec.RenewTime), ptr.Deref(l.Spec.LeaseTransitions, 0))
}

// metricsToken returns a token of a ServiceAccount bound to the chart's
// metrics reader role, creating both when missing.
func metricsToken(ctx context.Context, cs *kubernetes.Clientset) (string, error) {
	const name = "e2e-metrics-reader"
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: helm.Namespace}}
	if _, err := cs.CoreV1().ServiceAccounts(helm.Namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", err
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: helm.Release + "-metrics-reader"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: helm.Namespace}},
	}
	if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", err
	}
	tr, err := cs.CoreV1().ServiceAccounts(helm.Namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](600)}}, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return tr.Status.Token, nil
}

// scrape reads pod's metrics through a port-forward (the chart's network
// policy admits only Prometheus to the metrics port) and returns the
// series of aggregatorMetrics.
func scrape(ctx context.Context, cfg *rest.Config, cs *kubernetes.Clientset, pod corev1.Pod, token string) (string, error) {
	transport, upgrader, err := spdy.RoundTripperFor(cfg)
	if err != nil {
		return "", err
	}
	u := cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(pod.Namespace).Name(pod.Name).SubResource("portforward").URL()
	dialer := spdy.NewDialer(upgrader, &http.Client{Transport: transport}, http.MethodPost, u)
	stop, ready := make(chan struct{}), make(chan struct{})
	defer close(stop)
	fw, err := portforward.NewOnAddresses(dialer, []string{"127.0.0.1"}, []string{"0:8080"}, stop, ready, io.Discard, io.Discard)
	if err != nil {
		return "", err
	}
	errs := make(chan error, 1)
	go func() { errs <- fw.ForwardPorts() }()
	select {
	case <-ready:
	case err := <-errs:
		return "", err
	case <-time.After(10 * time.Second):
		return "", fmt.Errorf("port-forward not ready within 10s")
	}
	ports, err := fw.GetPorts()
	if err != nil || len(ports) == 0 {
		return "", fmt.Errorf("no forwarded port: %v", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d/metrics", ports[0].Local), nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	// The serving certificate is the aggregator's own, self-signed.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, body)
	}
	var kept []string
	for line := range strings.Lines(string(body)) {
		for _, prefix := range aggregatorMetrics {
			if strings.HasPrefix(line, prefix) {
				kept = append(kept, strings.TrimSpace(line))
				break
			}
		}
	}
	return strings.Join(kept, "\n"), nil
}
