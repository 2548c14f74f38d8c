// Package contract checks the pod metadata contract end to end: seeded
// random sequences of every request a client can send about a pod (CREATE,
// PUT with any resourceVersion, merge, strategic-merge and JSON patches,
// server-side apply, pods/status, pods/ephemeralcontainers, pods/binding,
// DELETE), decided by a real kube-apiserver with the chart's webhook
// registration, match conditions and admission policies, bin/webhook and
// bin/aggregator (whose sweep stamps what the webhook did not see). The
// sequences also change what tally sees: the namespace labelled out of the
// webhook's scope and back, the webhook down under failurePolicy Ignore,
// both processes restarted on another configuration (a kind removed from
// parents or added, verifyOwner on or off). The invariants are checked on
// the history the API server stored, as a watch delivered it: not against
// a model.
//
// make test runs a fixed set of seeds; make fuzz-e2e DURATION=30m runs new
// ones for that long, and make fuzz-e2e SEED=n runs one again.
package contract

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/test/framework"
)

var (
	env *framework.Env
	// bin holds bin/webhook; dir its configuration, certificate and
	// kubeconfig.
	bin, dir string
	ca       *devcert.CA
)

// selectorLabel selects the namespaces the fuzzer's registration admits.
const selectorLabel = "tally.dev/contract-fuzz"

// The environment that chooses what runs (make fuzz-e2e sets them).
const (
	seedEnv     = "TALLY_CONTRACT_SEED"
	durationEnv = "TALLY_CONTRACT_DURATION"
)

// fixedSeeds is how many seeds make test runs (1 to fixedSeeds, then
// foundSeeds), and steps how many requests each sequence sends.
const (
	fixedSeeds = 24
	steps      = 60
)

// changeChance is the chance that a step changes what tally sees instead of
// sending a request.
const changeChance = 0.04

// foundSeeds are the seeds of the longer runs that found something, each
// run again by make test.
var foundSeeds = []uint64{
	// A pods/status update that changed nothing was answered with the
	// version an earlier request had stored, and the fuzzer took it as
	// that update's (a bug of the fuzzer).
	1796397213967357865,
	// A pod failed, pods/status set it Running again, and an intent was
	// admitted on it: the policy on pods/status now keeps a finished pod
	// finished.
	1796397288372751896,
	// While the namespace was out of the webhook's scope, an invalid
	// intent was set on a stamped pod; once back in scope, an update
	// had it admitted and stamped (found on the code before first sight).
	1796557272052075578,
}

func TestMain(m *testing.M) {
	var err error
	if dir, err = os.MkdirTemp("", "tally-contract-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "bin")
	code := framework.Main(m, controlplane.Options{}, &env, func(e *framework.Env) error {
		if err := framework.BuildBinaries(bin, "webhook", "aggregator"); err != nil {
			return err
		}
		if ca, err = devcert.NewCA("tally contract CA", time.Hour); err != nil {
			return err
		}
		pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
		if err != nil {
			return err
		}
		if err := pair.WriteDir(dir); err != nil {
			return err
		}
		admin, err := e.AddUser(envtest.User{Name: "contract-admin", Groups: []string{"system:masters"}}, nil)
		if err != nil {
			return err
		}
		if err := controlplane.WriteKubeconfig(admin, filepath.Join(dir, "admin.kubeconfig")); err != nil {
			return err
		}
		aggregator, err := e.AggregatorIdentity()
		if err != nil {
			return err
		}
		if err := controlplane.WriteKubeconfig(aggregator, filepath.Join(dir, "aggregator.kubeconfig")); err != nil {
			return err
		}
		return helm.InstallPolicies(context.Background(), e.Client)
	})
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// TestContract runs the seeded sequences: one (TALLY_CONTRACT_SEED), new
// ones for a while (TALLY_CONTRACT_DURATION), or the fixed ones.
func TestContract(t *testing.T) {
	clients, tl := start(t)
	sequences, compared := 0, 0
	run := func(seed uint64) bool {
		sequences++
		return t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { sequence(t, clients, tl, seed, &compared) })
	}
	defer func() {
		t.Logf("%d sequences of %d requests; the model compared with the API server on %d of them", sequences, steps, compared)
		if sequences > 0 && compared == 0 {
			t.Error("the model was compared with the API server on no request")
		}
	}()
	switch {
	case os.Getenv(seedEnv) != "":
		seed, err := strconv.ParseUint(os.Getenv(seedEnv), 10, 64)
		require.NoError(t, err, "$%s", seedEnv)
		run(seed)
	case os.Getenv(durationEnv) != "":
		d, err := time.ParseDuration(os.Getenv(durationEnv))
		require.NoError(t, err, "$%s", durationEnv)
		end, seed := time.Now().Add(d), uint64(time.Now().UnixNano())
		t.Logf("from seed %d for %s", seed, d)
		for time.Now().Before(end) && run(seed) {
			seed++
		}
	default:
		for seed := uint64(1); seed <= fixedSeeds; seed++ {
			run(seed)
		}
		for _, seed := range foundSeeds {
			run(seed)
		}
	}
}

// start runs bin/webhook and bin/aggregator, registers the webhook as the
// chart does, for the namespaces labelled selectorLabel, and returns a
// client per user.
func start(t *testing.T) (map[string]kubernetes.Interface, *tally) {
	t.Helper()
	ctx := context.Background()
	var err error
	clients := map[string]kubernetes.Interface{}
	for _, user := range append([]string{""}, users...) {
		rc := rest.CopyConfig(env.Config)
		if user != "" {
			rc.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:masters", "system:authenticated"}}
		}
		rc.QPS, rc.Burst = -1, 0
		rc.WarningHandler = rest.NoWarnings{}
		clients[user], err = kubernetes.NewForConfig(rc)
		require.NoError(t, err)
	}
	tl := startTally(t, clients[""])

	// The API server picks the registration up asynchronously, and the
	// webhook adds the tracking finalizer once it has found the kind
	// served for its totals.
	ns := namespace(t, clients[""])
	require.Eventually(t, func() bool {
		probe := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "probe", OwnerReferences: []metav1.OwnerReference{withController(owners[0])}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}
		got, err := clients[""].CoreV1().Pods(ns).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil && got.Labels[parentUIDLabel] != "" && len(got.Finalizers) == 1
	}, 30*time.Second, 100*time.Millisecond, "the webhook registration never took effect")

	// The API server loads the chart's policies asynchronously too: wait
	// until each refuses what it must, on a pod tally does not track.
	probe, err := clients[""].CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "policy-probe"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	dryRun := metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}}
	require.Eventually(t, func() bool {
		tracking := probe.DeepCopy()
		tracking.Finalizers = []string{trackingKey}
		_, err := clients[""].CoreV1().Pods(ns).Update(ctx, tracking, dryRun)
		return apierrors.IsInvalid(err) || apierrors.IsForbidden(err)
	}, 30*time.Second, 100*time.Millisecond, "the policy on the tracking finalizer never took effect")
	require.Eventually(t, func() bool {
		labelled := probe.DeepCopy()
		labelled.Labels = map[string]string{parentUIDLabel: "forged"}
		_, err := clients[""].CoreV1().Pods(ns).UpdateStatus(ctx, labelled, dryRun)
		return apierrors.IsInvalid(err) || apierrors.IsForbidden(err)
	}, 30*time.Second, 100*time.Millisecond, "the policy on pods/status and pods/binding never took effect")
	return clients, tl
}

func withController(ref metav1.OwnerReference) metav1.OwnerReference {
	ref.Controller = ptr.To(true)
	return ref
}

func namespace(t *testing.T, c kubernetes.Interface) string {
	t.Helper()
	ns, err := c.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		GenerateName: "contract-", Labels: map[string]string{selectorLabel: "true"}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return ns.Name
}

// sequence sends the requests seed draws, records the stored history
// with a watch, and checks the invariants on it.
func sequence(t *testing.T, clients map[string]kubernetes.Interface, tl *tally, seed uint64, compared *int) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	admin := clients[""]
	ns := namespace(t, admin)
	defer func() { _ = admin.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) }()
	sc := &scene{t: t, tally: tl, ns: ns}
	sc.start(ctx)

	list, err := admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	w, err := admin.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	require.NoError(t, err)
	defer w.Stop()
	rec := &recorder{}
	go rec.record(w)

	h := &history{views: &sc.views, requests: map[string]sent{}, start: time.Now()}
	models := make([]model, len(variants))
	for i, v := range variants {
		models[i] = model{Contract: v.contract(t), compared: compared}
	}
	gen := &generator{rng: newRand(seed), ns: ns, pods: []string{"p0", "p1", "p2"}, read: func(ctx context.Context, name string) *corev1.Pod {
		pod, err := admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil
		}
		return pod
	}}
	var log []string
	// answered are the requests sent while tally saw the namespace, for
	// the model.
	var answered []answer
	for step := range steps {
		if did := sc.change(ctx, gen); did != "" {
			log = append(log, fmt.Sprintf("%2d %s", step, did))
			continue
		}
		r := gen.next(ctx, step)
		inView, variant := sc.views.open(), tl.variant
		// The versions stored between from and to are this request's, or
		// the aggregator's.
		from := sc.now(ctx)
		before := time.Now()
		pod, err := r.send(ctx, clients[r.user])
		after := time.Now()
		to := sc.now(ctx)
		outcome := "ok"
		if err != nil {
			outcome = outcomeOf(err)
		}
		log = append(log, fmt.Sprintf("%2d %s %s by %s: %s", step, r.pod, outcome, r.user, r.what))
		if webhookFailed(err) {
			t.Fatalf("seed %d: the webhook call failed: %v\n%s\nreproduce: make fuzz-e2e SEED=%d", seed, err, strings.Join(log, "\n"), seed)
		}
		answered = append(answered, answer{r: r, err: err, before: before, after: after, variant: variant, inView: inView, pod: pod, from: from, to: to})
	}
	if sc.restore(ctx) {
		log = append(log, "   view restored: the first configuration, the namespace in scope, the webhook up")
	}
	// A sentinel pod, created last: once the watch delivers it, it has
	// delivered every version before it.
	sentinel, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "zz-sentinel"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	h.versions = rec.until(t, sentinel.UID, 30*time.Second)
	for _, a := range answered {
		if h.stored(a) {
			h.requests[a.pod.ResourceVersion] = sent{step: a.r.step, user: a.r.user, what: a.r.what, before: a.before, after: a.after, main: a.r.main}
		}
	}
	// disagreement is the first request on which the model and the API
	// server disagree.
	disagreement := ""
	for _, a := range answered {
		if !a.inView || h.raced(a) {
			continue
		}
		if differs := models[a.variant].disagrees(a.r, a.pod, a.err, a.before, a.after); differs != "" {
			disagreement = fmt.Sprintf("at step %d: %s (stored versions of %s: %s)", a.r.step, differs, a.r.pod, h.describe(a.r.pod))
			break
		}
	}

	if found := h.check(); len(found) > 0 {
		lines := make([]string, len(found))
		for i, v := range found {
			lines[i] = v.String()
		}
		if disagreement != "" {
			lines = append(lines, "(and the model disagrees with the API server "+disagreement+")")
		}
		t.Fatalf("seed %d: %d violations of the contract:\n  %s\nthe requests:\n%s\nreproduce: make fuzz-e2e SEED=%d",
			seed, len(found), strings.Join(lines, "\n  "), strings.Join(log, "\n"), seed)
	}
	// The history keeps the contract: a model that says otherwise is
	// wrong, or the fuzzer's reading of a request is.
	if disagreement != "" {
		t.Fatalf("seed %d: the model disagrees with the API server on a history that keeps every invariant (a bug of the test's model or of its reading of the request) %s\nthe requests:\n%s\nreproduce: make fuzz-e2e SEED=%d",
			seed, disagreement, strings.Join(log, "\n"), seed)
	}
	if testing.Verbose() {
		t.Logf("seed %d: %d versions of %d requests, views %v:\n%s", seed, len(h.versions), steps, sc.views.spans, strings.Join(log, "\n"))
	}
}

// model runs the contract's model (internal/truth) beside the API server,
// for the requests sent while tally saw them, and counts the requests it
// compared.
type model struct {
	truth.Contract
	compared *int
}

// disagrees returns how the API server's answer to r (the pod it stored,
// or its error) differs from what the model says of r, or "" when they
// agree or the model is silent: r is not one it reads, or the API server
// refused r as invalid (its own validation, which the model leaves out).
func (m model) disagrees(r request, pod *corev1.Pod, err error, before, after time.Time) string {
	if r.asked == nil {
		return ""
	}
	var stored *truth.Pod
	if r.stored != nil {
		stored = truth.PodOf(r.stored)
	}
	want := m.Admit(r.op, stored, truth.PodOf(r.asked), r.user, before)
	switch {
	case apierrors.IsInvalid(err) || apierrors.IsBadRequest(err):
		return ""
	}
	*m.compared++
	switch {
	case want.Conflict:
		if !apierrors.IsConflict(err) {
			return fmt.Sprintf("a stale update: the model says 409 Conflict, the API server %s", answerOf(err))
		}
		return ""
	case want.Denied:
		if !apierrors.IsForbidden(err) {
			return fmt.Sprintf("the model refuses the request (403), the API server %s", answerOf(err))
		}
		return ""
	case err != nil:
		return fmt.Sprintf("the model admits the request, the API server %s", answerOf(err))
	}
	got, tracking := truth.Keys(truth.PodOf(pod))
	// A stamp of now is the webhook's clock's, within the request.
	at := "annotation:" + intentAtKey
	if want.Keys[at] == before.UTC().Format(time.RFC3339) {
		if t, err := time.Parse(time.RFC3339, got[at]); err == nil && !t.Before(before.Truncate(time.Second)) && !t.After(after) {
			want.Keys[at] = got[at]
		}
	}
	if !mapsEqual(want.Keys, got) || want.Tracking != tracking {
		return fmt.Sprintf("tally's keys: the model says %v (tracking finalizer %t), the API server stored %v (%t)", want.Keys, want.Tracking, got, tracking)
	}
	return ""
}

// answer is a request sent while tally saw the namespace, and what the API
// server answered.
type answer struct {
	r             request
	pod           *corev1.Pod
	err           error
	before, after time.Time
	variant       int
	// inView: tally saw the namespace when the request was sent.
	inView bool
	// from and to are the API server's resourceVersion before the
	// request was sent, and once it had answered.
	from, to uint64
}

// stored reports whether the version that answered a is a's own: a
// request that changes nothing is answered with the version stored last,
// one stored before it, or, when the aggregator wrote in between, the
// aggregator's.
func (h *history) stored(a answer) bool {
	if a.err != nil || a.pod == nil {
		return false
	}
	rv, err := strconv.ParseUint(a.pod.ResourceVersion, 10, 64)
	if err != nil || rv <= a.from {
		return false
	}
	return a.r.stored == nil || h.before(a.pod) != a.r.stored.ResourceVersion || !notOwn(a.r, a.pod)
}

// before returns the resourceVersion of the version of pod stored before
// it, "" when none was.
func (h *history) before(pod *corev1.Pod) string {
	prev := ""
	for _, v := range h.versions {
		if v.pod.UID != pod.UID {
			continue
		}
		if v.pod.ResourceVersion == pod.ResourceVersion {
			return prev
		}
		prev = v.pod.ResourceVersion
	}
	return prev
}

// notOwn reports whether the version pod, stored right after the version r
// was built on, may not be r's own: r asked for the pod as it was read, or
// the version's finalizers differ from the read while r asked for the same
// (the webhook changes no finalizer on UPDATE: the aggregator added or
// released the tracking finalizer, and r changed nothing after the
// webhook).
func notOwn(r request, pod *corev1.Pod) bool {
	if asksNothing(r) {
		return true
	}
	return r.op == "UPDATE" && r.asked != nil && slices.Equal(r.asked.Finalizers, r.stored.Finalizers) && !slices.Equal(pod.Finalizers, r.stored.Finalizers)
}

// asksNothing reports whether r asks for the pod as it was read.
func asksNothing(r request) bool {
	if r.stored == nil || r.asked == nil {
		return false
	}
	stored, asked := r.stored.ObjectMeta.DeepCopy(), r.asked.ObjectMeta.DeepCopy()
	stored.ResourceVersion, asked.ResourceVersion = "", ""
	return equality.Semantic.DeepEqual(stored, asked) && equality.Semantic.DeepEqual(r.stored.Spec, r.asked.Spec)
}

// raced reports whether the aggregator changed the pod of a's request
// between the read the request was built on and the request: the model,
// given the pod as read, cannot say what the API server made of it.
func (h *history) raced(a answer) bool {
	if a.r.stored == nil {
		return false
	}
	if a.err == nil && a.pod != nil && a.pod.ResourceVersion != a.r.stored.ResourceVersion && !h.stored(a) {
		// Answered with a version it may not have stored.
		return true
	}
	from, err := strconv.ParseUint(a.r.stored.ResourceVersion, 10, 64)
	if err != nil {
		return true
	}
	// Before the version the request stored, or, when it stored none, up
	// to the API server's version once it had answered.
	to := a.to + 1
	if a.err == nil && a.pod != nil {
		to, _ = strconv.ParseUint(a.pod.ResourceVersion, 10, 64)
	}
	for _, v := range h.versions {
		n, err := strconv.ParseUint(v.pod.ResourceVersion, 10, 64)
		if err != nil || v.pod.UID != a.r.stored.UID || n <= from || n >= to {
			continue
		}
		if _, byFuzzer := h.requests[v.pod.ResourceVersion]; !byFuzzer {
			return true
		}
	}
	return false
}

// describe lists the versions of the pods named name, and who stored each.
func (h *history) describe(name string) string {
	var out []string
	for _, v := range h.versions {
		if v.pod.Name == name {
			by := "tally or a deletion"
			if req, ok := h.requests[v.pod.ResourceVersion]; ok {
				by = fmt.Sprintf("step %d", req.step)
			}
			out = append(out, fmt.Sprintf("%s by %s (finalizers %v, deleting %t)", v.pod.ResourceVersion, by, v.pod.Finalizers, v.pod.DeletionTimestamp != nil))
		}
	}
	return strings.Join(out, ", ")
}

func answerOf(err error) string {
	if err == nil {
		return "stored it"
	}
	return "answered " + outcomeOf(err)
}

// outcomeOf names an error as the API server reported it.
func outcomeOf(err error) string {
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		s := status.Status()
		msg := s.Message
		if len(msg) > 160 {
			msg = msg[:160] + "…"
		}
		return fmt.Sprintf("%d %s (%s)", s.Code, s.Reason, msg)
	}
	return err.Error()
}

// webhookFailed reports whether err says that the API server could not get
// an answer from the webhook: under failurePolicy Fail, a pod request lost.
func webhookFailed(err error) bool {
	return err != nil && strings.Contains(err.Error(), "failed calling webhook")
}

// recorder keeps every event a pod watch delivers.
type recorder struct {
	mu       sync.Mutex
	versions []version
	closed   bool
}

func (r *recorder) record(w watch.Interface) {
	for ev := range w.ResultChan() {
		pod, ok := ev.Object.(*corev1.Pod)
		if !ok {
			continue
		}
		r.mu.Lock()
		r.versions = append(r.versions, version{pod: pod, deleted: ev.Type == watch.Deleted})
		r.mu.Unlock()
	}
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
}

// until waits for the version of the sentinel pod and returns every
// version before it.
func (r *recorder) until(t *testing.T, sentinel types.UID, timeout time.Duration) []version {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		for i, v := range r.versions {
			if v.pod.UID == sentinel {
				out := append([]version(nil), r.versions[:i]...)
				r.mu.Unlock()
				return out
			}
		}
		closed := r.closed
		r.mu.Unlock()
		if closed {
			t.Fatal("the pod watch closed before it delivered the whole history")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the pod watch did not deliver the sentinel within %s", timeout)
	return nil
}

// newRand returns the random source of a seed.
func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }
