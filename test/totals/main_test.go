// Package totals runs the cumulative totals (completedTotal,
// unexpectedTotal) end to end against a real kube-apiserver: the webhook
// and the aggregator as separate processes, as the chart deploys them, the
// aggregator as the service account the chart's policy fences, killed
// with SIGKILL at random points while pods finish in bursts.
package totals

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	// bin holds the built binaries; dir the configs, kubeconfigs and the
	// webhook's certificate.
	bin, dir string
	ca       *devcert.CA
)

// The configurations: the example's (every count and both totals), and the
// same kind without totals.
var (
	withTotals    = repo.Path("examples", "workerpool", "config.yaml")
	withoutTotals string
	kindRemoved   string
	// Configuration changes: one total unmapped, one renamed, the ledger
	// renamed.
	oneTotal, renamedTotal, renamedLedger string
)

func TestMain(m *testing.M) {
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	var err error
	if dir, err = os.MkdirTemp("", "tally-totals-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	withoutTotals = filepath.Join(dir, "without-totals.yaml")
	kindRemoved = filepath.Join(dir, "kind-removed.yaml")
	oneTotal = filepath.Join(dir, "one-total.yaml")
	renamedTotal = filepath.Join(dir, "renamed-total.yaml")
	renamedLedger = filepath.Join(dir, "renamed-ledger.yaml")
	bin = filepath.Join(dir, "bin")
	code := framework.Main(m, controlplane.Options{}, &env, func(e *framework.Env) error {
		if err := framework.BuildBinaries(bin, "webhook", "aggregator"); err != nil {
			return err
		}
		files := map[string]string{
			withoutTotals: "parents:\n  - {group: example.tally.dev, version: v1, kind: WorkerPool, counts: {completing: status.completing, active: status.active}}\n",
			kindRemoved:   "parents:\n  - {group: \"\", version: v1, kind: ReplicationController}\n",
			oneTotal:      poolConfig("completedTotal: status.completedTotal", "status.tallyLedger"),
			renamedTotal:  poolConfig("completedTotal: status.completedTotal, unexpectedTotal: status.crashTotal", "status.tallyLedger"),
			renamedLedger: poolConfig("completedTotal: status.completedTotal, unexpectedTotal: status.unexpectedTotal", "status.ledgerV2"),
		}
		for path, data := range files {
			if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
				return err
			}
		}
		if ca, err = devcert.NewCA("tally totals CA", time.Hour); err != nil {
			return err
		}
		pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
		if err != nil {
			return err
		}
		if err := pair.WriteDir(dir); err != nil {
			return err
		}
		user, err := e.AggregatorIdentity()
		if err != nil {
			return err
		}
		if err := controlplane.WriteKubeconfig(user, filepath.Join(dir, "aggregator.kubeconfig")); err != nil {
			return err
		}
		admin, err := e.AddUser(envtest.User{Name: "totals-admin", Groups: []string{"system:masters"}}, nil)
		if err != nil {
			return err
		}
		if err := controlplane.WriteKubeconfig(admin, filepath.Join(dir, "admin.kubeconfig")); err != nil {
			return err
		}
		return helm.InstallPolicies(context.Background(), e.Client)
	})
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// poolConfig is a configuration of the WorkerPool kind with every count
// and the given totals (YAML flow mappings) and ledger.
func poolConfig(totals, ledger string) string {
	return fmt.Sprintf("parents:\n  - {group: example.tally.dev, version: v1, kind: WorkerPool, ledger: %s, counts: {completing: status.completing, completed: status.completed, active: status.active, unexpected: status.unexpected, %s}}\n", ledger, totals)
}

// namespace creates a namespace that only this test's webhook registration
// selects.
func namespace(t *testing.T) string { return env.WebhookNamespace(t, "totals") }

// startWebhook runs the webhook with cfg and registers it, as the chart
// does, for namespace ns only.
func startWebhook(t *testing.T, ns, cfg string) {
	t.Helper()
	port, err := process.FreePort()
	require.NoError(t, err)
	framework.StartProcess(t, bin, "webhook", "--config", cfg, "--kubeconfig", filepath.Join(dir, "admin.kubeconfig"),
		"--cert-dir", dir, "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--metrics-bind-address", "0", "--shutdown-delay", "0s")
	parsed, err := config.Load(cfg)
	require.NoError(t, err)
	tracksPools := slices.ContainsFunc(parsed.Parents, func(p config.Parent) bool { return p.GroupKind() == operator.GVK.GroupKind() })
	poolTotals := slices.ContainsFunc(parsed.Parents, func(p config.Parent) bool {
		return p.GroupKind() == operator.GVK.GroupKind() && p.Tracked()
	})
	env.RegisterWebhook(t, parsed, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path)), CABundle: ca.CertPEM,
	}, ns, admissionregistrationv1.Fail)
	// The API server picks registrations up asynchronously.
	require.Eventually(t, func() bool {
		probe := builder.Pod(ns, "probe").ControlledBy(operator.GVK, "none", "00000000-0000-4000-8000-000000000000").Build()
		if err := env.Client.Create(context.Background(), probe, client.DryRunAll); err != nil {
			return false
		}
		// With totals, also until the webhook has found the kind served
		// for them (its first check).
		return !tracksPools || probe.Labels[keys.ParentUID] != "" && (!poolTotals || slices.Contains(probe.Finalizers, keys.TrackingFinalizer))
	}, 30*time.Second, 100*time.Millisecond, "the webhook registration never took effect")
}

// aggregator is one aggregator process, which the test can kill and start
// again.
type aggregator struct {
	t    *testing.T
	name string
	args []string
	p    *process.Process
}

// startAggregator runs the aggregator with cfg as the chart's service
// account, with leader election in leaseNS when it is not empty, and the
// flags in extra (which may replace the metrics address).
func startAggregator(t *testing.T, name, cfg, leaseNS string, extra ...string) *aggregator {
	t.Helper()
	args := []string{"--config", cfg, "--kubeconfig", filepath.Join(dir, "aggregator.kubeconfig"),
		"--metrics-bind-address", "0", "--backfill-interval", "1h"}
	args = append(args, extra...)
	if leaseNS != "" {
		args = append(args, "--leader-elect", "--leader-election-namespace", leaseNS, "--leader-election-id", "tally-aggregator")
	}
	a := &aggregator{t: t, name: name, args: args}
	a.start()
	return a
}

func (a *aggregator) start() {
	a.t.Helper()
	a.p, _ = framework.StartProcess(a.t, bin, "aggregator", a.args...)
}

// kill ends the process with SIGKILL: no cleanup, no lease released.
func (a *aggregator) kill() {
	a.t.Helper()
	require.NoError(a.t, a.p.Signal(syscall.SIGKILL))
	_ = a.p.Stop()
}

// leads reports whether the process has logged that it acquired the lease.
func (a *aggregator) leads() bool {
	log, err := os.ReadFile(a.p.LogPath())
	return err == nil && strings.Contains(strings.ToLower(string(log)), "successfully acquired lease")
}

// createPool creates a WorkerPool and n pods it controls through the
// webhook; it returns the pool's UID and the pods.
func createPool(t *testing.T, ns, name string, n int) (types.UID, []*corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	pool := operator.Pool(ns, name, int64(n))
	require.NoError(t, env.Client.Create(ctx, pool))
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = builder.Pod(ns, fmt.Sprintf("%s-%03d", name, i)).ControlledBy(operator.GVK, name, pool.GetUID()).Build()
		require.NoError(t, env.Client.Create(ctx, pods[i]))
		require.Contains(t, pods[i].Finalizers, keys.TrackingFinalizer, "the webhook adds the finalizer on CREATE")
	}
	return pool.GetUID(), pods
}

// totals reads a pool's totals and the length of its ledger.
func totals(t *testing.T, ns, name string) (completed, unexpected int64, ledger int) {
	t.Helper()
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(operator.GVK)
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, u))
	return framework.Totals(u)
}

// withFinalizer returns the pods of ns still carrying the tracking
// finalizer.
func withFinalizer(t *testing.T, ns string) []string {
	t.Helper()
	var pods corev1.PodList
	require.NoError(t, env.Client.List(context.Background(), &pods, client.InNamespace(ns)))
	var out []string
	for _, p := range pods.Items {
		for _, f := range p.Finalizers {
			if f == keys.TrackingFinalizer {
				out = append(out, p.Name)
			}
		}
	}
	return out
}
