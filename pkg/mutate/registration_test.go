package mutate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	authnuser "k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/cel/environment"
	"k8s.io/utils/ptr"

	tallyversion "tally.dev/tally/internal/version"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/keys"
)

// oldestAPIServer is the oldest Kubernetes version tally supports (and the
// chart installs on): the conditions must compile in the environment it
// validates new expressions with.
var oldestAPIServer = version.MustParseGeneric(tallyversion.MinKubernetes)

// apiServerMatcher compiles the registration's pod conditions with the API
// server's own CEL library, as it does for a mutating webhook.
type apiServerMatcher struct {
	filter  plugincel.ConditionEvaluator
	matcher matchconditions.Matcher
}

func compileConditions(t testing.TB, conds []admissionregistrationv1.MatchCondition) apiServerMatcher {
	t.Helper()
	accessors := make([]plugincel.ExpressionAccessor, len(conds))
	for i, c := range conds {
		accessors[i] = &matchconditions.MatchCondition{Name: c.Name, Expression: c.Expression}
	}
	decls := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	// Registration validates with the oldest supported API server's
	// environment for new expressions.
	oldest := plugincel.NewCompiler(environment.MustBaseEnvSet(oldestAPIServer))
	for _, a := range accessors {
		res := oldest.CompileCELExpression(a, decls, environment.NewExpressions)
		require.Nil(t, res.Error, "match condition %s must compile on Kubernetes %s:\n%s", a.(*matchconditions.MatchCondition).Name, oldestAPIServer, a.GetExpression())
	}
	filter := plugincel.NewConditionCompiler(environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion())).
		CompileCondition(accessors, decls, environment.StoredExpressions)
	fail := admissionregistrationv1.Fail
	return apiServerMatcher{filter: filter, matcher: matchconditions.NewMatcher(filter, &fail, "webhook", "admit", "pods.tally.dev")}
}

func podFrom(m *PodMeta) *corev1.Pod {
	if m == nil {
		return nil
	}
	return &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{
			Name: "p", Namespace: "ns", ResourceVersion: m.ResourceVersion,
			Labels: m.Labels, Annotations: m.Annotations, OwnerReferences: m.OwnerReferences, Finalizers: m.Finalizers,
		},
	}
}

func (a apiServerMatcher) attributes(in Input) *admission.VersionedAttributes {
	podGVK := schema.GroupVersionKind{Version: "v1", Kind: "Pod"}
	pod, old := podFrom(in.Pod), podFrom(in.Old)
	attrs := &admission.VersionedAttributes{VersionedKind: podGVK, VersionedObject: admission.NewLazyObject(pod)}
	var oldObj runtime.Object
	if old != nil {
		oldObj = old
		attrs.VersionedOldObject = admission.NewLazyObject(old)
	}
	attrs.Attributes = admission.NewAttributesRecord(pod, oldObj, podGVK, "ns", "p",
		schema.GroupVersionResource{Version: "v1", Resource: "pods"}, "", admission.Operation(in.Operation), nil, false,
		&authnuser.DefaultInfo{Name: in.User})
	return attrs
}

// calls reports whether the API server would call the webhook for in.
func (a apiServerMatcher) calls(t testing.TB, in Input) bool {
	t.Helper()
	res := a.matcher.Match(context.Background(), a.attributes(in), nil, nil)
	require.NoError(t, res.Error, "a match condition failed to evaluate, which refuses the request under failurePolicy Fail")
	return res.Matches
}

// cost returns the CEL cost of evaluating the conditions on in.
func (a apiServerMatcher) cost(t testing.TB, in Input) int64 {
	t.Helper()
	attrs := a.attributes(in)
	results, remaining, err := a.filter.ForInput(context.Background(), attrs,
		plugincel.CreateAdmissionRequest(attrs.Attributes, metav1.GroupVersionResource{Version: "v1", Resource: "pods"}, metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}),
		plugincel.OptionalVariableBindings{}, nil, celconfig.RuntimeCELCostBudgetMatchConditions)
	require.NoError(t, err)
	for _, r := range results {
		require.NoError(t, r.Error)
	}
	return celconfig.RuntimeCELCostBudgetMatchConditions - remaining
}

var (
	poolKind = config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}
	rcKind   = config.Parent{Version: "v1", Kind: "ReplicationController"}
	jobKind  = config.Parent{Group: "batch", Version: "v1", Kind: "Job", Counts: map[config.Count]string{config.CompletedTotal: "status.completedTotal"}, Ledger: "status.ledger"}
)

func controllerRef(apiVersion, kind, name string, uid types.UID) metav1.OwnerReference {
	return metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: uid, Controller: ptr.To(true)}
}

// prestamped returns a pod controlled by ref and stamped by its operator.
func prestamped(ref metav1.OwnerReference, finalizers ...string) *PodMeta {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{OwnerReferences: []metav1.OwnerReference{ref}, Finalizers: finalizers,
		Labels: map[string]string{"app": "worker"}, Annotations: map[string]string{"note": "x"}}}
	identity.Stamp(pod)
	return &PodMeta{Namespace: "ns", ResourceVersion: "7", Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, Finalizers: pod.Finalizers}
}

func with(m *PodMeta, change func(*PodMeta)) *PodMeta {
	c := *m
	c.Labels, c.Annotations = copyMap(m.Labels), copyMap(m.Annotations)
	c.OwnerReferences = append([]metav1.OwnerReference(nil), m.OwnerReferences...)
	c.Finalizers = append([]string(nil), m.Finalizers...)
	change(&c)
	return &c
}

func copyMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// TestMatchConditionsSkipOnlyNoOps: the requests the registration keeps
// from the webhook, evaluated by the API server's CEL library, are ones the
// webhook would answer "allowed, no patch, no warning"; and the ones it
// exists to save (pods their operator stamped, updates that leave tally's
// keys alone) are skipped.
func TestMatchConditionsSkipOnlyNoOps(t *testing.T) {
	pool := controllerRef("example.tally.dev/v1", "WorkerPool", "pool-a", uid)
	job := controllerRef("batch/v1", "Job", "job-a", uid)
	rc := controllerRef("v1", "ReplicationController", "rc-a", uid)
	long := controllerRef("example.tally.dev/v1", "WorkerPool", strings.Repeat("a", 64), uid)
	marked := with(prestamped(pool), func(m *PodMeta) {
		m.Annotations[keys.CompletionIntent] = "scale-down"
		m.Annotations[keys.CompletionIntentAt] = stamp
		m.Annotations[keys.CompletionIntentBy] = user
	})
	cases := []struct {
		name        string
		cfg         config.Config
		in          Input
		wantCalled  bool
		wantNoticed string
	}{
		{name: "a pod its operator stamped is not sent", in: Input{Operation: Create, Pod: prestamped(pool)}},
		{name: "a core-group parent's stamped pod is not sent", in: Input{Operation: Create, Pod: prestamped(rc)}},
		{name: "a parent whose name is no label value: stamped without the name label", in: Input{Operation: Create, Pod: prestamped(long)}},
		{name: "a label-only update of a stamped pod is not sent", in: Input{Operation: Update, Old: prestamped(pool), Pod: with(prestamped(pool), func(m *PodMeta) { m.Labels["app"] = "other" })}},
		{name: "an update of a marked pod that keeps its intent and stamps is not sent", in: Input{Operation: Update, Old: marked, Pod: with(marked, func(m *PodMeta) { m.Labels["ready"] = "yes" })}},
		{name: "an unrelated pod is not sent", in: Input{Operation: Create, Pod: &PodMeta{Labels: map[string]string{"app": "web"}}}},

		{name: "an unstamped pod is sent", in: Input{Operation: Create, Pod: &PodMeta{OwnerReferences: []metav1.OwnerReference{pool}}}, wantCalled: true},
		{name: "a forged parent-uid is sent", in: Input{Operation: Create, Pod: with(prestamped(pool), func(m *PodMeta) { m.Labels[keys.ParentUID] = "forged" })}, wantCalled: true},
		{name: "a forged parent annotation is sent", in: Input{Operation: Create, Pod: with(prestamped(pool), func(m *PodMeta) { m.Annotations[keys.Parent] = "WorkerPool/pool-a" })}, wantCalled: true},
		{name: "a name label on a parent whose name is no label value is sent", in: Input{Operation: Create, Pod: with(prestamped(long), func(m *PodMeta) { m.Labels[keys.ParentName] = long.Name })}, wantCalled: true},
		{name: "an intent on CREATE is sent (it must be stamped)", in: Input{Operation: Create, Pod: marked}, wantCalled: true},
		{name: "a kind with totals: a pod without the finalizer is sent", cfg: config.Config{Parents: []config.Parent{jobKind}}, in: Input{Operation: Create, Pod: prestamped(job)}, wantCalled: true},
		{name: "a kind with totals: a pod that carries the finalizer is not sent", cfg: config.Config{Parents: []config.Parent{jobKind}}, in: Input{Operation: Create, Pod: prestamped(job, keys.TrackingFinalizer)}},
		{name: "verifyOwner: every CREATE is sent", cfg: config.Config{VerifyOwner: true}, in: Input{Operation: Create, Pod: prestamped(pool)}, wantCalled: true},
		{name: "verifyOwner: an update of a pod stamped before is not sent", cfg: config.Config{VerifyOwner: true}, in: Input{Operation: Update, Old: prestamped(pool), Pod: with(prestamped(pool), func(m *PodMeta) { m.Labels["app"] = "other" })}},
		{name: "verifyOwner: an update that stamps a pod is sent", cfg: config.Config{VerifyOwner: true}, in: Input{Operation: Update, Old: &PodMeta{OwnerReferences: []metav1.OwnerReference{pool}}, Pod: prestamped(pool)}, wantCalled: true},
		{name: "an update that sets an intent is sent", in: Input{Operation: Update, Old: prestamped(pool), Pod: with(prestamped(pool), func(m *PodMeta) { m.Annotations[keys.CompletionIntent] = "scale-down" })}, wantCalled: true},
		{name: "an update that removes an intent is sent (and refused)", in: Input{Operation: Update, Old: marked, Pod: prestamped(pool)}, wantCalled: true},
		{name: "an update that forges the intent's stamp is sent", in: Input{Operation: Update, Old: marked, Pod: with(marked, func(m *PodMeta) { m.Annotations[keys.CompletionIntentBy] = "me" })}, wantCalled: true},
		{name: "an update that removes the identity is sent", in: Input{Operation: Update, Old: prestamped(pool), Pod: with(prestamped(pool), func(m *PodMeta) { delete(m.Labels, keys.ParentUID) })}, wantCalled: true},
		{name: "two controllers are sent", in: Input{Operation: Create, Pod: with(prestamped(pool), func(m *PodMeta) { m.OwnerReferences = append(m.OwnerReferences, rc) })}, wantCalled: true},
		{name: "a pod of an untracked kind with tally keys is sent", in: Input{Operation: Create, Pod: with(prestamped(controllerRef("apps/v1", "ReplicaSet", "rs", uid)), func(*PodMeta) {})}, wantCalled: true},
		{name: "an update that removes the controller and every tally key of a marked pod is sent (and refused)",
			in: Input{Operation: Update, Old: marked, Pod: &PodMeta{Labels: map[string]string{"app": "w"}}}, wantCalled: true},
		{name: "an update that makes a pod carrying an unadmitted intent tracked is sent (its stamps are tally's to write)",
			in: Input{Operation: Update,
				Old: &PodMeta{OwnerReferences: []metav1.OwnerReference{{APIVersion: pool.APIVersion, Kind: pool.Kind, Name: pool.Name, UID: pool.UID}},
					Annotations: map[string]string{keys.CompletionIntent: "scale-down"}},
				Pod: with(marked, func(m *PodMeta) { m.Annotations[keys.CompletionIntentAt] = "2001-01-01T00:00:00Z" })}, wantCalled: true},
		{name: "an apiVersion \"/v1\" names no group, not the core group: an unstamped pod is not sent, and not tracked",
			in: Input{Operation: Create, Pod: &PodMeta{OwnerReferences: []metav1.OwnerReference{controllerRef("/v1", "ReplicationController", "rc-a", uid)}}}},
		{name: "a version of the group with a '/' in it is another group: sent", in: Input{Operation: Create, Pod: prestamped(controllerRef("example.tally.dev/x/v1", "WorkerPool", "pool-a", uid))}, wantCalled: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			if cfg.Parents == nil {
				cfg.Parents = []config.Parent{poolKind, rcKind}
			}
			m := compileConditions(t, MatchConditions(&cfg))
			tc.in.User, tc.in.Now = user, now
			called := m.calls(t, tc.in)
			assert.Equal(t, tc.wantCalled, called)
			if !called {
				assertNoOp(t, &cfg, tc.in, func(schema.GroupKind) bool { return true })
			}
		})
	}
}

// assertNoOp checks that the webhook would allow in with no patch and no
// warning, without asking for the owner.
func assertNoOp(t testing.TB, cfg *config.Config, in Input, served func(schema.GroupKind) bool) {
	t.Helper()
	var checker OwnerChecker
	if cfg.VerifyOwner {
		checker = failingChecker{}
	}
	m := NewMutator(cfg.Parents, checker)
	m.AddTrackingWhen(served)
	d := m.Decide(context.Background(), in)
	assert.Equal(t, Decision{}, withoutParent(d), "the API server skipped a request the webhook would answer with %+v\nrequest: %s", d, describe(in))
}

// withoutParent drops Decision.Parent, which says what the pod carries, not
// what the webhook changes.
func withoutParent(d Decision) Decision {
	d.Parent = identity.Parent{}
	return d
}

func describe(in Input) string {
	return fmt.Sprintf("%s by %s\n  object: %+v\n  old:    %+v", in.Operation, in.User, in.Pod, in.Old)
}

// TestMatchConditionsAgreeWithDecide generates requests around the contract
// (stamped right, then perturbed: forged, missing or extra keys, intents,
// stamps, finalizers, owners of other kinds and versions) and checks that
// every request the conditions skip is one Decide leaves untouched.
func TestMatchConditionsAgreeWithDecide(t *testing.T) {
	configs := []config.Config{
		{Parents: []config.Parent{poolKind, rcKind}},
		{Parents: []config.Parent{poolKind, jobKind}},
		{Parents: []config.Parent{poolKind, rcKind, jobKind}, VerifyOwner: true},
	}
	rng := rand.New(rand.NewPCG(26, 1))
	const perConfig = 4000
	for _, cfg := range configs {
		m := compileConditions(t, MatchConditions(&cfg))
		skipped := map[Operation]int{}
		for range perConfig {
			in := randomRequest(rng)
			served := rng.IntN(2) == 0
			if !m.calls(t, in) {
				skipped[in.Operation]++
				assertNoOp(t, &cfg, in, func(schema.GroupKind) bool { return served })
			}
		}
		t.Logf("verifyOwner %t, %d kinds: of %d requests, skipped %d CREATEs and %d UPDATEs", cfg.VerifyOwner, len(cfg.Parents), perConfig, skipped[Create], skipped[Update])
		assert.NotZero(t, skipped[Update], "the generator must reach updates the conditions skip")
		if !cfg.VerifyOwner {
			assert.NotZero(t, skipped[Create], "the generator must reach creates the conditions skip")
		}
	}
}

func randomRequest(rng *rand.Rand) Input {
	pick := func(options ...string) string { return options[rng.IntN(len(options))] }
	refs := []metav1.OwnerReference{
		controllerRef("example.tally.dev/v1", "WorkerPool", "pool-a", uid),
		controllerRef("example.tally.dev/v2", "WorkerPool", "pool-b", "uid-b"),
		controllerRef("example.tally.dev/v1", "WorkerPool", strings.Repeat("p", 64), uid),
		controllerRef("example.tally.dev/v1", "WorkerPool", "Pool_A.", uid),
		controllerRef("other.dev/v1", "WorkerPool", "pool-a", uid),
		controllerRef("example.tally.dev/x/v1", "WorkerPool", "pool-a", uid),
		controllerRef("v1", "ReplicationController", "rc-a", uid),
		controllerRef("core/v1", "ReplicationController", "rc-a", uid),
		controllerRef("/v1", "ReplicationController", "rc-a", uid),
		controllerRef("batch/v1", "Job", "job-a", uid),
		controllerRef("apps/v1", "ReplicaSet", "rs-a", uid),
	}
	ref := refs[rng.IntN(len(refs))]
	pod := prestamped(ref)
	if rng.IntN(3) == 0 {
		pod.Finalizers = append(pod.Finalizers, pick(keys.TrackingFinalizer, "example.com/other"))
	}
	perturb := func(m *PodMeta) {
		for range rng.IntN(3) {
			switch rng.IntN(15) {
			case 0:
				m.Labels[keys.ParentUID] = pick("forged", "", string(uid), "uid-b")
			case 1:
				delete(m.Labels, keys.ParentUID)
			case 2:
				m.Labels[keys.ParentName] = pick("pool-a", "pool-b", strings.Repeat("p", 64), "")
			case 3:
				delete(m.Labels, keys.ParentName)
			case 4:
				m.Annotations[keys.Parent] = pick("WorkerPool.example.tally.dev/pool-a", "WorkerPool/pool-a", "ReplicationController/rc-a", "Job.batch/job-a", "")
			case 5:
				delete(m.Annotations, keys.Parent)
			case 6:
				m.Annotations[keys.CompletionIntent] = pick("scale-down", "drain", "Not A Token")
			case 7:
				m.Annotations[keys.CompletionIntentAt] = pick(stamp, now.Add(-time.Hour).Format(time.RFC3339), "yesterday")
			case 8:
				m.Annotations[keys.CompletionIntentBy] = pick(user, "someone-else", UnobservedRequester)
			case 9:
				m.OwnerReferences = append(m.OwnerReferences, refs[rng.IntN(len(refs))])
			case 10:
				if len(m.OwnerReferences) > 0 {
					m.OwnerReferences[0].Controller = pick2(rng, ptr.To(false), nil)
				}
			case 11:
				m.Labels["tally.dev/other"] = "x"
			case 12:
				m.OwnerReferences = nil
			case 13:
				delete(m.Annotations, keys.CompletionIntent)
			case 14:
				delete(m.Annotations, keys.CompletionIntentAt)
				delete(m.Annotations, keys.CompletionIntentBy)
			}
		}
	}
	perturb(pod)
	in := Input{Operation: Create, User: pick(user, "someone-else"), Pod: pod, Now: now}
	if rng.IntN(2) == 0 {
		in.Operation = Update
		old := with(pod, perturb)
		if rng.IntN(10) == 0 {
			old.ResourceVersion = "6"
		}
		// An update mostly changes something else than tally's keys.
		in.Old, in.Pod = old, with(old, func(m *PodMeta) {
			m.Labels["app"] = pick("worker", "other")
			if rng.IntN(3) == 0 {
				perturb(m)
			}
		})
	}
	return in
}

func pick2[T any](rng *rand.Rand, a, b T) T {
	if rng.IntN(2) == 0 {
		return a
	}
	return b
}

// TestMatchConditionsCost: the conditions stay far below the API server's
// CEL budgets (celconfig.PerCallLimit per expression; for all match
// conditions of a request, RuntimeCELCostBudgetMatchConditions) on a large
// realistic pod, and on one with a thousand owner references.
func TestMatchConditionsCost(t *testing.T) {
	cfg := config.Config{Parents: []config.Parent{poolKind, rcKind, jobKind}, VerifyOwner: true}
	m := compileConditions(t, MatchConditions(&cfg))
	big := prestamped(controllerRef("example.tally.dev/v1", "WorkerPool", "pool-a", uid))
	for i := range 200 {
		big.Labels[fmt.Sprintf("example.com/label-%d", i)] = "value"
		big.Annotations[fmt.Sprintf("example.com/annotation-%d", i)] = strings.Repeat("v", 100)
	}
	many := with(big, func(p *PodMeta) {
		for i := range 1000 {
			p.OwnerReferences = append(p.OwnerReferences, metav1.OwnerReference{APIVersion: "example.com/v1", Kind: "Thing", Name: fmt.Sprint(i), UID: types.UID(fmt.Sprint(i))})
		}
	})
	untracked := with(big, func(p *PodMeta) {
		p.OwnerReferences = nil
		for k := range p.Labels {
			if strings.HasPrefix(k, keys.Prefix) {
				delete(p.Labels, k)
			}
		}
		delete(p.Annotations, keys.Parent)
	})
	for _, tc := range []struct {
		name string
		in   Input
		max  int64
	}{
		{"a stamped pod with 200 labels and 200 annotations, UPDATE", Input{Operation: Update, Old: big, Pod: big, User: user}, celconfig.PerCallLimit / 100},
		{"the same pod with 1,000 owner references, UPDATE", Input{Operation: Update, Old: many, Pod: many, User: user}, celconfig.PerCallLimit / 10},
		{"a pod of no tracked kind with 200 labels and 200 annotations, UPDATE", Input{Operation: Update, Old: untracked, Pod: untracked, User: user}, celconfig.PerCallLimit / 100},
	} {
		cost := m.cost(t, tc.in)
		t.Logf("%s: CEL cost %d (per-call limit %d, per-request budget %d)", tc.name, cost, celconfig.PerCallLimit, celconfig.RuntimeCELCostBudgetMatchConditions)
		assert.Less(t, cost, tc.max, tc.name)
	}
}
