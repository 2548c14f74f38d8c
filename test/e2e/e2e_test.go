// Package e2e runs a short version of `make demo`: the real webhook and
// aggregator binaries, the example operator and the simulated kubelet on a
// local control plane.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"image/png"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/test/framework"
)

func TestMain(m *testing.M) {
	if ok, code := framework.HaveTools(); !ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

func buildBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, framework.BuildBinaries(dir, "webhook", "aggregator"))
	return dir
}

func TestDemoScenario(t *testing.T) {
	ctx := context.Background()
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	dir := t.TempDir()
	d, err := demo.Start(ctx, demo.Options{
		Dir:        dir,
		BinDir:     buildBinaries(t),
		ConfigFile: repo.Path("examples", "workerpool", "config.yaml"),
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
	plot, err := os.Open(filepath.Join(dir, demo.PlotFile))
	require.NoError(t, err, "the demo leaves a plot of its run")
	_, err = png.Decode(plot)
	plot.Close()
	require.NoError(t, err, "the demo's plot is a PNG")

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

// TestInterruptStopsCleanly: Ctrl-C during the scenario is normal use. The
// demo stops everything it started, says it was interrupted, and exits with
// the shell's status for SIGINT (130), not with an error.
func TestInterruptStopsCleanly(t *testing.T) {
	bin := buildBinaries(t)
	require.NoError(t, framework.BuildBinaries(bin, "tally-demo"))
	dir := t.TempDir()
	cmd := exec.Command(filepath.Join(bin, "tally-demo"), "--duration", "60s", "--dir", dir, "--bin", bin,
		"--config", repo.Path("examples", "workerpool", "config.yaml"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	var out strings.Builder
	scanner := bufio.NewScanner(stdout)
	for scanner.Scan() && !strings.Contains(scanner.Text(), "creating WorkerPool") {
		out.WriteString(scanner.Text() + "\n")
	}
	if !strings.Contains(scanner.Text(), "creating WorkerPool") {
		_ = cmd.Wait()
		t.Fatalf("the scenario never started:\n%s%s", out.String(), stderr.String())
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	rest, _ := io.ReadAll(stdout)
	out.Write(rest)
	err = cmd.Wait()

	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "output:\n%s%s", out.String(), stderr.String())
	assert.Equal(t, 130, exit.ExitCode())
	assert.Contains(t, stderr.String(), "interrupt: the scenario was interrupted before its verdict; everything the demo started has been stopped")
	assert.NotContains(t, stderr.String(), "context canceled")
	assert.Contains(t, out.String(), "demo: stopping the operator, the aggregator, the webhook and the control plane")
	assert.Empty(t, processesNaming(t, dir), "processes the demo started still run")
}

// processesNaming returns the command lines of running processes that name
// path.
func processesNaming(t *testing.T, path string) []string {
	t.Helper()
	cmdlines, err := filepath.Glob("/proc/[0-9]*/cmdline")
	require.NoError(t, err)
	var found []string
	for _, f := range cmdlines {
		b, err := os.ReadFile(f)
		if err == nil && bytes.Contains(b, []byte(path)) {
			found = append(found, string(bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
		}
	}
	return found
}

// TestAnInvalidCustomCountStopsNothing runs the demo scenario on the
// example's configuration with one more custom count, whose expression does
// not compile (a ConfigMap edited by hand, a rollback to a version whose CEL
// lacks a function): both binaries start, pods are stamped, counted,
// marked, finished, recorded in the totals and deleted, the valid custom
// count is written and the invalid one is not; the aggregator reports it by
// a log line naming it, a metric and a Warning Event on the pool.
func TestAnInvalidCustomCountStopsNothing(t *testing.T) {
	ctx := context.Background()
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	dir := t.TempDir()
	example, err := os.ReadFile(repo.Path("examples", "workerpool", "config.yaml"))
	require.NoError(t, err)
	const bad = `pod.status.restartCount > 0` // a field of a container's status, not the pod's
	// One more item in the example's customCounts, its last key.
	withBad := strings.Replace(string(example), "\nverifyOwner:",
		"\n      - {name: restarted, path: status.restarted, expression: '"+bad+"'}\nverifyOwner:", 1)
	require.NotEqual(t, string(example), withBad)
	configFile := filepath.Join(dir, "config.yaml")
	require.NoError(t, os.WriteFile(configFile, []byte(withBad), 0o600))
	cfg, err := config.Load(configFile)
	require.NoError(t, err, "a custom count's problem is its own")
	require.Len(t, cfg.Parents[0].Broken(), 1)

	d, err := demo.Start(ctx, demo.Options{
		Dir: dir, BinDir: buildBinaries(t), ConfigFile: configFile, Duration: 8 * time.Second, Seed: 7, Out: t.Output(),
	})
	require.NoError(t, err, "the webhook and the aggregator start")
	t.Cleanup(func() { _ = d.Stop() })
	require.NoError(t, d.Run(ctx), "the demo's verdict: counts and totals right, ready written, restarted not")
	s, err := d.Snapshot(ctx)
	require.NoError(t, err)
	assert.Equal(t, []config.Count{"ready"}, s.Custom)
	assert.Empty(t, s.Written)
	assert.Positive(t, s.Totals[config.CompletedTotal]+s.Totals[config.UnexpectedTotal], "pods finished and were recorded")

	metrics := scrape(t, d.AggregatorMetrics())
	assert.Contains(t, metrics, `tally_aggregator_custom_count_invalid{count="restarted",kind="WorkerPool.example.tally.dev"} 1`)
	assert.Contains(t, metrics, `tally_aggregator_custom_count_invalid{count="ready",kind="WorkerPool.example.tally.dev"} 0`)

	log, err := os.ReadFile(filepath.Join(d.LogDir(), "aggregator.log"))
	require.NoError(t, err)
	assert.Contains(t, string(log), `"msg":"A custom count cannot be kept`)
	assert.Contains(t, string(log), `"count":"restarted"`)

	restCfg, err := clientcmd.BuildConfigFromFlags("", d.Kubeconfig())
	require.NoError(t, err)
	cs, err := kubernetes.NewForConfig(restCfg)
	require.NoError(t, err)
	events, err := cs.EventsV1().Events(demo.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=CustomCountInvalid"})
	require.NoError(t, err)
	require.Len(t, events.Items, 1, "one Warning Event on the pool, at most one an hour")
	assert.Equal(t, demo.Pool, events.Items[0].Regarding.Name)
	assert.Contains(t, events.Items[0].Note, `"restarted" (parents[0].customCounts[1].expression: the expression of WorkerPool.example.tally.dev's count "restarted" does not compile`)
}

// scrape returns the metrics served at addr (host:port, plain HTTP).
func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}
