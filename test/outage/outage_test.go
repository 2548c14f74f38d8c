// Package outage cuts the aggregator off the API server (through a TCP proxy
// the test controls) and checks that the stale window is visible: the
// gauge tally_aggregator_pod_watch_stale_seconds grows while the pod watch
// is not delivering, a log line says so when it breaks and when it recovers,
// and the counts converge once the connection is back.
package outage

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env  *framework.Env
	logs syncBuffer
)

func TestMain(m *testing.M) {
	ctrl.SetLogger(zap.New(zap.WriteTo(io.MultiWriter(os.Stderr, &logs))))
	os.Exit(framework.Main(m, framework.Options{}, &env))
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func staleSeconds(t *testing.T) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "tally_aggregator_pod_watch_stale_seconds" {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no tally_aggregator_pod_watch_stale_seconds")
	return 0
}

func completing(t *testing.T, ns string) int64 {
	t.Helper()
	v, err := env.StatusCount(context.Background(), builder.WorkerPoolGVK, ns, "pool", "status", "completing")
	require.NoError(t, err)
	return v
}

func TestStaleWindowIsVisible(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "outage")
	require.NoError(t, err)
	pool := builder.WorkerPool(ns, "pool", 6)
	require.NoError(t, env.Client.Create(ctx, pool))
	var pods []*builder.PodBuilder
	for i := range 6 {
		pods = append(pods, builder.Pod(ns, fmt.Sprintf("pool-%d", i)).ControlledBy(builder.WorkerPoolGVK, "pool", pool.GetUID()).
			Label(keys.ParentUID, string(pool.GetUID())))
	}
	for _, b := range pods {
		require.NoError(t, env.Client.Create(ctx, b.Build()))
	}

	host, err := url.Parse(env.Config.Host)
	require.NoError(t, err)
	p, err := framework.NewProxy(host.Host)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	cfg := rest.CopyConfig(env.Config)
	cfg.Host = "https://" + p.Addr()
	cfg.ServerName = host.Hostname()
	aggCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- app.Run(aggCtx, &config.Config{Parents: []config.Parent{{
			Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: config.DefaultCounts,
		}}}, cfg, app.Options{MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 2})
	}()
	t.Cleanup(func() { stop(); <-done })
	require.Eventually(t, func() bool { return completing(t, ns) == 0 }, 30*time.Second, 50*time.Millisecond)
	require.Zero(t, staleSeconds(t))

	p.CutOff()
	cut := time.Now()
	for _, b := range pods[:3] {
		pod := b.Build()
		require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pod), pod))
		pod.Annotations = map[string]string{keys.CompletionIntent: "scale-down"}
		require.NoError(t, env.Client.Update(ctx, pod))
	}
	require.Eventually(t, func() bool { return staleSeconds(t) >= 3 }, 20*time.Second, 100*time.Millisecond,
		"the gauge does not show the pod watch as stale")
	assert.Equal(t, int64(0), completing(t, ns), "the status cannot have followed the pods while cut off")
	time.Sleep(5 * time.Second)
	outage := time.Since(cut)

	p.Restore()
	restored := time.Now()
	require.Eventually(t, func() bool { return completing(t, ns) == 3 }, 60*time.Second, 50*time.Millisecond)
	converged := time.Since(restored)
	require.Eventually(t, func() bool { return staleSeconds(t) == 0 }, 30*time.Second, 50*time.Millisecond)
	t.Logf("cut off for %.1fs; counts right %.2fs after the connection came back", outage.Seconds(), converged.Seconds())
	assert.Contains(t, logs.String(), "Pod watch interrupted")
	assert.Contains(t, logs.String(), "Pod watch delivering again")
}
