// Package hostile attacks bin/webhook over TLS the way a client without
// credentials can: connections that send their headers slowly and never
// finish, and requests that announce a large body and never send it, while
// a well-behaved client keeps sending admissions. The webhook must close the
// attackers' connections, keep its memory bounded and keep answering.
package hostile

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) { os.Exit(framework.Main(m, framework.Options{}, &env)) }

// review is a CREATE AdmissionReview of a tracked pod of about 2 KiB.
func review(i int) []byte {
	env := strings.Repeat(`{"name":"SETTING","value":"a-value-of-some-length"},`, 20)
	return fmt.Appendf(nil, `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"req-%d",
"kind":{"group":"","version":"v1","kind":"Pod"},"resource":{"group":"","version":"v1","resource":"pods"},
"namespace":"ns","operation":"CREATE","userInfo":{"username":"operator"},
"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p-%d","namespace":"ns","ownerReferences":[{"apiVersion":"example.tally.dev/v1","kind":"WorkerPool","name":"pool","uid":"u-1","controller":true}]},
"spec":{"containers":[{"name":"w","image":"worker:1","env":[%s{"name":"LAST","value":"x"}]}]}}}}`, i, i, env)
}

func rssBytes(t *testing.T, pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for line := range strings.Lines(string(data)) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

func TestSlowClientsCannotTakeTheWebhookDown(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("needs /proc to read the webhook's memory")
	}
	dir := t.TempDir()
	require.NoError(t, framework.BuildBinaries(dir, "webhook"))
	ca, err := devcert.NewCA("tally hostile CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	require.NoError(t, pair.WriteDir(dir))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "config.yaml"), []byte("parents:\n  - {group: example.tally.dev, version: v1, kind: WorkerPool}\n"), 0o600))
	admin, err := env.AddUser(envtest.User{Name: "hostile-admin", Groups: []string{"system:masters"}}, nil)
	require.NoError(t, err)
	kubeconfig, err := admin.KubeConfig()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "kubeconfig"), kubeconfig, 0o600))
	port, err := framework.FreePort()
	require.NoError(t, err)
	probe, err := framework.FreePort()
	require.NoError(t, err)
	wh, err := process.Start("webhook", filepath.Join(dir, "webhook"), dir,
		"--config", filepath.Join(dir, "config.yaml"), "--kubeconfig", filepath.Join(dir, "kubeconfig"), "--cert-dir", dir,
		"--host", "127.0.0.1", "--port", strconv.Itoa(port), "--metrics-bind-address", "0",
		"--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", probe), "--shutdown-delay", "0s")
	require.NoError(t, err)
	t.Cleanup(func() { _ = wh.Stop() })
	require.NoError(t, wh.WaitReady(context.Background(), fmt.Sprintf("http://127.0.0.1:%d/readyz", probe)))
	idle := rssBytes(t, wh.Pid())

	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.CertPEM)
	tlsConfig := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	ctx, stop := context.WithTimeout(context.Background(), 40*time.Second)
	defer stop()

	// Attackers: each reports when the server closed its connection.
	var attackers sync.WaitGroup
	var slowClosed, stallClosed atomic.Int32
	attack := func(closed *atomic.Int32, send func(net.Conn) error) {
		attackers.Go(func() {
			c, err := tls.Dial("tcp", addr, tlsConfig)
			if err != nil {
				return
			}
			defer c.Close()
			go func() { <-ctx.Done(); c.Close() }()
			if send(c) != nil {
				closed.Add(1)
				return
			}
			if _, err := bufio.NewReader(c).ReadByte(); err != nil || ctx.Err() == nil {
				closed.Add(1)
			}
		})
	}
	start := time.Now()
	for range 200 {
		attack(&slowClosed, func(c net.Conn) error { // headers, one byte a second, never done
			if _, err := c.Write([]byte("POST /mutate-pods HTTP/1.1\r\nHost: x\r\nX-Slow: ")); err != nil {
				return err
			}
			for ctx.Err() == nil {
				if _, err := c.Write([]byte("a")); err != nil {
					return err
				}
				time.Sleep(time.Second)
			}
			return nil
		})
	}
	for range 20 {
		attack(&stallClosed, func(c net.Conn) error { // a 6 MiB body announced, none sent
			_, err := fmt.Fprintf(c, "POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", 6<<20)
			return err
		})
	}

	// A well-behaved client, as the API server: kept-alive connections.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsConfig}}
	var latencies []time.Duration
	var peak int64
	failures := 0
	for i := 0; time.Since(start) < 20*time.Second; i++ {
		begin := time.Now()
		resp, err := client.Post("https://"+addr+"/mutate-pods", "application/json", bytes.NewReader(review(i)))
		if err != nil {
			failures++
			continue
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			failures++
		}
		latencies = append(latencies, time.Since(begin))
		peak = max(peak, rssBytes(t, wh.Pid()))
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	attackers.Wait()

	slices.Sort(latencies)
	p50, p99 := latencies[len(latencies)/2], latencies[len(latencies)*99/100]
	t.Logf("under attack: %d admissions, %d failed, p50 %s, p99 %s; RSS idle %d MiB, peak %d MiB; slow-header connections closed by the server %d/200, stalled bodies %d/20",
		len(latencies), failures, p50, p99, idle>>20, peak>>20, slowClosed.Load(), stallClosed.Load())
	assert.Zero(t, failures)
	assert.Less(t, peak, int64(128<<20), "RSS peak")
	assert.Equal(t, int32(200), slowClosed.Load(), "connections that never finish their headers are closed")
	assert.Equal(t, int32(20), stallClosed.Load(), "connections that never send their body are closed")
	// Not a performance target (the machine is shared): a webhook that
	// answers within a second is not taken down.
	assert.Less(t, p99, time.Second)
}
