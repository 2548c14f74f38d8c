// Package webhook runs tally's mutating webhook in the test process behind a
// real kube-apiserver, and checks the pod metadata contract through the API
// server only.
package webhook

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/cmd/webhook/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/intent"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// Two webhook processes run in the test: the default one (verifyOwner off)
// registered through envtest with envtest's certificates, and one with
// verifyOwner on, serving certificates from devcert that the rotation test
// replaces. A namespace label picks which one admits a namespace's pods.
const instanceLabel = "tally-test/webhook"

var (
	env      *framework.Env
	webhooks sync.WaitGroup
	parents  = []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: config.DefaultCounts}}
	jobGVK   = schema.GroupVersionKind{Group: "batch", Version: "v1", Kind: "Job"}

	verifying struct {
		ca      *devcert.CA
		certDir string
		port    int
	}
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if ok, code := framework.HaveTools(); !ok {
		return code
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	wh := mutate.Webhook(&config.Config{Parents: parents}, admissionregistrationv1.WebhookClientConfig{
		Service: &admissionregistrationv1.ServiceReference{Name: "tally-webhook", Namespace: "tally-system", Path: ptr.To(mutate.Path)},
	}, helm.AggregatorUser)
	wh.NamespaceSelector.MatchExpressions = append(wh.NamespaceSelector.MatchExpressions,
		metav1.LabelSelectorRequirement{Key: instanceLabel, Operator: metav1.LabelSelectorOpDoesNotExist})
	var err error
	env, err = framework.Start(controlplane.Options{Webhooks: envtest.WebhookInstallOptions{
		MutatingWebhooks: []*admissionregistrationv1.MutatingWebhookConfiguration{{
			ObjectMeta: metav1.ObjectMeta{Name: "tally"},
			Webhooks:   []admissionregistrationv1.MutatingWebhook{wh},
		}},
	}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() {
		cancel()
		webhooks.Wait()
		if verifying.certDir != "" {
			_ = os.RemoveAll(verifying.certDir)
		}
		if err := env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}()

	wio := &env.WebhookInstallOptions
	if err := start(ctx, &config.Config{Parents: parents}, wio.LocalServingHost, wio.LocalServingPort, wio.LocalServingCertDir, wio.LocalServingCAData); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := startVerifying(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

// start runs the webhook app as cmd/webhook does and waits for its TLS
// server.
func start(ctx context.Context, cfg *config.Config, host string, port int, certDir string, caPEM []byte) error {
	webhooks.Add(1)
	go func() {
		defer webhooks.Done()
		err := app.Run(ctx, cfg, env.Config, app.Options{Host: host, Port: port, CertDir: certDir, MetricsAddr: "0", ProbeAddr: "0"})
		if err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "webhook stopped:", err)
		}
	}()
	wait, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return framework.WaitForTLS(wait, host, port, caPEM)
}

func startVerifying(ctx context.Context) error {
	var err error
	verifying.ca, err = devcert.NewCA("tally test CA", time.Hour)
	if err != nil {
		return err
	}
	verifying.certDir, err = os.MkdirTemp("", "tally-webhook-certs-")
	if err != nil {
		return err
	}
	if err := issue(); err != nil {
		return err
	}
	if verifying.port, err = process.FreePort(); err != nil {
		return err
	}
	if err := start(ctx, &config.Config{Parents: parents, VerifyOwner: true}, "127.0.0.1", verifying.port, verifying.certDir, verifying.ca.CertPEM); err != nil {
		return err
	}
	wh := mutate.Webhook(&config.Config{Parents: parents, VerifyOwner: true}, admissionregistrationv1.WebhookClientConfig{
		URL:      ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", verifying.port, mutate.Path)),
		CABundle: verifying.ca.CertPEM,
	}, helm.AggregatorUser)
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{instanceLabel: "verifying"}}
	return env.Client.Create(ctx, &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "tally-verifying"},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{wh},
	})
}

func issue() error {
	pair, err := verifying.ca.Issue([]string{"127.0.0.1"}, time.Hour)
	if err != nil {
		return err
	}
	return pair.WriteDir(verifying.certDir)
}

// warnings collects the admission warnings the API server relays.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, text)
}

func (w *warnings) all() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.msgs...)
}

func clientWithWarnings(t *testing.T) (client.Client, *warnings) {
	t.Helper()
	w := &warnings{}
	cfg := rest.CopyConfig(env.Config)
	cfg.WarningHandler = w
	c, err := client.New(cfg, client.Options{})
	require.NoError(t, err)
	return c, w
}

func namespace(t *testing.T, instance string) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "webhook-"}}
	if instance != "" {
		ns.Labels = map[string]string{instanceLabel: instance}
	}
	require.NoError(t, env.Client.Create(context.Background(), ns))
	return ns.Name
}

func createPool(t *testing.T, ns, name string) types.UID {
	t.Helper()
	pool := operator.Pool(ns, name, 1)
	require.NoError(t, env.Client.Create(context.Background(), pool))
	return pool.GetUID()
}

func parentOf(name string) string { return "WorkerPool.example.tally.dev/" + name }

func TestCreateStampsIdentity(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")

	pod := builder.Pod(ns, "p1").ControlledBy(operator.GVK, "pool-a", uid).Label("app", "worker").Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	assert.Equal(t, map[string]string{"app": "worker", keys.ParentUID: string(uid), keys.ParentName: "pool-a"}, pod.Labels)
	assert.Equal(t, parentOf("pool-a"), pod.Annotations[keys.Parent])
}

func TestForgedIdentityIsReplacedWithWarning(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	c, w := clientWithWarnings(t)

	pod := builder.Pod(ns, "forged").ControlledBy(operator.GVK, "pool-a", uid).
		Label(keys.ParentUID, "not-the-owner").Annotation(keys.Parent, parentOf("elsewhere")).Build()
	require.NoError(t, c.Create(ctx, pod))
	assert.Equal(t, string(uid), pod.Labels[keys.ParentUID])
	assert.Equal(t, parentOf("pool-a"), pod.Annotations[keys.Parent])
	assertWarned(t, w, "label tally.dev/parent-uid set back", "annotation tally.dev/parent set back")
}

func TestApplyThatOmitsIdentityIsRestored(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	c, w := clientWithWarnings(t)

	apply := func(labels, annotations map[string]string) *corev1.Pod {
		labels["app"] = "worker"
		cfg := corev1ac.Pod("applied", ns).WithLabels(labels).WithAnnotations(annotations).
			WithOwnerReferences(metav1ac.OwnerReference().WithAPIVersion("example.tally.dev/v1").WithKind("WorkerPool").
				WithName("pool-a").WithUID(uid).WithController(true)).
			WithSpec(corev1ac.PodSpec().WithContainers(corev1ac.Container().WithName("worker").WithImage("registry.example/worker:1")))
		require.NoError(t, c.Apply(ctx, cfg, client.FieldOwner("operator"), client.ForceOwnership))
		pod := &corev1.Pod{}
		require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "applied"}, pod))
		return pod
	}
	// The operator first applies the identity keys itself, so it owns them;
	// applying again without them removes them, and the webhook puts them
	// back rather than refusing the request.
	apply(map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"}, map[string]string{keys.Parent: parentOf("pool-a")})
	pod := apply(map[string]string{}, nil)
	assert.Equal(t, string(uid), pod.Labels[keys.ParentUID])
	assert.Equal(t, "pool-a", pod.Labels[keys.ParentName])
	assert.Equal(t, parentOf("pool-a"), pod.Annotations[keys.Parent])
	assertWarned(t, w, "label tally.dev/parent-uid restored")
}

func TestIntentIsStampedAndSticky(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	pod := builder.Pod(ns, "p").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, env.Client.Create(ctx, pod))

	before := time.Now().Add(-time.Second).UTC().Truncate(time.Second)
	patch := client.MergeFrom(pod.DeepCopy())
	pod.Annotations[keys.CompletionIntent] = "scale-down"
	pod.Annotations[keys.CompletionIntentBy] = "someone-else"
	require.NoError(t, env.Client.Patch(ctx, pod, patch))
	at, err := time.Parse(time.RFC3339, pod.Annotations[keys.CompletionIntentAt])
	require.NoError(t, err)
	assert.False(t, at.Before(before), "intent-at %s before %s", at, before)
	assert.NotEmpty(t, pod.Annotations[keys.CompletionIntentBy])
	assert.NotEqual(t, "someone-else", pod.Annotations[keys.CompletionIntentBy])

	tests := map[string]struct {
		change func(*corev1.Pod)
		want   string
	}{
		"removal": {func(p *corev1.Pod) { delete(p.Annotations, keys.CompletionIntent) }, "annotation tally.dev/completion-intent is sticky: it was set to \"scale-down\" and cannot be removed"},
		"change":  {func(p *corev1.Pod) { p.Annotations[keys.CompletionIntent] = "evicted" }, "cannot be changed to \"evicted\""},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			changed := pod.DeepCopy()
			tc.change(changed)
			err := env.Client.Update(ctx, changed)
			require.Error(t, err)
			assert.True(t, apierrors.IsForbidden(err), "%v", err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}

	bad := builder.Pod(ns, "bad-reason").ControlledBy(operator.GVK, "pool-a", uid).Annotation(keys.CompletionIntent, "Scale_Down").Build()
	err = env.Client.Create(ctx, bad)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `"Scale_Down" is not a valid reason`)
}

func TestUntrackedPodsPassUnchanged(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	for _, pod := range []*corev1.Pod{
		builder.Pod(ns, "plain").Label("app", "x").Build(),
		builder.Pod(ns, "job").ControlledBy(jobGVK, "job", "8c1e2b9e-0000-4000-8000-000000000001").Build(),
		builder.Pod(ns, "not-controller").OwnedBy(operator.GVK, "pool", "8c1e2b9e-0000-4000-8000-000000000002").Build(),
	} {
		want := pod.DeepCopy()
		require.NoError(t, env.Client.Create(ctx, pod))
		assert.Equal(t, want.Labels, pod.Labels, pod.Name)
		assert.Equal(t, want.Annotations, pod.Annotations, pod.Name)
	}
}

func TestVerifyOwner(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "verifying")
	uid := createPool(t, ns, "pool-a")
	c, w := clientWithWarnings(t)

	pod := builder.Pod(ns, "real").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, c.Create(ctx, pod))
	assert.Equal(t, string(uid), pod.Labels[keys.ParentUID])

	forged := builder.Pod(ns, "forged").ControlledBy(operator.GVK, "pool-a", "00000000-0000-4000-8000-00000000dead").Build()
	require.NoError(t, c.Create(ctx, forged))
	assert.NotContains(t, forged.Labels, keys.ParentUID)
	assert.NotContains(t, forged.Annotations, keys.Parent)
	assertWarned(t, w, "pod not stamped with its parent's identity: owner "+parentOf("pool-a")+" in namespace "+ns+" has UID "+string(uid))

	missing := builder.Pod(ns, "missing").ControlledBy(operator.GVK, "no-such-pool", "00000000-0000-4000-8000-00000000beef").Build()
	require.NoError(t, c.Create(ctx, missing))
	assert.NotContains(t, missing.Labels, keys.ParentUID)
	assertWarned(t, w, "owner "+parentOf("no-such-pool")+" not found in namespace "+ns)
}

// TestCertificateRotation replaces the serving certificate several times
// while a client keeps creating pods: every request succeeds, and the server
// ends up serving the last certificate.
func TestCertificateRotation(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "verifying")
	uid := createPool(t, ns, "pool-a")
	first, err := framework.ServingCertificate("127.0.0.1", verifying.port, verifying.ca.CertPEM)
	require.NoError(t, err)

	stop := make(chan struct{})
	var created int
	var failures []error
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			pod := builder.Pod(ns, fmt.Sprintf("rot-%d", i)).ControlledBy(operator.GVK, "pool-a", uid).Build()
			if err := env.Client.Create(ctx, pod); err != nil {
				failures = append(failures, err)
			} else if pod.Labels[keys.ParentUID] != string(uid) {
				failures = append(failures, fmt.Errorf("pod %s not stamped", pod.Name))
			}
			created++
		}
	}()

	var last *x509.Certificate
	for range 3 {
		time.Sleep(300 * time.Millisecond)
		require.NoError(t, issue())
		data, err := os.ReadFile(filepath.Join(verifying.certDir, "tls.crt"))
		require.NoError(t, err)
		block, _ := pem.Decode(data)
		require.NotNil(t, block)
		last, err = x509.ParseCertificate(block.Bytes)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		cert, err := framework.ServingCertificate("127.0.0.1", verifying.port, verifying.ca.CertPEM)
		return err == nil && cert.SerialNumber.Cmp(last.SerialNumber) == 0
	}, 20*time.Second, 100*time.Millisecond, "the rotated certificate was never served")
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done

	assert.Empty(t, failures)
	assert.Greater(t, created, 10)
	assert.NotEqual(t, first.SerialNumber, last.SerialNumber)
}

func assertWarned(t *testing.T, w *warnings, substrings ...string) {
	t.Helper()
	got := w.all()
	for _, s := range substrings {
		found := false
		for _, msg := range got {
			found = found || strings.Contains(msg, s)
		}
		assert.True(t, found, "no warning contains %q; warnings: %q", s, got)
	}
}

// TestMarkForCompletion exercises the operator helper through the webhook.
func TestMarkForCompletion(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	pod := builder.Pod(ns, "p").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, env.Client.Create(ctx, pod))

	require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))
	assert.Equal(t, "scale-down", pod.Annotations[keys.CompletionIntent])
	assert.NotEmpty(t, pod.Annotations[keys.CompletionIntentAt])
	assert.NotEmpty(t, pod.Annotations[keys.CompletionIntentBy])

	rv := pod.ResourceVersion
	require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))
	assert.Equal(t, rv, pod.ResourceVersion, "marking again wrote the pod")

	err := intent.MarkForCompletion(ctx, env.Client, pod.DeepCopy(), "evicted")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "is sticky")

	err = intent.MarkForCompletion(ctx, env.Client, pod.DeepCopy(), "Not Valid")
	assert.ErrorContains(t, err, `"Not Valid" is not a valid reason`)
}

// TestStaleUpdateGetsAConflict: an update from a copy that predates the
// intent is answered with the API server's 409, not a denial, so
// retry.RetryOnConflict reads the pod again and succeeds.
func TestStaleUpdateGetsAConflict(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	pod := builder.Pod(ns, "p").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	stale := pod.DeepCopy()
	require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))

	stale.Labels["app"] = "worker"
	err := env.Client.Update(ctx, stale)
	require.Error(t, err)
	assert.True(t, apierrors.IsConflict(err), "an update from a stale copy must get 409, got %v", err)

	attempts := 0
	require.NoError(t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		attempts++
		if attempts > 1 {
			if err := env.Client.Get(ctx, client.ObjectKeyFromObject(stale), stale); err != nil {
				return err
			}
			stale.Labels["app"] = "worker"
		}
		return env.Client.Update(ctx, stale)
	}))
	assert.Equal(t, 2, attempts)
	assert.Equal(t, "scale-down", stale.Annotations[keys.CompletionIntent])
}

// TestUntrackedPodsAreNeverBlocked: on a pod whose controller is not of a
// tracked kind, an invalid reason token and the removal of an intent pass.
func TestUntrackedPodsAreNeverBlocked(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	pod := builder.Pod(ns, "untracked").ControlledBy(schema.GroupVersionKind{Group: "batch", Version: "v1", Kind: "Job"}, "job", "uid-j").
		Annotation(keys.CompletionIntent, "Not A Token").Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	delete(pod.Annotations, keys.CompletionIntent)
	require.NoError(t, env.Client.Update(ctx, pod))
}

// TestVerifyOwnerKindThatAppearsLater: a webhook with verifyOwner whose
// parent kind's CRD is not installed yet starts and serves; once the CRD is
// installed, the kind's pods are stamped after their owner is verified.
func TestVerifyOwnerKindThatAppearsLater(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	shardSets := []config.Parent{{Group: "test.tally.dev", Version: "v1", Kind: "ShardSet", Counts: config.DefaultCounts}}
	port, err := process.FreePort()
	require.NoError(t, err)
	require.NoError(t, start(ctx, &config.Config{Parents: shardSets, VerifyOwner: true}, "127.0.0.1", port, verifying.certDir, verifying.ca.CertPEM),
		"a webhook whose parent kind is not served must start")

	wh := mutate.Webhook(&config.Config{Parents: shardSets, VerifyOwner: true}, admissionregistrationv1.WebhookClientConfig{
		URL:      ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path)),
		CABundle: verifying.ca.CertPEM,
	}, helm.AggregatorUser)
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{instanceLabel: "late"}}
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "tally-late"}, Webhooks: []admissionregistrationv1.MutatingWebhook{wh}}
	require.NoError(t, env.Client.Create(ctx, mwc))
	t.Cleanup(func() { _ = env.Client.Delete(context.Background(), mwc) })

	_, err = envtest.InstallCRDs(env.Config, envtest.CRDInstallOptions{Paths: []string{repo.Path("test", "testdata", "crds", "shardsets.yaml")}})
	require.NoError(t, err)
	ns := namespace(t, "late")
	parent := operator.Pool(ns, "shards", 1)
	parent.SetGroupVersionKind(schema.GroupVersionKind{Group: "test.tally.dev", Version: "v1", Kind: "ShardSet"})
	require.NoError(t, env.Client.Create(ctx, parent))
	time.Sleep(time.Second) // the registration is picked up asynchronously

	pod := builder.Pod(ns, "shard-0").ControlledBy(parent.GroupVersionKind(), "shards", parent.GetUID()).Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	assert.Equal(t, string(parent.GetUID()), pod.Labels[keys.ParentUID])
}

// admissions returns how many reviews the webhooks of this process have
// answered (tally_webhook_admissions_total).
func admissions(t *testing.T) float64 {
	t.Helper()
	families, err := metrics.Registry.Gather()
	require.NoError(t, err)
	total := 0.0
	for _, f := range families {
		if f.GetName() != "tally_webhook_admissions_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			total += m.GetCounter().GetValue()
		}
	}
	return total
}

// TestStampedPodsAreAdmittedWithoutACall: through the real API server and
// the registration's match conditions, a pod its operator stamped
// (identity.Stamp) and the updates that leave tally's keys as admitted never
// reach the webhook; a forged stamp, an intent, an update that drops the
// identity still do, and are answered as before.
func TestStampedPodsAreAdmittedWithoutACall(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	c, w := clientWithWarnings(t)
	calls := func(do func()) float64 {
		t.Helper()
		before := admissions(t)
		do()
		return admissions(t) - before
	}

	pod := builder.Pod(ns, "stamped").ControlledBy(operator.GVK, "pool-a", uid).Label("app", "worker").Build()
	require.True(t, identity.Stamp(pod))
	assert.Zero(t, calls(func() { require.NoError(t, c.Create(ctx, pod)) }), "a stamped pod was sent to the webhook")
	assert.Equal(t, map[string]string{"app": "worker", keys.ParentUID: string(uid), keys.ParentName: "pool-a"}, pod.Labels)
	assert.Equal(t, parentOf("pool-a"), pod.Annotations[keys.Parent])

	relabel := func(value string) {
		require.NoError(t, c.Patch(ctx, pod, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"app":"`+value+`"}}}`))))
	}
	assert.Zero(t, calls(func() { relabel("other") }), "a label-only update of a stamped pod was sent")

	assert.Equal(t, 1.0, calls(func() { require.NoError(t, intent.MarkForCompletion(ctx, c, pod, "scale-down")) }), "marking must be stamped")
	assert.NotEmpty(t, pod.Annotations[keys.CompletionIntentAt])
	assert.Zero(t, calls(func() { relabel("draining") }), "an update of a marked pod that keeps its stamps was sent")

	forged := builder.Pod(ns, "forged").ControlledBy(operator.GVK, "pool-a", uid).Build()
	identity.Stamp(forged)
	forged.Labels[keys.ParentUID] = "not-the-owner"
	assert.Equal(t, 1.0, calls(func() { require.NoError(t, c.Create(ctx, forged)) }))
	assert.Equal(t, string(uid), forged.Labels[keys.ParentUID])
	assertWarned(t, w, "label tally.dev/parent-uid set back")

	dropped := func() {
		require.NoError(t, c.Patch(ctx, forged, client.RawPatch(types.JSONPatchType, []byte(`[{"op":"remove","path":"/metadata/labels/tally.dev~1parent-name"}]`))))
	}
	assert.Equal(t, 1.0, calls(dropped), "an update that drops the identity must be sent")
	assert.Equal(t, "pool-a", forged.Labels[keys.ParentName])
}

// TestReinvocationAfterAnotherWebhookIsSkipped: a mutating webhook that
// runs after tally's and adds an annotation (a sidecar injector) makes the
// API server reinvoke tally (reinvocationPolicy IfNeeded); the pod then
// carries exactly what tally stamped, so the match conditions skip that
// second call.
func TestReinvocationAfterAnotherWebhookIsSkipped(t *testing.T) {
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "webhook-", Labels: map[string]string{"tally-test/sidecar": "inject"}}}
	require.NoError(t, env.Client.Create(ctx, ns))
	uid := createPool(t, ns.Name, "pool-a")

	pair, err := verifying.ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(pair.CertPEM, pair.KeyPEM)
	require.NoError(t, err)
	var injected atomic.Int32
	sidecar := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review admissionv1.AdmissionReview
		if err := json.NewDecoder(r.Body).Decode(&review); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var pod corev1.Pod
		_ = json.Unmarshal(review.Request.Object.Raw, &pod)
		resp := &admissionv1.AdmissionResponse{UID: review.Request.UID, Allowed: true}
		if _, done := pod.Annotations["example.com/sidecar"]; !done {
			injected.Add(1)
			resp.PatchType = ptr.To(admissionv1.PatchTypeJSONPatch)
			resp.Patch = []byte(`[{"op":"add","path":"/metadata/annotations/example.com~1sidecar","value":"injected"}]`)
			if pod.Annotations == nil {
				resp.Patch = []byte(`[{"op":"add","path":"/metadata/annotations","value":{"example.com/sidecar":"injected"}}]`)
			}
		}
		review.Response, review.Request = resp, nil
		_ = json.NewEncoder(w).Encode(review)
	}))
	sidecar.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	sidecar.StartTLS()
	defer sidecar.Close()
	sideEffects := admissionregistrationv1.SideEffectClassNone
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{
		// Named after tally's, so the API server calls it second.
		ObjectMeta: metav1.ObjectMeta{Name: "zz-sidecar-injector"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name:                    "sidecar.example.com",
			ClientConfig:            admissionregistrationv1.WebhookClientConfig{URL: ptr.To(sidecar.URL), CABundle: verifying.ca.CertPEM},
			AdmissionReviewVersions: []string{"v1"},
			SideEffects:             &sideEffects,
			NamespaceSelector:       &metav1.LabelSelector{MatchLabels: ns.Labels},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}},
			}},
		}},
	}
	require.NoError(t, env.Client.Create(ctx, mwc))
	defer func() { _ = env.Client.Delete(ctx, mwc) }()
	// The API server picks registrations up asynchronously.
	require.Eventually(t, func() bool {
		probe := builder.Pod(ns.Name, fmt.Sprintf("probe-%d", time.Now().UnixNano())).Build()
		return env.Client.Create(ctx, probe) == nil && probe.Annotations["example.com/sidecar"] != ""
	}, 10*time.Second, 100*time.Millisecond)

	before := admissions(t)
	pod := builder.Pod(ns.Name, "p").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	assert.Equal(t, "injected", pod.Annotations["example.com/sidecar"])
	assert.Equal(t, string(uid), pod.Labels[keys.ParentUID])
	assert.Equal(t, 1.0, admissions(t)-before, "tally was called again after the sidecar injector changed the pod")
}

// TestOwnerChangeCannotLaunderAnIntent: through the real API server, with
// the chart's match conditions in front of the webhook, the request that
// changes a pod's owner neither drops an admitted intent nor keeps stamps a
// client forged; once detached, the pod is not tracked, and nothing about
// it is refused.
func TestOwnerChangeCannotLaunderAnIntent(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	stored := func(name string) *corev1.Pod {
		pod := &corev1.Pod{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pod))
		return pod
	}
	withoutTallyKeys := func(m map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range m {
			if !strings.HasPrefix(k, keys.Prefix) {
				out[k] = v
			}
		}
		return out
	}

	t.Run("dropping an admitted intent", func(t *testing.T) {
		pod := builder.Pod(ns, "marked").ControlledBy(operator.GVK, "pool-a", uid).Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))
		admitted := stored("marked").Annotations

		// In one update: no controller, no tally key.
		bare := stored("marked")
		bare.OwnerReferences = nil
		bare.Labels, bare.Annotations = withoutTallyKeys(bare.Labels), withoutTallyKeys(bare.Annotations)
		err := env.Client.Update(ctx, bare)
		require.Error(t, err, "the intent was dropped with the controller")
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.ErrorContains(t, err, "is sticky")

		// The controller alone: allowed, and the intent stays, as admitted.
		orphan := stored("marked")
		orphan.OwnerReferences = nil
		require.NoError(t, env.Client.Update(ctx, orphan))
		got := stored("marked").Annotations
		for _, k := range []string{keys.CompletionIntent, keys.CompletionIntentAt, keys.CompletionIntentBy} {
			assert.Equal(t, admitted[k], got[k], k)
		}

		// The controller back: tally did not stamp the pod it sees now, so
		// its intent is judged at first sight, and admitted as seen now by
		// no one observed.
		before := time.Now().Add(-time.Second).UTC().Truncate(time.Second)
		back := stored("marked")
		back.OwnerReferences = builder.Pod(ns, "marked").ControlledBy(operator.GVK, "pool-a", uid).Build().OwnerReferences
		require.NoError(t, env.Client.Update(ctx, back))
		got = stored("marked").Annotations
		assert.Equal(t, "scale-down", got[keys.CompletionIntent])
		at, err := time.Parse(time.RFC3339, got[keys.CompletionIntentAt])
		require.NoError(t, err)
		assert.False(t, at.Before(before), "the -at of a pod tally did not stamp stayed: %s", got[keys.CompletionIntentAt])
		assert.Equal(t, mutate.UnobservedRequester, got[keys.CompletionIntentBy])

		// Once detached, the pod is not tracked, and no request about it is
		// refused: its intent may go.
		orphan = stored("marked")
		orphan.OwnerReferences = nil
		require.NoError(t, env.Client.Update(ctx, orphan))
		orphan = stored("marked")
		delete(orphan.Annotations, keys.CompletionIntent)
		require.NoError(t, env.Client.Update(ctx, orphan), "a request about a pod tally does not track")
		got = stored("marked").Annotations
		assert.NotContains(t, got, keys.CompletionIntentAt, "stamps without an intent are removed")
	})

	t.Run("forging the stamps", func(t *testing.T) {
		before := time.Now().Add(-time.Second).UTC().Truncate(time.Second)
		pod := builder.Pod(ns, "forged-stamps").OwnedBy(operator.GVK, "pool-a", uid).
			Annotation(keys.CompletionIntent, "scale-down").
			Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Annotation(keys.CompletionIntentBy, "someone-else").Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		got := stored("forged-stamps").Annotations
		assert.NotContains(t, got, keys.CompletionIntentAt, "a stamp a client wrote on an untracked pod is kept")
		assert.NotContains(t, got, keys.CompletionIntentBy, "a stamp a client wrote on an untracked pod is kept")

		tracked := stored("forged-stamps")
		tracked.OwnerReferences[0].Controller = ptr.To(true)
		tracked.Labels = map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"}
		tracked.Annotations[keys.Parent] = parentOf("pool-a")
		tracked.Annotations[keys.CompletionIntentAt] = "2001-01-01T00:00:00Z"
		tracked.Annotations[keys.CompletionIntentBy] = "someone-else"
		require.NoError(t, env.Client.Update(ctx, tracked))
		got = stored("forged-stamps").Annotations
		at, err := time.Parse(time.RFC3339, got[keys.CompletionIntentAt])
		require.NoError(t, err)
		assert.False(t, at.Before(before), "the forged -at stayed: %s", got[keys.CompletionIntentAt])
		assert.Equal(t, mutate.UnobservedRequester, got[keys.CompletionIntentBy], "the intent was set while the pod was not tracked: nobody was observed setting it")
	})
}

// TestResourceVersionNeverExemptsARequest: an update is decided on its
// content whatever resourceVersion it carries. "0" and "" make an
// unconditional update of a pod, and a zero-padded copy of the stored
// version is the stored version, as the API server parses them: none of
// them removes, changes or forges an admitted intent. A stale version is
// still answered with 409 Conflict, which clients retry.
func TestResourceVersionNeverExemptsARequest(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	// marked creates a pod and marks it: its stored copy, intent admitted.
	marked := func(t *testing.T, name string) *corev1.Pod {
		pod := builder.Pod(ns, name).ControlledBy(operator.GVK, "pool-a", uid).Build()
		require.NoError(t, env.Client.Create(ctx, pod))
		require.NoError(t, intent.MarkForCompletion(ctx, env.Client, pod, "scale-down"))
		return pod
	}

	changes := map[string]func(*corev1.Pod){
		"removes-intent": func(p *corev1.Pod) { delete(p.Annotations, keys.CompletionIntent) },
		"changes-reason": func(p *corev1.Pod) { p.Annotations[keys.CompletionIntent] = "evicted" },
		"forges-stamps": func(p *corev1.Pod) {
			p.Annotations[keys.CompletionIntentAt] = "2001-01-01T00:00:00Z"
			p.Annotations[keys.CompletionIntentBy] = "mallory"
		},
	}
	versions := map[string]func(stored string) string{
		"zero":        func(string) string { return "0" },
		"empty":       func(string) string { return "" },
		"zero-padded": func(rv string) string { return "0" + rv },
		"stored":      func(rv string) string { return rv },
	}
	for vname, version := range versions {
		for cname, change := range changes {
			t.Run(vname+"-"+cname, func(t *testing.T) {
				admitted := marked(t, vname+"-"+cname)
				update := admitted.DeepCopy()
				update.ResourceVersion = version(update.ResourceVersion)
				change(update)
				err := env.Client.Update(ctx, update)
				if err == nil {
					// Only forged stamps may be taken, and set back.
					require.Equal(t, "forges-stamps", cname, "the update was stored")
				} else {
					assert.True(t, apierrors.IsForbidden(err), "%v", err)
				}
				got := &corev1.Pod{}
				require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(admitted), got))
				for _, k := range []string{keys.CompletionIntent, keys.CompletionIntentAt, keys.CompletionIntentBy} {
					assert.Equal(t, admitted.Annotations[k], got.Annotations[k], k)
				}
			})
		}
	}

	t.Run("stale", func(t *testing.T) {
		update := marked(t, "stale")
		rv, err := strconv.ParseUint(update.ResourceVersion, 10, 64)
		require.NoError(t, err)
		update.ResourceVersion = strconv.FormatUint(rv-1, 10)
		delete(update.Annotations, keys.CompletionIntent)
		err = env.Client.Update(ctx, update)
		require.Error(t, err)
		assert.True(t, apierrors.IsConflict(err), "a stale update must get 409, got %v", err)
	})
}

// TestNoIntentAfterTheEndByADetour: a tracked pod that failed without an
// intent cannot have one carried in by detaching it (controller: false),
// marking it, and attaching it again: the intent is removed when the pod is
// first seen again, and the pod stays unexpected.
func TestNoIntentAfterTheEndByADetour(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	pod := builder.Pod(ns, "failed").ControlledBy(operator.GVK, "pool-a", uid).Build()
	require.NoError(t, env.Client.Create(ctx, pod))
	pod.Status.Phase = corev1.PodFailed
	require.NoError(t, env.Client.Status().Update(ctx, pod))

	mergePatch := func(patch string) error {
		return env.Client.Patch(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "failed"}}, client.RawPatch(types.MergePatchType, []byte(patch)))
	}
	direct := fmt.Sprintf(`{"metadata":{"annotations":{%q:"scale-down"}}}`, keys.CompletionIntent)
	err := mergePatch(direct)
	require.Error(t, err, "an intent set on a failed pod")
	assert.ErrorContains(t, err, "cannot be set on a pod that has finished")

	detached := fmt.Sprintf(`{"metadata":{"ownerReferences":[{"apiVersion":"example.tally.dev/v1","kind":"WorkerPool","name":"pool-a","uid":%q,"controller":false}],"annotations":{%q:"scale-down"}}}`,
		uid, keys.CompletionIntent)
	require.NoError(t, mergePatch(detached), "an untracked pod is not blocked")
	// Attached again, the pod is first seen with an intent after its end:
	// not admitted, the intent is removed, and the pod counts as
	// unexpected.
	attached := fmt.Sprintf(`{"metadata":{"ownerReferences":[{"apiVersion":"example.tally.dev/v1","kind":"WorkerPool","name":"pool-a","uid":%q,"controller":true}]}}`, uid)
	require.NoError(t, mergePatch(attached))
	got := &corev1.Pod{}
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "failed"}, got))
	assert.NotContains(t, got.Annotations, keys.CompletionIntent, "the finished pod became tracked with an intent set after its end")
	assert.Equal(t, string(uid), got.Labels[keys.ParentUID], "tracked again: it counts as unexpected")
	err = mergePatch(direct)
	require.Error(t, err, "an intent set on the failed pod, tracked again")
	assert.ErrorContains(t, err, "cannot be set on a pod that has finished")
}

// TestTrackingFinalizerOnCreateIsTallys: a client that creates a pod with
// tally.dev/tracking, on a kind without totals or an untracked one, has it
// removed with a warning; only tally adds it.
func TestTrackingFinalizerOnCreateIsTallys(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "")
	uid := createPool(t, ns, "pool-a")
	c, w := clientWithWarnings(t)
	for _, pod := range []*corev1.Pod{
		builder.Pod(ns, "no-totals").ControlledBy(operator.GVK, "pool-a", uid).Finalizer(keys.TrackingFinalizer).Build(),
		builder.Pod(ns, "untracked").ControlledBy(jobGVK, "job", "8c1e2b9e-0000-4000-8000-000000000002").
			Finalizer("example.com/keep").Finalizer(keys.TrackingFinalizer).Build(),
		builder.Pod(ns, "no-owner").Finalizer(keys.TrackingFinalizer).Build(),
	} {
		require.NoError(t, c.Create(ctx, pod), pod.Name)
		assert.NotContains(t, pod.Finalizers, keys.TrackingFinalizer, pod.Name)
	}
	assertWarned(t, w, "finalizer tally.dev/tracking removed")
}
