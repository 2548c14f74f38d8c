package mutate

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"

	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
)

// contractParents: a kind with totals (its pods get the finalizer) and a
// core kind without.
var contractParents = []config.Parent{
	{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool",
		Counts: map[config.Count]string{config.CompletedTotal: "status.completedTotal"}, Ledger: "status.ledger"},
	{Version: "v1", Kind: "ReplicationController"},
}

var contractOwners = []metav1.OwnerReference{
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "pool-a", UID: "uid-a"},
	{APIVersion: "example.tally.dev/v2", Kind: "WorkerPool", Name: "pool-b", UID: "uid-b"},
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: strings.Repeat("p", 64), UID: "uid-long"},
	{APIVersion: "v1", Kind: "ReplicationController", Name: "rc", UID: "uid-rc"},
	{APIVersion: "/v1", Kind: "ReplicationController", Name: "rc", UID: "uid-rc"},
	{APIVersion: "other.dev/v1", Kind: "WorkerPool", Name: "pool-a", UID: "uid-a"},
	{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", UID: "uid-rs"},
}

// harness is what every sequence uses, built once: the chart's match
// conditions compiled, the mutator and the contract, for contractParents.
type harness struct {
	matcher apiServerMatcher
	mutator *Mutator
	model   truth.Contract
}

func newHarness(t testing.TB) *harness {
	cfg := config.Config{Parents: contractParents}
	h := &harness{matcher: compileConditions(t, MatchConditions(&cfg)), mutator: NewMutator(cfg.Parents, nil),
		model: truth.NewContract(cfg.Parents)}
	h.mutator.AddTrackingWhen(func(schema.GroupKind) bool { return true })
	return h
}

// modelPod is what the model reads of a pod the harness holds.
func modelPod(pod *PodMeta, phase corev1.PodPhase) *truth.Pod {
	if pod == nil {
		return nil
	}
	return &truth.Pod{ResourceVersion: pod.ResourceVersion, Labels: pod.Labels, Annotations: pod.Annotations,
		OwnerReferences: pod.OwnerReferences, Finalizers: pod.Finalizers, Phase: phase, Deleting: pod.DeletionTimestamp != nil}
}

// sequence admits the requests the choices describe, one after the other,
// as the API server would: the chart's match conditions with the API
// server's CEL library, then Decide when they call, then the patch; the
// stored pod is what was admitted. Every step must end as the contract
// says; a failure lists the steps taken.
func (h *harness) sequence(t *testing.T, choices []byte) {
	t.Helper()
	matcher, m, model := h.matcher, h.mutator, h.model

	next := func() int {
		if len(choices) == 0 {
			return 0
		}
		c := int(choices[0])
		choices = choices[1:]
		return c
	}
	var stored *PodMeta
	var phase corev1.PodPhase
	var steps []string
	version := 0
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	users := []string{"operator", "someone-else"}
	for step := 0; step < 12 && (step == 0 || len(choices) > 0); step++ {
		now = now.Add(time.Duration(next()) * time.Second)
		op, req := Update, &PodMeta{Namespace: "ns", Labels: map[string]string{"app": "w"}, Annotations: map[string]string{}}
		if stored == nil {
			op = Create
		} else {
			req = with(stored, func(*PodMeta) {})
		}
		var did []string
		for n := 1 + next()%3; n > 0; n-- {
			did = append(did, mutateRequest(req, next(), now))
		}
		// Paths the webhook does not see: the kubelet's status write, a
		// deletion.
		switch next() % 8 {
		case 0:
			if stored != nil {
				phase = corev1.PodFailed
				did = append(did, "(then pods/status: phase Failed)")
			}
		case 1:
			if stored != nil && stored.DeletionTimestamp == nil {
				stored.DeletionTimestamp = &metav1.Time{Time: now}
				req.DeletionTimestamp = stored.DeletionTimestamp
				did = append(did, "(then DELETE: deletion requested)")
			}
		}
		// As the webhook receives it: empty maps are not sent.
		if len(req.Labels) == 0 {
			req.Labels = nil
		}
		if len(req.Annotations) == 0 {
			req.Annotations = nil
		}
		// The user byte also picks the resourceVersion an update is sent
		// with: the stored one, or one of the forms the API server reads
		// otherwise.
		c := next()
		user := users[c%len(users)]
		if op == Update {
			req.ResourceVersion = resourceVersions[(c/len(users))%len(resourceVersions)](version)
		}
		steps = append(steps, fmt.Sprintf("%s by %s (resourceVersion %q, stored %d): %s", op, user, req.ResourceVersion, version, strings.Join(did, ", ")))

		in := Input{Operation: op, User: user, Pod: req, Old: stored, OldPhase: phase, Now: now}
		want := model.Admit(string(op), modelPod(stored, phase), modelPod(req, ""), user, now)
		got, denied, conflict := req, false, false
		if matcher.calls(t, in) {
			d := m.Decide(context.Background(), in)
			denied, conflict = d.Denied != "", d.Conflict
			if !denied {
				got = applyDecision(t, req, d)
			}
		}
		history := strings.Join(steps, "\n  ")
		if want.Conflict {
			// The API server answers 409 after admission: a denial must
			// be that conflict too, and nothing is stored.
			require.True(t, !denied || conflict, "a stale update denied with 403 instead of the API server's 409, after:\n  %s", history)
			continue
		}
		require.False(t, conflict, "an update answered as stale that is not, after:\n  %s", history)
		require.Equal(t, want.Denied, denied, "refused or not, after:\n  %s", history)
		if denied {
			continue
		}
		keys, tracking := truth.Keys(modelPod(got, phase))
		require.Equal(t, want.Keys, keys, "the admitted pod's tally keys, after:\n  %s", history)
		require.Equal(t, want.Tracking, tracking, "the tracking finalizer, after:\n  %s", history)
		stored = got
		version++
		stored.ResourceVersion = strconv.Itoa(version)
	}
}

// resourceVersions are the forms of resourceVersion an update is sent with,
// given the stored version: the stored one, "0" and "" (an unconditional
// update of a pod), the stored one zero-padded (the same version, as the
// API server parses it), and a stale one.
var resourceVersions = []func(stored int) string{
	func(v int) string { return strconv.Itoa(v) },
	func(int) string { return "0" },
	func(int) string { return "" },
	func(v int) string { return "0" + strconv.Itoa(v) },
	func(v int) string { return strconv.Itoa(v + 7) },
}

// mutateRequest changes req as a client could, by choice c, and says how.
func mutateRequest(req *PodMeta, c int, now time.Time) string {
	set := func(k, v string) { req.Annotations[k] = v }
	if req.Labels == nil {
		req.Labels = map[string]string{}
	}
	if req.Annotations == nil {
		req.Annotations = map[string]string{}
	}
	switch c % 16 {
	case 0, 1, 2:
		ref := contractOwners[(c/16)%len(contractOwners)]
		ref.Controller = ptr.To(true)
		req.OwnerReferences = []metav1.OwnerReference{ref}
		return "controller " + ref.APIVersion + " " + ref.Kind + " " + ref.Name[:min(len(ref.Name), 8)]
	case 3:
		req.OwnerReferences = nil
		return "no owner"
	case 4:
		for i := range req.OwnerReferences {
			req.OwnerReferences[i].Controller = ptr.To(false)
		}
		return "owners not controllers"
	case 5:
		// The identity the webhook would stamp, written by the client.
		for _, ref := range req.OwnerReferences {
			if ref.Controller != nil && *ref.Controller {
				req.Labels["tally.dev/parent-uid"] = string(ref.UID)
				req.Labels["tally.dev/parent-name"] = ref.Name
				req.Annotations["tally.dev/parent"] = ref.Kind + ".example.tally.dev/" + ref.Name
			}
		}
		return "identity written by the client"
	case 6:
		req.Labels["tally.dev/parent-uid"] = "forged"
		return "parent-uid forged"
	case 7:
		delete(req.Labels, "tally.dev/parent-uid")
		delete(req.Labels, "tally.dev/parent-name")
		delete(req.Annotations, "tally.dev/parent")
		return "identity removed"
	case 8:
		set("tally.dev/completion-intent", "scale-down")
		return "intent scale-down"
	case 9:
		set("tally.dev/completion-intent", "drain")
		return "intent drain"
	case 10:
		set("tally.dev/completion-intent", "Bad Reason")
		return "intent invalid"
	case 11:
		delete(req.Annotations, "tally.dev/completion-intent")
		return "intent removed"
	case 12:
		set("tally.dev/completion-intent-at", "2001-01-01T00:00:00Z")
		set("tally.dev/completion-intent-by", "mallory")
		return "stamps forged"
	case 13:
		set("tally.dev/completion-intent-at", now.UTC().Format(time.RFC3339))
		set("tally.dev/completion-intent-by", "operator")
		return "stamps of now, by operator"
	case 14:
		delete(req.Annotations, "tally.dev/completion-intent-at")
		delete(req.Annotations, "tally.dev/completion-intent-by")
		return "stamps removed"
	default:
		if (c/16)%2 == 1 {
			req.Finalizers = append(req.Finalizers, "tally.dev/tracking")
			return "the tracking finalizer"
		}
		req.Finalizers = append(req.Finalizers, "example.com/other")
		return "another finalizer"
	}
}

// applyDecision applies d's patch to pod, as the API server does.
func applyDecision(t *testing.T, pod *PodMeta, d Decision) *PodMeta {
	t.Helper()
	if len(d.Patch) == 0 {
		return pod
	}
	out := patched(t, podFrom(pod), d)
	got := &PodMeta{Namespace: pod.Namespace, ResourceVersion: pod.ResourceVersion, Labels: out.Labels, Annotations: out.Annotations,
		OwnerReferences: out.OwnerReferences, Finalizers: out.Finalizers, DeletionTimestamp: pod.DeletionTimestamp}
	return got
}

// FuzzContract checks sequences of pod requests, built from the fuzzer's
// bytes, against the contract: make test runs the seeds below; run it
// longer with
//
//	go test ./pkg/mutate -run '^$' -fuzz FuzzContract -fuzztime 30m
func FuzzContract(f *testing.F) {
	// Each step is: seconds that pass, how many changes (1 + b%3), the
	// changes (mutateRequest), what follows on paths the webhook does not
	// see (b%8: 0 the pod fails, 1 it is deleted), the user (b%2) and the
	// form of an update's resourceVersion (b/2%5: resourceVersions). The
	// two sequences of issue 38, the holes of issue 57, and a few ordinary
	// lives of a pod.
	seed := func(steps ...[]byte) []byte { return slices.Concat(steps...) }
	f.Add(seed( // an admitted intent laundered by removing the controller
		[]byte{0, 1, 0, 5, 7, 0},     // CREATE controlled by pool-a, identity written
		[]byte{0, 0, 8, 7, 0},        // marked
		[]byte{0, 2, 3, 7, 11, 7, 0}, // no owner, no identity, no intent
		[]byte{0, 2, 0, 5, 8, 7, 0})) // the controller back, identity and intent
	f.Add(seed( // stamps forged while untracked, then the pod made tracked
		[]byte{0, 2, 0, 4, 8, 7, 0}, // CREATE with an owner that is not the controller, and an intent
		[]byte{0, 0, 12, 7, 1},      // stamps forged
		[]byte{0, 1, 0, 5, 7, 0}))   // made the controller, identity written
	f.Add(seed( // marked after it failed
		[]byte{0, 1, 0, 5, 7, 0},
		[]byte{1, 0, 15, 0, 0}, // then the pod fails
		[]byte{1, 0, 8, 7, 0}))
	f.Add(seed( // a core-group parent, marked after its deletion
		[]byte{0, 1, 48, 5, 7, 0},
		[]byte{1, 0, 15, 1, 0}, // then the pod is deleted
		[]byte{1, 0, 8, 7, 1}))
	f.Add(seed( // a parent name that is no label value, stamps of now
		[]byte{0, 1, 32, 5, 7, 0},
		[]byte{0, 1, 8, 13, 7, 0}))
	f.Add(seed( // an admitted intent removed, forged and changed by updates sent with "0", "" and a padded version
		[]byte{0, 1, 0, 5, 7, 0},
		[]byte{0, 0, 8, 7, 0},
		[]byte{0, 0, 11, 7, 2},
		[]byte{0, 0, 12, 7, 4},
		[]byte{0, 0, 9, 7, 6},
		[]byte{0, 0, 11, 7, 8})) // and from a stale copy: a conflict
	f.Add(seed( // an intent carried in by a detour after the pod failed
		[]byte{0, 1, 0, 5, 7, 0},
		[]byte{1, 0, 15, 0, 0},   // then the pod fails
		[]byte{0, 1, 4, 8, 7, 0}, // no longer the controller, and marked
		[]byte{0, 0, 0, 7, 0}))   // the controller again
	f.Add(seed( // the tracking finalizer added by the client at CREATE, to a kind without totals
		[]byte{0, 1, 48, 31, 7, 0}))
	h := newHarness(f)
	f.Fuzz(func(t *testing.T, choices []byte) {
		h.sequence(t, choices)
	})
}
