package contract

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/framework"
)

// variant is one configuration tally runs with: WorkerPool is always a
// parent kind, with its totals (its pods get the tracking finalizer);
// ReplicationController, a core kind without totals, is one when rc is
// set; verifyOwner checks owners, none of which exists, so that only a pod
// already stamped with its owner's identity stays tracked.
type variant struct {
	name        string
	rc          bool
	verifyOwner bool
}

// variants are the configurations a sequence moves between; the first is
// the one every sequence starts and ends with.
var variants = []variant{
	{name: "WorkerPool and ReplicationController", rc: true},
	{name: "WorkerPool alone"},
	{name: "WorkerPool and ReplicationController, verifyOwner", rc: true, verifyOwner: true},
}

// allKinds are the kinds any variant tracks.
var allKinds = []kind{{group: "example.tally.dev", kind: "WorkerPool", totals: true}, {group: "", kind: "ReplicationController"}}

func (v variant) kinds() []kind {
	if v.rc {
		return allKinds
	}
	return allKinds[:1]
}

// config is the variant's configuration file.
func (v variant) config() string {
	var b strings.Builder
	b.WriteString(`parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    resource: workerpools
    counts: {completing: status.completing, completedTotal: status.completedTotal, unexpectedTotal: status.unexpectedTotal}
    ledger: status.tallyLedger
`)
	if v.rc {
		b.WriteString(`  - group: ""
    version: v1
    kind: ReplicationController
`)
	}
	fmt.Fprintf(&b, "verifyOwner: %t\nnamespaceSelector: {matchLabels: {%q: \"true\"}}\n", v.verifyOwner, selectorLabel)
	return b.String()
}

// contract is the model of the contract under the variant.
func (v variant) contract(t *testing.T) truth.Contract {
	cfg, err := config.Parse([]byte(v.config()))
	require.NoError(t, err)
	c := truth.NewContract(cfg.Parents)
	if v.verifyOwner {
		c.Verified = func(metav1.OwnerReference) bool { return false }
	}
	return c
}

// tally is bin/webhook and bin/aggregator as a sequence sees them: their
// configuration, and whether the webhook can be reached.
type tally struct {
	// t is the test the processes run for: they outlive each sequence.
	t          *testing.T
	admin      kubernetes.Interface
	webhook    *process.Process
	aggregator *process.Process
	// port is the webhook's; each start takes a new one, so that no
	// registration the API server may still hold reaches a webhook it was
	// not written for.
	port    int
	variant int
	// down: the webhook is down, and its registration's failurePolicy is
	// Ignore.
	down bool
}

// startTally starts both processes on the first variant and registers the
// webhook for the namespaces labelled selectorLabel.
func startTally(t *testing.T, admin kubernetes.Interface) *tally {
	t.Helper()
	tl := &tally{t: t, admin: admin}
	tl.writeConfig(t)
	tl.startWebhook(t)
	tl.startAggregator()
	tl.register(t)
	t.Cleanup(func() {
		_ = tl.webhook.Stop()
		_ = tl.aggregator.Stop()
	})
	return tl
}

func (tl *tally) configPath() string {
	return filepath.Join(dir, "config-"+strconv.Itoa(tl.variant)+".yaml")
}

func (tl *tally) writeConfig(t *testing.T) {
	require.NoError(t, os.WriteFile(tl.configPath(), []byte(variants[tl.variant].config()), 0o600))
}

func (tl *tally) startWebhook(t *testing.T) {
	t.Helper()
	var err error
	tl.port, err = process.FreePort()
	require.NoError(t, err)
	tl.webhook, _ = framework.StartProcess(tl.t, bin, "webhook", "--config", tl.configPath(), "--kubeconfig", filepath.Join(dir, "admin.kubeconfig"),
		"--cert-dir", dir, "--host", "127.0.0.1", "--port", strconv.Itoa(tl.port), "--metrics-bind-address", "0", "--shutdown-delay", "0s")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, framework.WaitForTLS(ctx, "127.0.0.1", tl.port, ca.CertPEM))
}

func (tl *tally) startAggregator() {
	tl.aggregator, _ = framework.StartProcess(tl.t, bin, "aggregator", "--config", tl.configPath(), "--kubeconfig", filepath.Join(dir, "aggregator.kubeconfig"),
		"--backfill-interval", "1s", "--metrics-bind-address", "0")
}

// register creates or updates the webhook's registration, as the chart
// renders it for the variant. While the webhook is down, it names a port
// nothing listens on, under failurePolicy Ignore: the API server takes
// both at once, so that no request fails.
func (tl *tally) register(t *testing.T) {
	t.Helper()
	cfg, err := config.Parse([]byte(variants[tl.variant].config()))
	require.NoError(t, err)
	port := tl.port
	if tl.down {
		port, err = process.FreePort()
		require.NoError(t, err)
	}
	wh := mutate.Webhook(cfg, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path)), CABundle: ca.CertPEM,
	}, helm.AggregatorUser)
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{selectorLabel: "true"}}
	if tl.down {
		wh.FailurePolicy = ptr.To(admissionregistrationv1.Ignore)
	}
	ctx := context.Background()
	regs := tl.admin.AdmissionregistrationV1().MutatingWebhookConfigurations()
	mwc, err := regs.Get(ctx, "tally-contract", metav1.GetOptions{})
	if err != nil {
		_, err = regs.Create(ctx, &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "tally-contract"},
			Webhooks: []admissionregistrationv1.MutatingWebhook{wh}}, metav1.CreateOptions{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = regs.Delete(context.Background(), "tally-contract", metav1.DeleteOptions{}) })
		return
	}
	mwc.Webhooks = []admissionregistrationv1.MutatingWebhook{wh}
	_, err = regs.Update(ctx, mwc, metav1.UpdateOptions{})
	require.NoError(t, err)
}

// span is a stretch of a namespace's history during which tally saw its
// pods: versions with from < resourceVersion <= to were admitted, when
// through the pods resource, by the webhook under variant.
type span struct {
	from, to uint64
	variant  int
}

// views records when tally saw a sequence's namespace. Between two spans
// (a namespace out of the webhook's scope, an outage under Ignore, a
// configuration being changed, and the time the API server takes to follow
// each), tally did not see its pods, or cannot be told to have.
type views struct {
	spans []span
}

// at returns the variant under which tally saw the version rv, and false
// when it did not.
func (vs *views) at(rv string) (int, bool) {
	n, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		return 0, false
	}
	for _, s := range vs.spans {
		if n > s.from && n <= s.to {
			return s.variant, true
		}
	}
	return 0, false
}

func (vs *views) open() bool {
	return len(vs.spans) > 0 && vs.spans[len(vs.spans)-1].to == math.MaxUint64
}

// begin opens a span after version from.
func (vs *views) begin(from uint64, variant int) {
	vs.spans = append(vs.spans, span{from: from, to: math.MaxUint64, variant: variant})
}

// end closes the open span at version to.
func (vs *views) end(to uint64) {
	if vs.open() {
		vs.spans[len(vs.spans)-1].to = to
	}
}

// scene is what a sequence changes about tally's view of its namespace.
type scene struct {
	t     *testing.T
	tally *tally
	ns    string
	views views
	// out: the namespace is out of the webhook's scope.
	out bool
	// gap counts down the steps left before the namespace is in scope
	// again or the outage ends.
	gap int
}

// now returns the API server's current resourceVersion, read consistently.
func (s *scene) now(ctx context.Context) uint64 {
	list, err := s.tally.admin.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{Limit: 1})
	require.NoError(s.t, err)
	n, err := strconv.ParseUint(list.ResourceVersion, 10, 64)
	require.NoError(s.t, err)
	return n
}

// seen reports whether tally sees a request about the namespace's pods
// now: a dry-run CREATE of an ownerless pod carrying a stamp, which the
// webhook removes. ok is false when the request failed.
func (s *scene) seen(ctx context.Context) (seen, ok bool) {
	probe := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "view-probe", Annotations: map[string]string{intentAtKey: "2001-01-01T00:00:00Z"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}
	got, err := s.tally.admin.CoreV1().Pods(s.ns).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err != nil {
		return false, false
	}
	_, kept := got.Annotations[intentAtKey]
	return !kept, true
}

// await waits until tally sees the namespace's pods or not, as want says.
func (s *scene) await(ctx context.Context, want bool, what string) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if seen, ok := s.seen(ctx); ok && seen == want {
			return
		}
		require.True(s.t, time.Now().Before(deadline), "the API server did not follow within 30s: %s", what)
		time.Sleep(20 * time.Millisecond)
	}
}

// start opens a span, once the registration has taken effect and, when
// owners are not verified, the webhook has found WorkerPool served for its
// totals (it adds the tracking finalizer only then).
func (s *scene) start(ctx context.Context) {
	s.await(ctx, true, "the namespace in scope")
	if !variants[s.tally.variant].verifyOwner {
		deadline := time.Now().Add(30 * time.Second)
		for {
			probe := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "totals-probe", OwnerReferences: []metav1.OwnerReference{withController(owners[0])}},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}
			got, err := s.tally.admin.CoreV1().Pods(s.ns).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			if err == nil && slices.Contains(got.Finalizers, trackingKey) {
				break
			}
			require.True(s.t, time.Now().Before(deadline), "the webhook did not find WorkerPool served for its totals within 30s")
			time.Sleep(20 * time.Millisecond)
		}
	}
	s.views.begin(s.now(ctx), s.tally.variant)
}

// resume opens a span when tally sees the namespace again: the API server
// calls a webhook only through the registration written last, as only
// that one names a port a webhook listens on.
func (s *scene) resume(ctx context.Context) {
	if s.out || s.tally.down || s.views.open() {
		return
	}
	s.start(ctx)
}

// blind closes the open span, and waits until tally no longer sees the
// namespace.
func (s *scene) blind(ctx context.Context, to uint64, what string) {
	s.views.end(to)
	s.await(ctx, false, what)
}

// relabel moves the namespace out of the webhook's scope, or back in.
func (s *scene) relabel(ctx context.Context) string {
	nsObj, err := s.tally.admin.CoreV1().Namespaces().Get(ctx, s.ns, metav1.GetOptions{})
	require.NoError(s.t, err)
	s.out = !s.out
	if s.out {
		delete(nsObj.Labels, selectorLabel)
	} else {
		nsObj.Labels[selectorLabel] = "true"
	}
	updated, err := s.tally.admin.CoreV1().Namespaces().Update(ctx, nsObj, metav1.UpdateOptions{})
	require.NoError(s.t, err)
	if s.out {
		rv, err := strconv.ParseUint(updated.ResourceVersion, 10, 64)
		require.NoError(s.t, err)
		s.blind(ctx, rv-1, "the namespace out of scope")
		return "namespace labelled out of the webhook's scope"
	}
	s.resume(ctx)
	return "namespace labelled into the webhook's scope"
}

// down takes the webhook down under failurePolicy Ignore.
func (s *scene) down(ctx context.Context) {
	tl := s.tally
	tl.down = true
	to := s.now(ctx)
	tl.register(s.t)
	s.blind(ctx, to, "the webhook's outage under Ignore")
	require.NoError(s.t, tl.webhook.Stop())
}

// up starts the webhook again, on the variant, under failurePolicy Fail.
func (s *scene) up(ctx context.Context) {
	tl := s.tally
	tl.startWebhook(s.t)
	tl.down = false
	tl.register(s.t)
	s.resume(ctx)
}

// reconfigure restarts the webhook and the aggregator on variant v, with
// the webhook down in between.
func (s *scene) reconfigure(ctx context.Context, v int) string {
	tl := s.tally
	wasDown := tl.down
	if !wasDown {
		s.down(ctx)
	}
	require.NoError(s.t, tl.aggregator.Stop())
	tl.variant = v
	tl.writeConfig(s.t)
	tl.startAggregator()
	if !wasDown {
		s.up(ctx)
	}
	return "webhook and aggregator restarted on " + variants[v].name
}

// change draws one change of what tally sees, or ends a gap: a gap (the
// namespace out of scope, an outage) lasts a few steps.
func (s *scene) change(ctx context.Context, g *generator) string {
	if s.gap > 0 {
		if s.gap--; s.gap == 0 {
			if s.out {
				return s.relabel(ctx)
			}
			s.up(ctx)
			return "webhook up again, under failurePolicy Fail"
		}
		if g.chance(changeChance) {
			return s.reconfigure(ctx, (s.tally.variant+1+g.pick(len(variants)-1))%len(variants))
		}
		return ""
	}
	if !g.chance(changeChance) {
		return ""
	}
	switch g.pick(5) {
	case 0, 1:
		s.gap = 1 + g.pick(8)
		return s.relabel(ctx)
	case 2, 3:
		s.gap = 1 + g.pick(8)
		s.down(ctx)
		return "webhook down under failurePolicy Ignore"
	default:
		return s.reconfigure(ctx, (s.tally.variant+1+g.pick(len(variants)-1))%len(variants))
	}
}

// restore brings the namespace back into view under the first variant,
// and, after a gap, gives the aggregator's sweep time to judge what tally
// had not seen. It reports whether anything changed.
func (s *scene) restore(ctx context.Context) bool {
	changed := s.out || s.tally.down || s.tally.variant != 0
	if s.out {
		s.relabel(ctx)
	}
	if s.tally.down {
		s.up(ctx)
	}
	if s.tally.variant != 0 {
		s.reconfigure(ctx, 0)
	}
	s.gap = 0
	if len(s.views.spans) > 1 {
		// Sweeps run every second: wait until they have judged every pod
		// (the history's check says what is left otherwise).
		kinds := variants[s.tally.variant].kinds()
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			pods, err := s.tally.admin.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{})
			require.NoError(s.t, err)
			if !slices.ContainsFunc(pods.Items, func(p corev1.Pod) bool { return len(unjudged(kinds, &p)) > 0 }) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return changed
}
