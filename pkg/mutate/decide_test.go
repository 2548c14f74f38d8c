package mutate

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	jsonpatch "github.com/evanphx/json-patch/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

var (
	pool    = operator.GVK
	rcGVK   = schema.GroupVersionKind{Version: "v1", Kind: "ReplicationController"}
	jobGVK  = schema.GroupVersionKind{Group: "batch", Version: "v1", Kind: "Job"}
	now     = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)
	stamp   = now.Format(time.RFC3339)
	parents = []config.Parent{
		{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"},
		{Version: "v1", Kind: "ReplicationController"},
	}
)

const (
	uid  = types.UID("11111111-2222-3333-4444-555555555555")
	user = "system:serviceaccount:ops:workerpool-operator"
)

func pod() *builder.PodBuilder { return builder.Pod("ns", "p") }

func stamped() *builder.PodBuilder {
	return pod().ControlledBy(pool, "pool-a", uid).
		Label(keys.ParentUID, string(uid)).Label(keys.ParentName, "pool-a").
		Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a")
}

func withIntent(b *builder.PodBuilder) *builder.PodBuilder {
	return b.Annotation(keys.CompletionIntent, "scale-down").
		Annotation(keys.CompletionIntentAt, "2026-11-29T09:00:00Z").
		Annotation(keys.CompletionIntentBy, "alice")
}

type fakeChecker map[types.UID]bool

func (f fakeChecker) CheckOwner(_ context.Context, ns string, o identity.Parent) (bool, string, error) {
	if f[o.UID] {
		return true, "", nil
	}
	return false, o.String() + " with UID " + string(o.UID) + " not found in namespace " + ns, nil
}

// failingChecker cannot reach the API server.
type failingChecker struct{}

func (failingChecker) CheckOwner(context.Context, string, identity.Parent) (bool, string, error) {
	return false, "", errors.New("the server is currently unable to handle the request")
}

func TestDecide(t *testing.T) {
	longName := strings.Repeat("a", 64)
	tests := []struct {
		name       string
		op         Operation
		pod, old   *builder.PodBuilder
		checker    OwnerChecker
		wantLabels map[string]string
		wantAnn    map[string]string
		wantWarn   []string
		wantDenied string
		// wantConflict: the denial is answered as the API server's 409.
		wantConflict bool
		wantNoPatch  bool
		// wantUnavailable: the call must fail and be retried.
		wantUnavailable string
		// wantUnverified is the reason a tracked pod was not stamped.
		wantUnverified string
		wantDropped    string
	}{
		{
			name: "create stamps identity from the controller ref",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name: "create keeps unrelated labels",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid).Label("app", "w").Annotation("note", "x"),
			wantLabels: map[string]string{"app": "w", keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{"note": "x", keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name: "core group owner",
			op:   Create, pod: pod().ControlledBy(rcGVK, "rc", uid),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "rc"},
			wantAnn:    map[string]string{keys.Parent: "ReplicationController/rc"},
		},
		{
			name: "any version of a tracked group counts",
			op:   Create, pod: pod().ControlledBy(schema.GroupVersionKind{Group: "example.tally.dev", Version: "v2beta1", Kind: "WorkerPool"}, "pool-a", uid),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name: "long parent name: no name label, full annotation",
			op:   Create, pod: pod().ControlledBy(pool, longName, uid),
			wantLabels: map[string]string{keys.ParentUID: string(uid)},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/" + longName},
		},
		{
			name: "non-controller ref is ignored",
			op:   Create, pod: pod().OwnedBy(pool, "pool-a", uid),
			wantNoPatch: true,
		},
		{
			name: "untracked kind is untouched",
			op:   Create, pod: pod().ControlledBy(jobGVK, "job", uid).Label("app", "w"),
			wantNoPatch: true,
		},
		{
			name: "forged identity on create is replaced with a warning",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid).Label(keys.ParentUID, "forged").Annotation(keys.Parent, "WorkerPool.example.tally.dev/other"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:   []string{"label tally.dev/parent-uid set back", "annotation tally.dev/parent set back"},
		},
		{
			name: "forged identity on an untracked pod is removed with a warning",
			op:   Create, pod: pod().ControlledBy(jobGVK, "job", uid).Label(keys.ParentUID, string(uid)).Label("app", "w"),
			wantLabels: map[string]string{"app": "w"},
			wantAnn:    map[string]string{},
			wantWarn:   []string{"label tally.dev/parent-uid removed"},
		},
		{
			name: "update that removes identity restores it with a warning",
			op:   Update, old: stamped(), pod: pod().ControlledBy(pool, "pool-a", uid).Label("app", "w"),
			wantLabels: map[string]string{"app": "w", keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:   []string{"label tally.dev/parent-uid restored", "label tally.dev/parent-name restored", "annotation tally.dev/parent restored"},
		},
		{
			name: "update that changes identity sets it back",
			op:   Update, old: stamped(), pod: stamped().Label(keys.ParentName, "pool-b"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:   []string{"label tally.dev/parent-name set back"},
		},
		{
			name: "update of a pod created before the webhook stamps it quietly",
			op:   Update, old: pod().ControlledBy(pool, "pool-a", uid), pod: pod().ControlledBy(pool, "pool-a", uid).Label("app", "w"),
			wantLabels: map[string]string{"app": "w", keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name: "update that drops the controller ref drops the identity",
			op:   Update, old: stamped(), pod: pod().Label(keys.ParentUID, string(uid)).Label(keys.ParentName, "pool-a").Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a"),
			wantLabels: map[string]string{},
			wantAnn:    map[string]string{},
			wantWarn:   []string{"label tally.dev/parent-uid removed", "label tally.dev/parent-name removed", "annotation tally.dev/parent removed"},
		},
		{
			name: "intent on create is stamped with time and user",
			op:   Create, pod: stamped().Annotation(keys.CompletionIntent, "scale-down"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a",
				keys.CompletionIntent: "scale-down", keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: user},
		},
		{
			name: "intent set by update is stamped",
			op:   Update, old: stamped(), pod: stamped().Annotation(keys.CompletionIntent, "scale-down"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a",
				keys.CompletionIntent: "scale-down", keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: user},
		},
		{
			name: "client-supplied -at and -by are overwritten",
			op:   Update, old: stamped(), pod: withIntent(stamped()),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a",
				keys.CompletionIntent: "scale-down", keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: user},
			wantWarn: []string{"annotation tally.dev/completion-intent-at set back", "annotation tally.dev/completion-intent-by set back"},
		},
		{
			name: "admitted -at and -by cannot be changed",
			op:   Update, old: withIntent(stamped()), pod: withIntent(stamped()).Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a",
				keys.CompletionIntent: "scale-down", keys.CompletionIntentAt: "2026-11-29T09:00:00Z", keys.CompletionIntentBy: "alice"},
			wantWarn: []string{`annotation tally.dev/completion-intent-by set back to "alice"`},
		},
		{
			name: "-at and -by without intent are removed",
			op:   Create, pod: stamped().Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:   []string{"annotation tally.dev/completion-intent-by removed"},
		},
		{
			name: "intent removal is denied",
			op:   Update, old: withIntent(stamped()), pod: stamped(),
			wantDenied: `annotation tally.dev/completion-intent is sticky: it was set to "scale-down" and cannot be removed`,
		},
		{
			name: "intent change is denied",
			op:   Update, old: withIntent(stamped()), pod: withIntent(stamped()).Annotation(keys.CompletionIntent, "evicted"),
			wantDenied: `cannot be changed to "evicted"`,
		},
		{
			name: "removing an intent tally never admitted (the pod was never tracked) is allowed",
			op:   Update, old: pod().Annotation(keys.CompletionIntent, "scale-down"), pod: pod(),
			wantNoPatch: true,
		},
		{
			name: "removing the controller does not lift an admitted intent",
			op:   Update, old: withIntent(stamped()), pod: pod(),
			wantDenied: `annotation tally.dev/completion-intent is sticky: it was set to "scale-down" and cannot be removed`,
		},
		{
			name: "changing the controller to an untracked kind does not lift an admitted intent",
			op:   Update, old: withIntent(stamped()), pod: pod().ControlledBy(jobGVK, "job", uid).Annotation(keys.CompletionIntent, "evicted"),
			wantDenied: `cannot be changed to "evicted"`,
		},
		{
			name: "a stored -at is no proof on a pod tally does not track: its intent may go",
			op:   Update, old: withIntent(pod()), pod: pod(),
			wantNoPatch: true,
		},
		{
			name: "nor on an ownerless pod that keeps its intent: the client's stamps are removed",
			op:   Update, old: withIntent(pod()), pod: withIntent(pod()).Label("app", "w"),
			wantLabels: map[string]string{"app": "w"},
			wantAnn:    map[string]string{keys.CompletionIntent: "scale-down"},
			wantWarn:   []string{"annotation tally.dev/completion-intent-at removed", "annotation tally.dev/completion-intent-by removed"},
		},
		{
			name: "an admitted intent stays sticky when the request detaches its pod",
			op:   Update, old: withIntent(stamped()), pod: pod(),
			wantDenied: "is sticky",
		},
		{
			name: "the stamps of an admitted intent are set back on a pod no longer tracked",
			op:   Update, old: withIntent(stamped()), pod: pod().Annotation(keys.CompletionIntent, "scale-down").Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{},
			wantAnn: map[string]string{keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: "2026-11-29T09:00:00Z", keys.CompletionIntentBy: "alice"},
			wantWarn: []string{"annotation tally.dev/completion-intent-at restored", "annotation tally.dev/completion-intent-by set back"},
		},
		{
			name: "stamps a client wrote on an untracked pod are removed",
			op:   Create, pod: pod().OwnedBy(pool, "pool-a", uid).Annotation(keys.CompletionIntent, "scale-down").
				Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Annotation(keys.CompletionIntentBy, "someone-else"),
			wantLabels: map[string]string{},
			wantAnn:    map[string]string{keys.CompletionIntent: "scale-down"},
			wantWarn:   []string{"annotation tally.dev/completion-intent-at removed", "annotation tally.dev/completion-intent-by removed"},
		},
		{
			name: "a pod that becomes tracked while carrying an intent has it admitted then, by no one observed",
			op:   Update, old: pod().OwnedBy(pool, "pool-a", uid).Annotation(keys.CompletionIntent, "scale-down"),
			pod: stamped().Annotation(keys.CompletionIntent, "scale-down").
				Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Annotation(keys.CompletionIntentBy, "someone-else"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: UnobservedRequester},
			wantWarn: []string{"annotation tally.dev/completion-intent-at set back", "annotation tally.dev/completion-intent-by set back"},
		},
		{
			name: "invalid reason token on an untracked pod is allowed untouched",
			op:   Create, pod: pod().ControlledBy(jobGVK, "job", uid).Annotation(keys.CompletionIntent, "Scale Down"),
			wantNoPatch: true,
		},
		{
			name: "update from the current copy is checked",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("12"),
			wantDenied: "is sticky",
		},
		{
			name: "update from a stale copy is checked too, and denied as the conflict the API server answers",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("11"),
			wantDenied: "is sticky", wantConflict: true,
		},
		{
			name: `resourceVersion "0" is an unconditional update: checked, and no conflict`,
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("0"),
			wantDenied: "is sticky",
		},
		{
			name: `resourceVersion "00" parses as 0`,
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("00"),
			wantDenied: "is sticky",
		},
		{
			name: "an empty resourceVersion is an unconditional update",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped(),
			wantDenied: "is sticky",
		},
		{
			name: "a zero-padded copy of the stored version is the stored version",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("012"),
			wantDenied: "is sticky",
		},
		{
			name: "a resourceVersion that does not parse is no conflict (the API server refuses it as invalid)",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"), pod: stamped().ResourceVersion("+12"),
			wantDenied: "is sticky",
		},
		{
			name: "stamps forged on a stale copy are overwritten all the same",
			op:   Update, old: withIntent(stamped()).ResourceVersion("12"),
			pod: stamped().ResourceVersion("0").Annotation(keys.CompletionIntent, "scale-down").
				Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: "2026-11-29T09:00:00Z", keys.CompletionIntentBy: "alice"},
			wantWarn: []string{"annotation tally.dev/completion-intent-at set back", "annotation tally.dev/completion-intent-by set back"},
		},
		{
			name: "invalid reason token is denied",
			op:   Create, pod: stamped().Annotation(keys.CompletionIntent, "Scale Down"),
			wantDenied: `annotation tally.dev/completion-intent: "Scale Down" is not a valid reason`,
		},
		{
			name: "too long reason token is denied",
			op:   Update, old: stamped(), pod: stamped().Annotation(keys.CompletionIntent, strings.Repeat("x", 64)),
			wantDenied: "is not a valid reason",
		},
		{
			name: "an intent set on a pod that failed is denied: its end is unexpected",
			op:   Update, old: stamped().Phase(corev1.PodFailed), pod: stamped().Phase(corev1.PodFailed).Annotation(keys.CompletionIntent, "scale-down"),
			wantDenied: "annotation tally.dev/completion-intent cannot be set on a pod that has finished (phase Failed): an intent counts only when it is set before the pod finishes",
		},
		{
			name: "an intent set on a pod that succeeded is denied",
			op:   Update, old: stamped().Phase(corev1.PodSucceeded), pod: stamped().Annotation(keys.CompletionIntent, "scale-down"),
			wantDenied: "has finished (phase Succeeded)",
		},
		{
			name: "an intent set on a pod being deleted is denied",
			op:   Update, old: stamped().Phase(corev1.PodRunning).Deleting(now), pod: stamped().Deleting(now).Annotation(keys.CompletionIntent, "scale-down"),
			wantDenied: "has finished (its deletion was requested)",
		},
		{
			name: "an intent admitted before the pod finished stays, stamps and all",
			op:   Update, old: withIntent(stamped()).Phase(corev1.PodFailed).Deleting(now), pod: withIntent(stamped()).Deleting(now).Label("app", "w"),
			wantNoPatch: true,
		},
		{
			name: "an intent set on a running pod is admitted",
			op:   Update, old: stamped().Phase(corev1.PodRunning), pod: stamped().Annotation(keys.CompletionIntent, "scale-down"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: user},
		},
		{
			name: "an intent set while the pod was not tracked is removed when the finished pod becomes tracked",
			op:   Update, old: pod().OwnedBy(pool, "pool-a", uid).Annotation(keys.CompletionIntent, "scale-down").Phase(corev1.PodFailed),
			pod:         stamped().Annotation(keys.CompletionIntent, "scale-down").Phase(corev1.PodFailed),
			wantLabels:  map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:     map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:    []string{`annotation tally.dev/completion-intent="scale-down" removed: tally did not admit it on this pod (set while tally did not see the pod, or while the pod was not tracked), and it is not admitted now: the pod had finished (phase Failed) when tally first saw the intent`},
			wantDropped: "the pod had finished (phase Failed) when tally first saw the intent",
		},
		{
			name: "so is one set while the pod was not tracked when the pod being deleted becomes tracked",
			op:   Update, old: pod().Annotation(keys.CompletionIntent, "drain").Deleting(now),
			pod:         stamped().Annotation(keys.CompletionIntent, "drain").Deleting(now),
			wantLabels:  map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:     map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:    []string{"(its deletion was requested)"},
			wantDropped: "the pod had finished (its deletion was requested) when tally first saw the intent",
		},
		{
			name: "first sight, as the sweep decides it: a late intent with forged stamps on a pod tally never stamped is removed",
			op:   Update, old: withIntent(pod().ControlledBy(pool, "pool-a", uid)).Phase(corev1.PodFailed),
			pod:        withIntent(pod().ControlledBy(pool, "pool-a", uid)).Phase(corev1.PodFailed),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn: []string{"had finished (phase Failed)",
				"annotation tally.dev/completion-intent-at removed", "annotation tally.dev/completion-intent-by removed"},
			wantDropped: "the pod had finished (phase Failed) when tally first saw the intent",
		},
		{
			name: "first sight of a running pod: its intent is admitted now, the forged stamps overwritten",
			op:   Update, old: withIntent(pod().ControlledBy(pool, "pool-a", uid)).Annotation(keys.CompletionIntentBy, "mallory"),
			pod:        withIntent(pod().ControlledBy(pool, "pool-a", uid)).Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: stamp, keys.CompletionIntentBy: UnobservedRequester},
			wantWarn: []string{"annotation tally.dev/completion-intent-at set back", "annotation tally.dev/completion-intent-by set back"},
		},
		{
			name: "first sight of an invalid token, stamped or not: it is removed, never admitted",
			op:   Update, old: stamped().Annotation(keys.CompletionIntent, "Not A Token").Annotation(keys.CompletionIntentAt, stamp).Annotation(keys.CompletionIntentBy, "mallory"),
			pod:        stamped().Annotation(keys.CompletionIntent, "Not A Token").Annotation(keys.CompletionIntentAt, stamp).Annotation(keys.CompletionIntentBy, "mallory"),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn: []string{`"Not A Token" is not a valid reason`,
				"annotation tally.dev/completion-intent-at removed", "annotation tally.dev/completion-intent-by removed"},
			wantDropped: `"Not A Token" is not a valid reason: it must be 1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit (e.g. scale-down)`,
		},
		{
			name: "an identity short of a key is not tally's stamp: the intent is judged at first sight",
			op:   Update, old: withIntent(pod().ControlledBy(pool, "pool-a", uid).Label(keys.ParentUID, string(uid)).Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a")).Phase(corev1.PodFailed),
			pod:         withIntent(pod().ControlledBy(pool, "pool-a", uid).Label(keys.ParentUID, string(uid)).Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a")).Phase(corev1.PodFailed),
			wantLabels:  map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:     map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:    []string{"had finished (phase Failed)", "completion-intent-at removed", "completion-intent-by removed"},
			wantDropped: "the pod had finished (phase Failed) when tally first saw the intent",
		},
		{
			name: "an intent stamped under another controller is judged at first sight",
			op:   Update, old: withIntent(pod().ControlledBy(pool, "pool-b", "other-uid").Label(keys.ParentUID, string(uid)).Annotation(keys.Parent, "WorkerPool.example.tally.dev/pool-a")).Phase(corev1.PodSucceeded),
			pod:         withIntent(stamped()).Phase(corev1.PodSucceeded),
			wantLabels:  map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:     map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
			wantWarn:    []string{"had finished (phase Succeeded)", "completion-intent-at removed", "completion-intent-by removed"},
			wantDropped: "the pod had finished (phase Succeeded) when tally first saw the intent",
		},
		{
			name: "a late intent the request sets itself is refused, as ever",
			op:   Update, old: stamped().Phase(corev1.PodFailed), pod: stamped().Annotation(keys.CompletionIntent, "scale-down").Phase(corev1.PodFailed),
			wantDenied: "cannot be set on a pod that has finished (phase Failed)",
		},
		{
			name: "an intent on an untracked pod that finished is allowed untouched",
			op:   Update, old: pod().Phase(corev1.PodFailed), pod: pod().Annotation(keys.CompletionIntent, "scale-down"),
			wantNoPatch: true,
		},
		{
			name: "already stamped pod yields no patch",
			op:   Update, old: withIntent(stamped()), pod: withIntent(stamped()).Label("app", "w"),
			wantNoPatch: true,
		},
		{
			name: "verifyOwner stamps a verified owner",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid), checker: fakeChecker{uid: true},
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn:    map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name: "verifyOwner refuses to stamp an unknown owner",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid), checker: fakeChecker{},
			wantNoPatch:    true,
			wantWarn:       []string{"pod not stamped with its parent's identity: WorkerPool.example.tally.dev/pool-a with UID " + string(uid) + " not found in namespace ns"},
			wantUnverified: "WorkerPool.example.tally.dev/pool-a with UID " + string(uid) + " not found in namespace ns",
		},
		{
			name: "verifyOwner: a pod whose owner fails it gets no stamps and no intent rule",
			op:   Update, old: withIntent(pod().ControlledBy(pool, "pool-a", uid)),
			pod:        pod().ControlledBy(pool, "pool-a", uid).Annotation(keys.CompletionIntent, "Not A Token").Annotation(keys.CompletionIntentAt, stamp),
			checker:    fakeChecker{},
			wantLabels: map[string]string{},
			wantAnn:    map[string]string{keys.CompletionIntent: "Not A Token"},
			wantWarn: []string{"pod not stamped with its parent's identity",
				"annotation tally.dev/completion-intent-at removed"},
			wantUnverified: "WorkerPool.example.tally.dev/pool-a with UID " + string(uid) + " not found in namespace ns",
		},
		{
			name: "verifyOwner that cannot reach the API server fails the call, never admits unstamped",
			op:   Create, pod: pod().ControlledBy(pool, "pool-a", uid), checker: failingChecker{},
			wantUnavailable: "tally could not verify the owner WorkerPool.example.tally.dev/pool-a of this pod (verifyOwner): the server is currently unable to handle the request; retry",
		},
		{
			name: "an intent the webhook never saw is stamped as first seen now, by no one observed",
			op:   Update, old: stamped().Annotation(keys.CompletionIntent, "scale-down"), pod: stamped().Annotation(keys.CompletionIntent, "scale-down").Label("app", "w"),
			wantLabels: map[string]string{"app": "w", keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: now.UTC().Format(time.RFC3339), keys.CompletionIntentBy: UnobservedRequester},
		},
		{
			name: "a client's own -at a minute old is not taken as the webhook's stamp",
			op:   Update, old: stamped(), pod: stamped().Annotation(keys.CompletionIntent, "scale-down").
				Annotation(keys.CompletionIntentAt, now.Add(-time.Minute).UTC().Format(time.RFC3339)).Annotation(keys.CompletionIntentBy, user),
			wantLabels: map[string]string{keys.ParentUID: string(uid), keys.ParentName: "pool-a"},
			wantAnn: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a", keys.CompletionIntent: "scale-down",
				keys.CompletionIntentAt: now.UTC().Format(time.RFC3339), keys.CompletionIntentBy: user},
			wantWarn: []string{"annotation tally.dev/completion-intent-at set back"},
		},
		{
			name: "delete is ignored",
			op:   "DELETE", pod: pod().ControlledBy(pool, "pool-a", uid),
			wantNoPatch: true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := NewMutator(parents, tc.checker)
			var old *corev1.Pod
			if tc.old != nil {
				old = tc.old.Build()
			}
			d, got := admit(t, m, tc.op, tc.pod.Build(), old)
			if tc.wantUnavailable != "" {
				assert.Equal(t, tc.wantUnavailable, d.Unavailable)
				assert.Empty(t, d.Patch)
				return
			}
			require.Empty(t, d.Unavailable)
			if tc.wantDenied != "" {
				assert.Contains(t, d.Denied, tc.wantDenied)
				assert.Equal(t, tc.wantConflict, d.Conflict, "denied as a conflict")
				assert.Empty(t, d.Patch)
				return
			}
			require.Empty(t, d.Denied)
			assert.Equal(t, tc.wantUnverified, d.Unverified)
			assert.Equal(t, tc.wantDropped, d.Dropped)
			require.Len(t, d.Warnings, len(tc.wantWarn), "warnings: %q", d.Warnings)
			for i, w := range tc.wantWarn {
				assert.Contains(t, d.Warnings[i], w)
			}
			if tc.wantNoPatch {
				assert.Empty(t, d.Patch)
				return
			}
			require.NotEmpty(t, d.Patch)
			assert.Equal(t, tc.wantLabels, nonNil(got.Labels))
			assert.Equal(t, tc.wantAnn, nonNil(got.Annotations))

			// Admitting the mutated pod again changes nothing (reinvocation).
			again, _ := admit(t, m, tc.op, got, old)
			assert.Empty(t, again.Patch, "second admission patched: %+v", again.Patch)
			if tc.wantUnverified == "" {
				assert.Empty(t, again.Warnings)
			}
		})
	}
}

func TestDecideCreateReinvocationKeepsOwnStamp(t *testing.T) {
	m := NewMutator(parents, nil)
	d, got := admit(t, m, Create, stamped().Annotation(keys.CompletionIntent, "scale-down").Build(), nil)
	require.NotEmpty(t, d.Patch)
	// A later invocation, a few seconds on, keeps the first stamp.
	in := Input{Operation: Create, User: user, Pod: meta(t, got), Now: now.Add(5 * time.Second)}
	assert.Empty(t, m.Decide(context.Background(), in).Patch)
	// A stamp far from now, or by someone else, is not the webhook's own.
	in.Now = now.Add(time.Hour)
	assert.NotEmpty(t, m.Decide(context.Background(), in).Patch)
}

// TestDecideTrackingFinalizer: the pods of a kind with totals get
// keys.TrackingFinalizer on CREATE only, once, beside the finalizers they
// carry; other pods never get it, and a client that adds it on CREATE to
// any other pod has it removed.
func TestDecideTrackingFinalizer(t *testing.T) {
	withTotals := []config.Parent{
		{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: map[config.Count]string{config.UnexpectedTotal: "status.restarts"}, Ledger: "status.ledger"},
		{Version: "v1", Kind: "ReplicationController"},
	}
	tests := []struct {
		name    string
		op      Operation
		pod     *builder.PodBuilder
		old     *builder.PodBuilder
		checker OwnerChecker
		want    []string
	}{
		{name: "create adds it", op: Create, pod: pod().ControlledBy(pool, "pool-a", uid), want: []string{keys.TrackingFinalizer}},
		{name: "create keeps other finalizers", op: Create, pod: pod().ControlledBy(pool, "pool-a", uid).Finalizer("example.com/x"),
			want: []string{"example.com/x", keys.TrackingFinalizer}},
		{name: "create with it already", op: Create, pod: stamped().Finalizer(keys.TrackingFinalizer), want: []string{keys.TrackingFinalizer}},
		{name: "kind without totals", op: Create, pod: pod().ControlledBy(rcGVK, "rc", uid)},
		{name: "untracked owner", op: Create, pod: pod().ControlledBy(jobGVK, "j", uid)},
		{name: "owner not verified", op: Create, pod: pod().ControlledBy(pool, "pool-a", uid), checker: fakeChecker{}},
		{name: "update never adds it back", op: Update, pod: stamped(), old: stamped()},
		{name: "a client's, on a kind without totals, is removed", op: Create,
			pod: pod().ControlledBy(rcGVK, "rc", uid).Finalizer("example.com/x").Finalizer(keys.TrackingFinalizer), want: []string{"example.com/x"}},
		{name: "a client's, on an untracked owner's pod, is removed", op: Create,
			pod: pod().ControlledBy(jobGVK, "j", uid).Finalizer(keys.TrackingFinalizer).Finalizer("example.com/x"), want: []string{"example.com/x"}},
		{name: "a client's, on a pod with no owner, is removed", op: Create, pod: pod().Finalizer(keys.TrackingFinalizer), want: []string{}},
		{name: "a client's, on a pod whose owner is not verified, is removed", op: Create,
			pod: pod().ControlledBy(pool, "pool-a", uid).Finalizer(keys.TrackingFinalizer), checker: fakeChecker{}, want: []string{}},
		{name: "an update keeps it: the aggregator removes it", op: Update,
			pod: stamped().Finalizer(keys.TrackingFinalizer), old: stamped().Finalizer(keys.TrackingFinalizer), want: []string{keys.TrackingFinalizer}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var old *corev1.Pod
			if tc.old != nil {
				old = tc.old.Build()
			}
			_, got := admit(t, NewMutator(withTotals, tc.checker), tc.op, tc.pod.Build(), old)
			assert.Equal(t, tc.want, got.Finalizers)
			again, _ := admit(t, NewMutator(withTotals, tc.checker), tc.op, got, old)
			for _, op := range again.Patch {
				assert.NotContains(t, op.Path, "/metadata/finalizers", "second admission patched the finalizers")
			}
		})
	}
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

func meta(t *testing.T, p *corev1.Pod) *PodMeta {
	t.Helper()
	raw, err := json.Marshal(p.ObjectMeta)
	require.NoError(t, err)
	var pm PodMeta
	require.NoError(t, json.Unmarshal(raw, &pm))
	return &pm
}

// admit runs the decision and applies its patch to the pod's JSON with the
// same JSON patch implementation the API server uses.
func admit(t *testing.T, m *Mutator, op Operation, pod, old *corev1.Pod) (Decision, *corev1.Pod) {
	t.Helper()
	in := Input{Operation: op, User: user, Pod: meta(t, pod), Now: now}
	if old != nil {
		in.Old, in.OldPhase = meta(t, old), old.Status.Phase
	}
	d := m.Decide(context.Background(), in)
	return d, patched(t, pod, d)
}

// patched returns pod with d's patch applied to its JSON, with the same
// JSON patch implementation the API server uses.
func patched(t *testing.T, pod *corev1.Pod, d Decision) *corev1.Pod {
	t.Helper()
	raw, err := json.Marshal(pod)
	require.NoError(t, err)
	if len(d.Patch) > 0 {
		patch, err := jsonpatch.DecodePatch(AppendPatch(nil, d.Patch))
		require.NoError(t, err)
		raw, err = patch.Apply(raw)
		require.NoError(t, err)
	}
	var out corev1.Pod
	require.NoError(t, json.Unmarshal(raw, &out))
	return &out
}
