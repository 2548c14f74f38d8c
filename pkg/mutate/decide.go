package mutate

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/intent"
	"tally.dev/tally/pkg/keys"
)

// Operation is the admission operation of a request.
type Operation string

// The operations the webhook acts on; any other is allowed untouched.
const (
	Create Operation = "CREATE"
	Update Operation = "UPDATE"
)

// PodMeta is the part of a pod the decision reads.
type PodMeta struct {
	Namespace       string                  `json:"namespace,omitempty"`
	ResourceVersion string                  `json:"resourceVersion,omitempty"`
	Labels          map[string]string       `json:"labels,omitempty"`
	Annotations     map[string]string       `json:"annotations,omitempty"`
	OwnerReferences []metav1.OwnerReference `json:"ownerReferences,omitempty"`
	Finalizers      []string                `json:"finalizers,omitempty"`
	// DeletionTimestamp is set once the pod's deletion was requested.
	DeletionTimestamp *metav1.Time `json:"deletionTimestamp,omitempty"`
}

// Input is one admission request, reduced to what the decision needs.
type Input struct {
	Operation Operation
	// User is the requester's username.
	User string
	// Pod is the pod as the client wants it to be.
	Pod *PodMeta
	// Old is the stored pod, on UPDATE.
	Old *PodMeta
	// OldPhase is the stored pod's phase, on UPDATE: with
	// Old.DeletionTimestamp it tells whether the pod has finished. Whoever
	// decides must pass it: an intent first seen on a finished pod is not
	// admitted.
	OldPhase corev1.PodPhase
	// Now is the time at which the request is admitted.
	Now time.Time
}

// Decision is the webhook's answer to one request.
type Decision struct {
	// Denied, when not empty, refuses the request with this message.
	Denied string
	// Late says that Denied refuses an intent set on a pod that had
	// finished: an operator acting on an older view of the pod, not a
	// broken client.
	Late bool
	// Conflict says that the API server refuses this update with 409
	// Conflict whatever the webhook answers (staleUpdate): a denial is
	// answered as that conflict, which clients retry from a fresh copy.
	Conflict bool
	// Patch holds the operations that bring the pod in line with the
	// contract; empty when it already is.
	Patch []PatchOp
	// Warnings are returned to the client.
	Warnings []string
	// Unverified, when not empty, says why a pod with a tracked controller
	// owner was not stamped with its identity (verifyOwner refused it).
	Unverified string
	// Unavailable, when not empty, says why the owner could not be checked
	// at all (an API error): the request must be retried, not admitted
	// unstamped. The handler fails the call, so that the webhook's
	// failurePolicy decides.
	Unavailable string
	// Parent is the parent whose identity the pod carries once Patch is
	// applied: its controller owner of a tracked kind, verified when owners
	// are. Zero when it carries none.
	Parent identity.Parent
	// Dropped, when not empty, says why an intent the stored pod carried
	// unadmitted, judged now at first sight, is not admitted: Patch
	// removes it, and the pod counts as having none.
	Dropped string
}

// OwnerChecker confirms that an owner exists in a namespace with the
// referenced UID. It returns a reason when it does not, and an error when
// it could not tell.
type OwnerChecker interface {
	CheckOwner(ctx context.Context, namespace string, owner identity.Parent) (ok bool, reason string, err error)
}

// Mutator decides what the pod metadata contract requires of a request.
type Mutator struct {
	tracked map[schema.GroupKind]bool
	// totals holds the kinds that keep cumulative totals.
	totals  map[schema.GroupKind]bool
	checker OwnerChecker
	// served, when set, tells which of them the API server serves for their
	// totals: only their pods get the tracking finalizer.
	served func(schema.GroupKind) bool
}

// NewMutator returns a Mutator for the given parent kinds. checker, when not
// nil, verifies owners before pods are stamped (verifyOwner).
func NewMutator(parents []config.Parent, checker OwnerChecker) *Mutator {
	tracked := make(map[schema.GroupKind]bool, len(parents))
	totals := map[schema.GroupKind]bool{}
	for _, p := range parents {
		tracked[p.GroupKind()] = true
		if p.Tracked() {
			totals[p.GroupKind()] = true
		}
	}
	return &Mutator{tracked: tracked, totals: totals, checker: checker}
}

// KeepsTotals reports whether kind keeps cumulative totals, so that its pods
// carry keys.TrackingFinalizer.
func (m *Mutator) KeepsTotals(kind schema.GroupKind) bool { return m.totals[kind] }

// AddTrackingWhen makes the tracking finalizer go only to the pods of the
// kinds with totals for which served says yes (servable.Gate.Serves): the
// kinds the aggregator can record, so that no pod waits on a finalizer
// nothing releases.
func (m *Mutator) AddTrackingWhen(served func(schema.GroupKind) bool) { m.served = served }

// intentClockSkew bounds how far a completion-intent-at value already on a
// pod may lie from now and still be taken as the webhook's own stamp from an
// earlier invocation of the same request: a reinvocation comes within the
// other webhooks' timeouts (at most 30 s each, and the API server ends the
// request after 60 s), possibly to another replica whose clock differs by a
// few seconds.
const intentClockSkew = 30 * time.Second

// UnobservedRequester is the keys.CompletionIntentBy value of an intent that
// was set while the webhook did not see it (admitted during an outage under
// failurePolicy Ignore, or before tally was installed): tally records when
// it first saw the intent, and that it did not see who set it. A "system:"
// username is reserved, so no user can be confused with it.
const UnobservedRequester = "system:tally:unobserved"

// Decide applies the pod metadata contract to one request. It reads no
// state but the owner checker's.
//
// A pod whose controller is not of a tracked kind is refused only an update
// that would remove or change an intent admitted before (admittedBefore):
// the update that detaches a pod cannot drop its intent with it
// (untracked). Once detached, the pod carries no identity, so nothing
// proves the intent admitted any more.
//
// A stored pod that tally did not stamp is judged at first sight, the
// same way whoever looks: the webhook on the first request it sees, the
// aggregator's sweep with the stored pod as the request (Input.Old and Pod
// the same, with its phase). An intent it carries is admitted now, stamped
// as seen by no one (UnobservedRequester), unless it is invalid or the pod
// had finished (firstSight): then it is removed. Stamps a client wrote are
// overwritten or removed.
//
// Every request is decided on its content, against the stored pod, whatever
// its resourceVersion: "0" and "" make an unconditional update of a pod, and
// a zero-padded copy of the stored version is the stored version, as the
// API server parses them. Only the form of a denial depends on it: an
// update the API server refuses as stale anyway (staleUpdate) is denied
// with its 409 Conflict, which clients retry, rather than with 403.
func (m *Mutator) Decide(ctx context.Context, in Input) Decision {
	if (in.Operation != Create && in.Operation != Update) || in.Pod == nil {
		return Decision{}
	}
	d := m.decide(ctx, in)
	if d.Denied != "" && staleUpdate(in) {
		d.Conflict = true
	}
	return d
}

func (m *Mutator) decide(ctx context.Context, in Input) Decision {
	var d Decision
	owner, isTracked := trackedOwner(in.Pod, m.tracked)
	admitted := m.admittedBefore(in)
	if isTracked && m.checker != nil && !alreadyStamped(in, owner) {
		ok, reason, err := m.checker.CheckOwner(ctx, in.Pod.Namespace, owner)
		if err != nil {
			return Decision{Unavailable: fmt.Sprintf("tally could not verify the owner %s of this pod (verifyOwner): %v; retry", owner, err)}
		}
		if !ok {
			// Not tracked: no identity, no stamps, no intent rule.
			isTracked = false
			d.Unverified = reason
			d.Warnings = append(d.Warnings, fmt.Sprintf("tally: pod not stamped with its parent's identity: %s", reason))
		}
	}
	if !isTracked {
		return untracked(in, admitted, d)
	}

	if denied := checkIntent(in, admitted); denied != "" {
		return Decision{Denied: denied}
	}
	if late := checkFinished(in, admitted); late != "" {
		return Decision{Denied: late, Late: true}
	}
	d.Parent = owner
	want := wantKeysOf(owner)
	p := patcher{in: in, d: &d}
	p.label(keys.ParentUID, want.uid, want.hasUID)
	p.label(keys.ParentName, want.name, want.hasName)
	p.annotation(keys.Parent, want.parent, want.hasParent)

	if !admitted {
		if d.Dropped = firstSight(in); d.Dropped != "" {
			p.drop(keys.CompletionIntent, d.Dropped)
		}
	}
	at, by, hasIntentStamp := intentStamp(in, admitted, d.Dropped != "")
	p.annotation(keys.CompletionIntentAt, at, hasIntentStamp)
	p.annotation(keys.CompletionIntentBy, by, hasIntentStamp)
	if in.Operation == Create {
		switch {
		case m.totals[owner.GroupKind] && (m.served == nil || m.served(owner.GroupKind)):
			p.finalizer(keys.TrackingFinalizer)
		case m.totals[owner.GroupKind]:
			// A kind with totals that the API server does not serve for
			// them now: tally adds no finalizer, and the match conditions
			// (which cannot tell) skip a pod stamped with one; the
			// aggregator releases it promptly, as any pod of a kind it
			// cannot serve.
		default:
			p.noFinalizer(keys.TrackingFinalizer)
		}
	}
	return d
}

// untracked decides a request for a pod whose controller is not of a
// tracked kind, or whose owner failed verification (d holds why). Such a
// request is refused only when it would remove or change an intent admitted
// before (admittedBefore: the stored pod was tracked, and tally stamped
// it), so that detaching a pod cannot launder its intent; any other is
// allowed. The only changes made are the removal of identity keys the pod
// must not carry, of -at/-by stamps that stand for no admitted intent, and
// on CREATE of the tracking finalizer.
func untracked(in Input, admitted bool, d Decision) Decision {
	if admitted {
		if denied := checkIntent(in, true); denied != "" {
			return Decision{Denied: denied}
		}
	}
	if d.Unverified == "" && !carriesTallyKeys(in.Pod) && !admitted && !clientTracking(in) {
		return d
	}
	p := patcher{in: in, d: &d}
	if in.Operation == Create {
		p.noFinalizer(keys.TrackingFinalizer)
	}
	p.label(keys.ParentUID, "", false)
	p.label(keys.ParentName, "", false)
	p.annotation(keys.Parent, "", false)
	var at, by string
	if admitted {
		at, by, _ = intentStamp(in, true, false)
	}
	p.annotation(keys.CompletionIntentAt, at, admitted)
	p.annotation(keys.CompletionIntentBy, by, admitted)
	return d
}

// clientTracking reports whether a CREATE carries the tracking finalizer,
// which only tally adds.
func clientTracking(in Input) bool {
	return in.Operation == Create && slices.Contains(in.Pod.Finalizers, keys.TrackingFinalizer)
}

// staleUpdate reports whether the API server refuses this update with 409
// Conflict whatever admission decides: its resourceVersion parses, as the
// API server parses it (a decimal uint64), to a version other than 0 (an
// unconditional update, as "" is) and other than the stored one's. One that
// does not parse is refused by the API server too, but as invalid: it is
// not stale.
func staleUpdate(in Input) bool {
	if in.Operation != Update || in.Old == nil {
		return false
	}
	sent, err := strconv.ParseUint(in.Pod.ResourceVersion, 10, 64)
	if err != nil || sent == 0 {
		return false
	}
	stored, err := strconv.ParseUint(in.Old.ResourceVersion, 10, 64)
	return err == nil && sent != stored
}

// trackedOwner returns the pod's controller owner when it is of a tracked
// kind.
func trackedOwner(pod *PodMeta, tracked map[schema.GroupKind]bool) (identity.Parent, bool) {
	ref, ok := identity.Controller(pod.OwnerReferences)
	if !ok {
		return identity.Parent{}, false
	}
	p := identity.Of(ref)
	return p, tracked[p.GroupKind]
}

func carriesTallyKeys(pod *PodMeta) bool {
	for k := range pod.Labels {
		if strings.HasPrefix(k, keys.Prefix) {
			return true
		}
	}
	for k := range pod.Annotations {
		if strings.HasPrefix(k, keys.Prefix) {
			return true
		}
	}
	return false
}

// alreadyStamped reports whether an UPDATE keeps the identity the stored pod
// already carries for this owner, so that the owner need not be checked
// again.
func alreadyStamped(in Input, owner identity.Parent) bool {
	return in.Operation == Update && in.Old != nil && stampedWith(in.Old, owner)
}

// stampedWith reports whether pod carries owner's identity, every key of
// it, as tally stamps it.
func stampedWith(pod *PodMeta, owner identity.Parent) bool {
	want := wantKeysOf(owner)
	name, hasName := pod.Labels[keys.ParentName]
	return pod.Labels[keys.ParentUID] == want.uid && pod.Annotations[keys.Parent] == want.parent && hasName == want.hasName && name == want.name
}

// wantKeys holds the identity keys' values a pod must carry.
type wantKeys struct {
	uid, name, parent          string
	hasUID, hasName, hasParent bool
}

func wantKeysOf(p identity.Parent) wantKeys {
	s := wantKeys{uid: string(p.UID), hasUID: true, parent: p.String(), hasParent: true}
	s.name, s.hasName = p.NameLabel()
	if !s.hasName {
		s.name = ""
	}
	return s
}

// checkIntent returns a denial message when the request changes or removes
// an admitted intent (admittedBefore), or sets an invalid reason. An intent
// the stored pod carried unadmitted is judged at first sight (firstSight),
// never refused.
func checkIntent(in Input, admitted bool) string {
	reason, has := in.Pod.Annotations[keys.CompletionIntent]
	if admitted {
		old := in.Old.Annotations[keys.CompletionIntent]
		switch {
		case !has:
			return fmt.Sprintf("annotation %s is sticky: it was set to %q and cannot be removed", keys.CompletionIntent, old)
		case reason != old:
			return fmt.Sprintf("annotation %s is sticky: it was set to %q and cannot be changed to %q", keys.CompletionIntent, old, reason)
		}
		return ""
	}
	if !has || carried(in) {
		return ""
	}
	if err := intent.ValidReason(reason); err != nil {
		return fmt.Sprintf("annotation %s: %v", keys.CompletionIntent, err)
	}
	return ""
}

// checkFinished returns a denial message when a request sets an intent on
// a tracked pod that has finished (admitted is admittedBefore). An intent
// counts only when it is admitted before its pod finishes, in the API
// server's order of events: the stored pod the request is admitted against
// says whether it has, so a pod's total never depends on when the
// aggregator looks. An intent the stored pod already carried is judged at
// first sight instead (firstSight).
func checkFinished(in Input, admitted bool) string {
	if admitted || in.Old == nil || !oldFinished(in) {
		return ""
	}
	if _, has := in.Pod.Annotations[keys.CompletionIntent]; !has || carried(in) {
		return ""
	}
	return fmt.Sprintf("annotation %s cannot be set on a pod that has finished (%s): an intent counts only when it is set before the pod finishes, and this pod's end is counted as unexpected", keys.CompletionIntent, howFinished(in))
}

// firstSight judges an intent that the stored pod carried while tally did
// not admit it (set before tally was installed, outside the webhook's
// scope, while the pod's kind was not tracked, or during an outage under
// failurePolicy Ignore) and that the request keeps: it returns why the
// intent is not admitted, or "" when it is admitted now. An invalid reason
// is not admitted, nor an intent on a pod that had already finished when
// tally first saw it, whatever it was set before: tally did not see when.
func firstSight(in Input) string {
	reason, has := in.Pod.Annotations[keys.CompletionIntent]
	if !has || !carried(in) {
		return ""
	}
	if err := intent.ValidReason(reason); err != nil {
		return err.Error()
	}
	if oldFinished(in) {
		return fmt.Sprintf("the pod had finished (%s) when tally first saw the intent", howFinished(in))
	}
	return ""
}

// carried reports whether the request keeps the intent the stored pod
// carries.
func carried(in Input) bool {
	if in.Old == nil {
		return false
	}
	old, had := in.Old.Annotations[keys.CompletionIntent]
	reason, has := in.Pod.Annotations[keys.CompletionIntent]
	return had && has && old == reason
}

// oldFinished reports whether the stored pod had finished.
func oldFinished(in Input) bool {
	return in.Old != nil && intent.Finished(in.OldPhase, in.Old.DeletionTimestamp != nil)
}

// howFinished says how the stored pod finished.
func howFinished(in Input) string {
	if in.Old.DeletionTimestamp != nil {
		return "its deletion was requested"
	}
	return fmt.Sprintf("phase %s", in.OldPhase)
}

// admittedBefore reports whether the stored pod carries an intent tally
// admitted: a valid reason with its -at and -by stamps, on a pod that tally
// stamped with the identity of its controller, of a tracked kind. Nothing
// else is proof: a pod tally did not stamp may carry any stamps its clients
// wrote while tally did not see it. Such an intent is sticky, also for the
// request that changes the pod's owner.
func (m *Mutator) admittedBefore(in Input) bool {
	if in.Operation != Update || in.Old == nil {
		return false
	}
	reason, had := in.Old.Annotations[keys.CompletionIntent]
	if !had {
		return false
	}
	if _, stamped := in.Old.Annotations[keys.CompletionIntentAt]; !stamped {
		return false
	}
	if _, stamped := in.Old.Annotations[keys.CompletionIntentBy]; !stamped {
		return false
	}
	owner, tracked := trackedOwner(in.Old, m.tracked)
	return tracked && stampedWith(in.Old, owner) && intent.ValidReason(reason) == nil
}

// Admitted reports whether the stored pod carries an intent tally admitted
// (see admittedBefore): on a pod that has finished, the only intent that
// counts.
func (m *Mutator) Admitted(pod *PodMeta) bool {
	return m.admittedBefore(Input{Operation: Update, Pod: pod, Old: pod})
}

// intentStamp returns the -at and -by values the pod must carry, and false
// when it must carry neither. admitted says that the stored pod carries an
// admitted intent (admittedBefore), dropped that the request's intent is
// not admitted at first sight.
func intentStamp(in Input, admitted, dropped bool) (at, by string, ok bool) {
	if _, has := in.Pod.Annotations[keys.CompletionIntent]; !has || dropped {
		return "", "", false
	}
	if admitted {
		// Keep what was stamped then.
		return in.Old.Annotations[keys.CompletionIntentAt], in.Old.Annotations[keys.CompletionIntentBy], true
	}
	by = in.User
	if carried(in) {
		// Set while tally did not see the pod, and admitted now at first
		// sight: nobody was observed setting it, and whatever stamps it
		// carries are a client's.
		by = UnobservedRequester
	}
	if at, ok := in.Pod.Annotations[keys.CompletionIntentAt]; ok && in.Pod.Annotations[keys.CompletionIntentBy] == by {
		if t, err := time.Parse(time.RFC3339, at); err == nil && t.Location() == time.UTC &&
			t.After(in.Now.Add(-intentClockSkew)) && t.Before(in.Now.Add(intentClockSkew)) {
			return at, by, true
		}
	}
	return in.Now.UTC().Format(time.RFC3339), by, true
}
