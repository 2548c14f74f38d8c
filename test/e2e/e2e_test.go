// Package e2e runs a short version of `make demo`: the real webhook and
// aggregator binaries, the example operator and the simulated kubelet on a
// local control plane.
package e2e

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/internal/demo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/test/framework"
)

func buildBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, framework.BuildBinaries(dir, "webhook", "aggregator"))
	return dir
}

func TestDemoScenario(t *testing.T) {
	ctx := context.Background()
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	d, err := demo.Start(ctx, demo.Options{
		Dir:        t.TempDir(),
		BinDir:     buildBinaries(t),
		ConfigFile: framework.Path("examples", "workerpool", "config.yaml"),
		Duration:   12 * time.Second,
		Seed:       42,
		Out:        t.Output(),
	})
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = d.Stop()
		}
	})

	require.NoError(t, d.Run(ctx), "the demo's verdict")

	// Stop the aggregator, scale down while it is down, start it again:
	// the counts converge to the truth. While it is down the pods that
	// exit keep the tracking finalizer (the example maps the totals): they
	// are deleted only once it has recorded them.
	require.NoError(t, d.StopAggregator())
	require.NoError(t, d.SetReplicas(ctx, 9))
	require.Eventually(t, func() bool {
		s, err := d.Snapshot(ctx)
		return err == nil && s.Truth[config.Active] == 9 && s.Truth[config.Completing] == 0
	}, 60*time.Second, 200*time.Millisecond, "the pool never ran 9 replicas with no pod completing")
	s, err := d.Snapshot(ctx)
	require.NoError(t, err)
	assert.False(t, s.Match(), "with the aggregator down the status cannot have followed the scale-down")
	require.NoError(t, d.StartAggregator(ctx))
	require.NoError(t, d.Converge(ctx, 60*time.Second))
	require.NoError(t, d.Verdict(ctx))

	pids := d.Processes()
	require.Len(t, pids, 2)
	stopped = true
	require.NoError(t, d.Stop())
	for _, pid := range pids {
		err := syscall.Kill(pid, 0)
		assert.True(t, errors.Is(err, syscall.ESRCH), "process %d is still running", pid)
	}
}
