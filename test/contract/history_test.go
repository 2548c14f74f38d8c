package contract

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The keys the invariants read, spelled out from the SPEC's pod metadata
// contract rather than taken from pkg/keys: the checker is written from
// the contract, not from the code it checks.
const (
	parentUIDLabel   = "tally.dev/parent-uid"
	parentNameLabel  = "tally.dev/parent-name"
	parentAnnotation = "tally.dev/parent"
	intentKey        = "tally.dev/completion-intent"
	intentAtKey      = "tally.dev/completion-intent-at"
	intentByKey      = "tally.dev/completion-intent-by"
	trackingKey      = "tally.dev/tracking"
	unobserved       = "system:tally:unobserved"
	// reinvocationWindow is how far from the time of its request a stamp
	// may lie and still be the webhook's own (docs/metadata.md).
	reinvocationWindow = 30 * time.Second
)

var (
	labelValue = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)
	reasonRule = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
)

// kind is a parent kind the configuration tracks.
type kind struct {
	group, kind string
	// totals: its pods carry the tracking finalizer from their CREATE.
	totals bool
}

// version is one stored version of a pod, as a watch delivered it.
type version struct {
	pod *corev1.Pod
	// deleted: the watch said the pod is gone; pod is its last state.
	deleted bool
}

// sent is what the history knows of one request that the API server
// stored: who sent it, and when.
type sent struct {
	step          int
	user          string
	what          string
	before, after time.Time
	// main: the request went to the pods resource (CREATE, UPDATE,
	// PATCH, apply), which the webhook is registered for, and not to a
	// subresource or DELETE.
	main bool
}

// history is every stored version of the pods of one namespace in the API
// server's order, the requests that produced them, by resourceVersion, and
// when tally saw them. A version no request of the fuzzer stored is
// tally's aggregator's (its sweep's stamps, its release of the tracking
// finalizer) or the end of a deletion.
type history struct {
	views    *views
	versions []version
	requests map[string]sent
	// start is when the sequence began: the aggregator stamps no earlier.
	start time.Time
}

// violation is an invariant that a version broke.
type violation struct {
	pod     string
	uid     types.UID
	version string
	rule    string
	detail  string
}

func (v violation) String() string {
	return fmt.Sprintf("pod %s (uid %s) at resourceVersion %s: %s: %s", v.pod, v.uid, v.version, v.rule, v.detail)
}

// check returns every violation of the contract's invariants in h, on the
// versions that tally saw or judged (see checkPod):
//   - sticky: once a version carries an intent tally admitted (a valid
//     reason stamped -at/-by, on a pod stamped with its tracked
//     controller's identity), every later version carries the same intent,
//     -at and -by;
//   - no intent after the end: a tracked version that carries an intent
//     after its pod finished had it admitted before that;
//   - identity: a tracked version carries its controller's identity keys,
//     an untracked one none;
//   - invalid reason: a tracked version carries no intent but a valid
//     reason;
//   - stamps: -at and -by appear only with an intent and always with an
//     admitted one; a change to them comes from a stored request whose
//     requester -by names (or system:tally:unobserved) and whose time -at
//     is within the reinvocation window of, or from the aggregator as seen
//     now by system:tally:unobserved; stamps a client wrote while tally did
//     not see the pod do not outlast tally's first sight of it;
//   - tracking finalizer: on a pod's first version exactly when its
//     controller is of a kind with totals, and never added later but by
//     the aggregator.
func (h *history) check() []violation {
	var out []violation
	byUID := map[types.UID][]version{}
	var order []types.UID
	for _, v := range h.versions {
		if _, ok := byUID[v.pod.UID]; !ok {
			order = append(order, v.pod.UID)
		}
		byUID[v.pod.UID] = append(byUID[v.pod.UID], v)
	}
	for _, uid := range order {
		out = append(out, h.checkPod(byUID[uid])...)
	}
	return out
}

// checkPod checks the versions of one pod. A version is judged when tally
// decided it under the configuration of its span: stored through the pods
// resource while tally saw the namespace, or by the aggregator, changing
// tally's keys. A version stored while tally did not see the pod that
// changes its owners or tally's keys leaves it unjudged, as does a change
// of configuration, until tally judges it again: the invariants hold on
// the versions tally judged, and on those after them that tally saw.
func (h *history) checkPod(versions []version) []violation {
	var out []violation
	report := func(v *corev1.Pod, rule, format string, args ...any) {
		out = append(out, violation{pod: v.Name, uid: v.UID, version: v.ResourceVersion, rule: rule, detail: fmt.Sprintf(format, args...)})
	}
	var prev *corev1.Pod
	// admittedBeforeEnd: an intent tally admitted, or must take as
	// admitted, before the pod first finished; finished: a version so
	// far was finished; judgedUnder: the variant under which the pod's
	// keys were last judged, -1 when a version tally did not see changed
	// them since.
	admittedBeforeEnd, finished, judgedUnder := "", false, -1
	// lastChecked: the invariants were checked on the last version.
	lastChecked := false
	for i, v := range versions {
		pod := v.pod
		if v.deleted {
			// The last state, as the watch reports it: no request made it.
			break
		}
		variant, inView := h.views.at(pod.ResourceVersion)
		req, byFuzzer := h.requests[pod.ResourceVersion]
		judged := inView && (byFuzzer && req.main || !byFuzzer && tallyKeysChanged(prev, pod))
		// The stored pod the judgement was made against, and whether tally
		// had judged it under the same configuration.
		firstSight := judged && judgedUnder != variant
		switch {
		case judged:
			judgedUnder = variant
		case !inView && (prev == nil || tallyKeysChanged(prev, pod) || !slices.Equal(ownerUIDs(prev), ownerUIDs(pod))):
			judgedUnder = -1
		}
		kinds := allKinds
		if inView {
			kinds = variants[variant].kinds()
		}
		reason, hasIntent := pod.Annotations[intentKey]
		at, hasAt := pod.Annotations[intentAtKey]
		by, hasBy := pod.Annotations[intentByKey]
		owner, tracked := trackedOwner(kinds, pod)
		if tracked && inView && variants[variant].verifyOwner {
			// No owner exists: only a pod stamped with this owner's
			// identity before stays tracked.
			tracked = prev != nil && stampedFor(prev, owner)
		}
		checked := inView && judgedUnder == variant
		lastChecked = checked
		wasAdmitted := prev != nil && admitted(kinds, prev)

		if checked && wasAdmitted {
			for _, k := range []string{intentKey, intentAtKey, intentByKey} {
				if pod.Annotations[k] != prev.Annotations[k] {
					report(pod, "sticky", "%s was %q (admitted at %s) and is now %q", k, prev.Annotations[k], prev.Annotations[intentAtKey], pod.Annotations[k])
				}
			}
		}
		if checked && finished && tracked && hasIntent && admittedBeforeEnd != reason {
			report(pod, "no intent after the end", "tracked with intent %q, which was not admitted before the pod finished", reason)
		}
		switch {
		case !admitted(kinds, pod):
			admittedBeforeEnd = ""
		case !inView || !finished:
			// Admitted now, or stamped as tally stamps while tally did
			// not see the pod: tally cannot tell that from its own.
			admittedBeforeEnd = reason
		}
		finished = finished || isFinished(pod)

		if checked {
			want := map[string]string{}
			if tracked {
				want = identityOf(owner)
			}
			got := carriedIdentity(pod)
			if !mapsEqual(want, got) {
				report(pod, "identity", "carries %v, its controller %s says %v", got, describeOwner(owner, tracked), want)
			}

			if (hasAt || hasBy) && !hasIntent {
				report(pod, "stamps", "-at %q / -by %q without an intent", at, by)
			}
			if tracked && hasIntent && (!hasAt || !hasBy) {
				report(pod, "stamps", "tracked with intent %q but not stamped (-at %q, -by %q)", reason, at, by)
			}
			if tracked && hasIntent && !reasonRule.MatchString(reason) {
				report(pod, "invalid reason", "tracked with intent %q, which is no valid reason", reason)
			}
			kept := prev != nil && prev.Annotations[intentAtKey] == at && prev.Annotations[intentByKey] == by
			if hasAt && (!kept || firstSight && !wasAdmitted) {
				out = append(out, h.checkStamp(pod, at, by)...)
			}
		}

		hasTracking := slices.Contains(pod.Finalizers, trackingKey)
		switch {
		case i == 0 && judged && byFuzzer && hasTracking != (tracked && keepsTotals(kinds, owner)):
			report(pod, "tracking finalizer", "created with it %t, its controller %s", hasTracking, describeOwner(owner, tracked))
		case i > 0 && inView && byFuzzer && hasTracking && !slices.Contains(prev.Finalizers, trackingKey):
			report(pod, "tracking finalizer", "added by an update (%s)", h.requester(pod))
		}
		prev = pod
	}
	// The last version, when the invariants were not checked on it: tally
	// saw it long enough to judge it under the first variant (the sequence
	// ends by restoring it, and waits for the sweep).
	if n := len(versions); n > 0 && !versions[n-1].deleted && !lastChecked {
		last := versions[n-1].pod
		for _, problem := range unjudged(variants[0].kinds(), last) {
			report(last, "judged", "%s, after tally saw the pod long enough to judge it", problem)
		}
	}
	return out
}

// unjudged returns what pod carries that tally, having judged it, would
// not leave (the first variant: no owner verification): identity keys
// other than its tracked controller's, -at/-by without a tracked intent, a
// tracked intent that is invalid or not stamped.
func unjudged(kinds []kind, pod *corev1.Pod) []string {
	var out []string
	owner, tracked := trackedOwner(kinds, pod)
	want := map[string]string{}
	if tracked {
		want = identityOf(owner)
	}
	got := carriedIdentity(pod)
	if !mapsEqual(want, got) {
		out = append(out, fmt.Sprintf("identity %v, its controller %s says %v", got, describeOwner(owner, tracked), want))
	}
	reason, hasIntent := pod.Annotations[intentKey]
	_, hasAt := pod.Annotations[intentAtKey]
	_, hasBy := pod.Annotations[intentByKey]
	switch {
	case (hasAt || hasBy) && !(tracked && hasIntent):
		out = append(out, "-at/-by without a tracked intent")
	case tracked && hasIntent && !reasonRule.MatchString(reason):
		out = append(out, fmt.Sprintf("an invalid intent %q", reason))
	case tracked && hasIntent && (!hasAt || !hasBy):
		out = append(out, fmt.Sprintf("intent %q not stamped", reason))
	}
	return out
}

// carriedIdentity returns the identity keys pod carries, as identityOf
// names them.
func carriedIdentity(pod *corev1.Pod) map[string]string {
	got := map[string]string{}
	for _, k := range []string{parentUIDLabel, parentNameLabel} {
		if val, ok := pod.Labels[k]; ok {
			got["label "+k] = val
		}
	}
	if val, ok := pod.Annotations[parentAnnotation]; ok {
		got["annotation "+parentAnnotation] = val
	}
	return got
}

// admitted reports whether pod carries an intent tally admitted, as the
// contract tells it: a valid reason stamped -at and -by, on a pod stamped
// with the identity of its controller, of a tracked kind.
func admitted(kinds []kind, pod *corev1.Pod) bool {
	reason, has := pod.Annotations[intentKey]
	_, hasAt := pod.Annotations[intentAtKey]
	_, hasBy := pod.Annotations[intentByKey]
	if !has || !hasAt || !hasBy || !reasonRule.MatchString(reason) {
		return false
	}
	owner, tracked := trackedOwner(kinds, pod)
	return tracked && stampedFor(pod, owner)
}

// stampedFor reports whether pod carries every identity key of owner.
func stampedFor(pod *corev1.Pod, owner metav1.OwnerReference) bool {
	want := identityOf(owner)
	name, hasName := pod.Labels[parentNameLabel]
	wantName, wantsName := want["label "+parentNameLabel]
	return pod.Labels[parentUIDLabel] == want["label "+parentUIDLabel] && pod.Annotations[parentAnnotation] == want["annotation "+parentAnnotation] &&
		hasName == wantsName && name == wantName
}

// tallyKeysChanged reports whether pod's tally.dev/ labels or annotations
// differ from prev's (nil: none).
func tallyKeysChanged(prev, pod *corev1.Pod) bool {
	tallyKeys := func(p *corev1.Pod) map[string]string {
		out := map[string]string{}
		if p == nil {
			return out
		}
		for k, v := range p.Labels {
			if strings.HasPrefix(k, "tally.dev/") {
				out["label "+k] = v
			}
		}
		for k, v := range p.Annotations {
			if strings.HasPrefix(k, "tally.dev/") {
				out["annotation "+k] = v
			}
		}
		return out
	}
	return !mapsEqual(tallyKeys(prev), tallyKeys(pod))
}

// ownerUIDs lists a pod's owners and which is its controller.
func ownerUIDs(pod *corev1.Pod) []string {
	var out []string
	for _, r := range pod.OwnerReferences {
		out = append(out, fmt.Sprintf("%s/%s/%s/%t", r.APIVersion, r.Kind, r.UID, r.Controller != nil && *r.Controller))
	}
	return out
}

// checkStamp checks -at and -by values that a version shows for the first
// time against the request that stored it.
func (h *history) checkStamp(pod *corev1.Pod, at, by string) []violation {
	report := func(format string, args ...any) []violation {
		return []violation{{pod: pod.Name, uid: pod.UID, version: pod.ResourceVersion, rule: "stamps", detail: fmt.Sprintf(format, args...)}}
	}
	req, ok := h.requests[pod.ResourceVersion]
	if !ok {
		// The aggregator's: an intent it first saw, stamped as seen now
		// by no one observed.
		t, err := time.Parse(time.RFC3339, at)
		if by != unobserved || err != nil || t.Before(h.start.Truncate(time.Second).Add(-reinvocationWindow)) || t.After(time.Now()) {
			return report("-at %q / -by %q stored by no request the fuzzer sent, and not as the aggregator stamps", at, by)
		}
		return nil
	}
	if by != req.user && by != unobserved {
		return report("-by %q, stored by step %d of %s (%s)", by, req.step, req.user, req.what)
	}
	t, err := time.Parse(time.RFC3339, at)
	if err != nil || t.Location() != time.UTC {
		return report("-at %q is no RFC 3339 UTC time (step %d: %s)", at, req.step, req.what)
	}
	if t.Before(req.before.Truncate(time.Second).Add(-reinvocationWindow)) || t.After(req.after.Add(reinvocationWindow)) {
		return report("-at %s, stored by step %d sent at %s (%s): outside the reinvocation window", at, req.step, req.before.UTC().Format(time.RFC3339Nano), req.what)
	}
	return nil
}

func (h *history) requester(pod *corev1.Pod) string {
	if req, ok := h.requests[pod.ResourceVersion]; ok {
		return fmt.Sprintf("step %d by %s: %s", req.step, req.user, req.what)
	}
	return "no request the fuzzer sent"
}

// trackedOwner returns the pod's controller ownerReference and whether it
// names one of kinds (in any version of its group).
func trackedOwner(kinds []kind, pod *corev1.Pod) (metav1.OwnerReference, bool) {
	for _, ref := range pod.OwnerReferences {
		if ref.Controller == nil || !*ref.Controller {
			continue
		}
		group, _, found := strings.Cut(ref.APIVersion, "/")
		if !found {
			group = ""
		}
		for _, k := range kinds {
			if k.kind == ref.Kind && k.group == group && (found || k.group == "") {
				return ref, true
			}
		}
		return ref, false
	}
	return metav1.OwnerReference{}, false
}

// keepsTotals reports whether owner, of one of kinds, keeps totals.
func keepsTotals(kinds []kind, owner metav1.OwnerReference) bool {
	group, _, _ := strings.Cut(owner.APIVersion, "/")
	if !strings.Contains(owner.APIVersion, "/") {
		group = ""
	}
	for _, k := range kinds {
		if k.kind == owner.Kind && k.group == group {
			return k.totals
		}
	}
	return false
}

// identityOf is the identity keys a pod controlled by owner carries.
func identityOf(owner metav1.OwnerReference) map[string]string {
	group, _, found := strings.Cut(owner.APIVersion, "/")
	parent := owner.Kind + "/" + owner.Name
	if found {
		parent = owner.Kind + "." + group + "/" + owner.Name
	}
	want := map[string]string{"label " + parentUIDLabel: string(owner.UID), "annotation " + parentAnnotation: parent}
	if len(owner.Name) <= 63 && labelValue.MatchString(owner.Name) {
		want["label "+parentNameLabel] = owner.Name
	}
	return want
}

func describeOwner(owner metav1.OwnerReference, tracked bool) string {
	if owner.Kind == "" {
		return "(none)"
	}
	return fmt.Sprintf("%s %s %s (tracked %t)", owner.APIVersion, owner.Kind, owner.Name, tracked)
}

func isFinished(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed || pod.DeletionTimestamp != nil
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
