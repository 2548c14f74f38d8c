package aggregator

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/freshness"
)

// token returns a token of a new service account of ns, allowed to get
// /metrics when reader is set.
func token(t *testing.T, ns, name string, reader bool) string {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, env.Client.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}))
	if reader {
		role := &rbacv1.ClusterRole{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "metrics-reader-"},
			Rules:      []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}},
		}
		require.NoError(t, env.Client.Create(ctx, role))
		require.NoError(t, env.Client.Create(ctx, &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "metrics-reader-"},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: ns, Name: name}},
		}))
	}
	cs, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)
	tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

// TestSecureMetrics: with --metrics-secure only requesters allowed to get
// /metrics read the metrics.
func TestSecureMetrics(t *testing.T) {
	ns := newNamespace(t)
	port, err := process.FreePort()
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	startAggregator(t, []config.Parent{workerPools}, nil, func(o *app.Options) { o.MetricsAddr, o.MetricsSecure = addr, true })

	scrape := func(token string) int {
		req, err := http.NewRequest(http.MethodGet, "https://"+addr+"/metrics", nil)
		require.NoError(t, err)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // a self-signed serving certificate
		resp, err := c.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Eventually(t, func() bool { return scrape("") == http.StatusUnauthorized }, 30*time.Second, 100*time.Millisecond,
		"an anonymous scrape is not refused")
	require.Equal(t, http.StatusForbidden, scrape(token(t, ns, "stranger", false)))
	require.Equal(t, http.StatusOK, scrape(token(t, ns, "scraper", true)))
}

// TestMetricsServedAcrossManagers: the metrics endpoint is the process's,
// not a manager's. An aggregator whose pod reads are refused stalls, and
// starts manager after manager; every scrape meanwhile must be answered,
// and the pod view's staleness must keep growing across them. An endpoint
// that went with each manager would reset the TallyPodWatchStale alert at
// every restart, and it would never fire.
func TestMetricsServedAcrossManagers(t *testing.T) {
	port, err := process.FreePort()
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	restCfg, _ := recording("system:serviceaccount:nowhere:nobody")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- app.Run(ctx, &config.Config{Parents: []config.Parent{workerPools}}, restCfg,
			app.Options{MetricsAddr: addr, ProbeAddr: "0", MaxConcurrentReconciles: 1})
	}()
	defer func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("the aggregator did not stop within 30s of its context's end")
		}
	}()

	c := &http.Client{Timeout: 5 * time.Second}
	scrape := func() (restarts, stale float64, err error) {
		resp, err := c.Get("http://" + addr + "/metrics")
		if err != nil {
			return 0, 0, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return 0, 0, err
		}
		if resp.StatusCode != http.StatusOK {
			return 0, 0, fmt.Errorf("%s: %s", resp.Status, body)
		}
		restarts = sample(string(body), `tally_aggregator_manager_restarts_total{reason="stale_view"}`)
		stale = sample(string(body), "tally_aggregator_pod_watch_stale_seconds")
		return restarts, stale, nil
	}
	var first float64
	require.Eventually(t, func() bool {
		r, _, err := scrape()
		first = r
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "the metrics endpoint never answered")

	// Past the first stall (freshness.StallAfter of the API server
	// answering), through the back-off, and into the next manager.
	deadline := time.Now().Add(freshness.StallAfter + 30*time.Second)
	var restartedAt time.Time
	lastStale := 0.0
	for (restartedAt.IsZero() && time.Now().Before(deadline)) || (!restartedAt.IsZero() && time.Since(restartedAt) < 5*time.Second) {
		restarts, stale, err := scrape()
		require.NoError(t, err, "a scrape was not answered")
		require.GreaterOrEqual(t, stale, lastStale, "the pod view's staleness went back from %.1fs to %.1fs", lastStale, stale)
		lastStale = stale
		if restarts > first && restartedAt.IsZero() {
			restartedAt = time.Now()
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.False(t, restartedAt.IsZero(), "no manager was started again after a stall within %s", freshness.StallAfter+30*time.Second)
	require.Greater(t, lastStale, freshness.StallAfter.Seconds(), "the pod view's staleness did not outlast the stall")
}

// sample returns the value of the metric sample named name (with its
// labels, as exposed) in an exposition; 0 when absent.
func sample(exposition, name string) float64 {
	for line := range strings.Lines(exposition) {
		value, ok := strings.CutPrefix(strings.TrimSpace(line), name+" ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			return 0
		}
		return v
	}
	return 0
}

// TestMetricsAddressTaken: an aggregator that cannot serve its metrics
// (the address taken) stops with an error naming the address before it
// starts a manager, rather than running unwatched.
func TestMetricsAddressTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	restCfg, requests := recording("system:serviceaccount:nowhere:nobody")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = app.Run(ctx, &config.Config{Parents: []config.Parent{workerPools}}, restCfg,
		app.Options{MetricsAddr: ln.Addr().String(), ProbeAddr: "0", MaxConcurrentReconciles: 1})
	require.ErrorIs(t, err, syscall.EADDRINUSE)
	require.ErrorContains(t, err, "serving metrics on "+ln.Addr().String())
	// A manager's first requests are discovery's and its caches'; the
	// process's own check of the API server's version may have gone.
	require.Zero(t, requests.matching("/api"), "a manager started before the metrics endpoint failed")
}
