package aggregator

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
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
