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

var labelValue = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)

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
}

// history is every stored version of the pods of one namespace in the API
// server's order, and the requests that produced them, by resourceVersion.
type history struct {
	kinds    []kind
	versions []version
	requests map[string]sent
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

// check returns every violation of the contract's invariants in h:
//   - sticky: once a version carries an intent stamped with -at, every later
//     version carries the same intent, -at and -by;
//   - no intent after the end: a tracked version that carries an intent
//     after its pod finished had it admitted (stamped) before that;
//   - identity: a tracked version carries its controller's identity keys,
//     an untracked one none;
//   - stamps: -at and -by appear only with an intent and always with an
//     admitted one; a change to them comes from a stored request whose
//     requester -by names (or system:tally:unobserved) and whose time -at
//     is within the reinvocation window of;
//   - tracking finalizer: on a pod's first version exactly when its
//     controller is of a kind with totals, and never added later.
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

func (h *history) checkPod(versions []version) []violation {
	var out []violation
	report := func(v *corev1.Pod, rule, format string, args ...any) {
		out = append(out, violation{pod: v.Name, uid: v.UID, version: v.ResourceVersion, rule: rule, detail: fmt.Sprintf(format, args...)})
	}
	var prev *corev1.Pod
	// admittedBeforeEnd: an intent stamped with -at on a version before
	// the pod first finished; finished: a version so far was finished.
	admittedBeforeEnd, finished := "", false
	for i, v := range versions {
		pod := v.pod
		if v.deleted {
			// The last state, as the watch reports it: no request made it.
			break
		}
		reason, hasIntent := pod.Annotations[intentKey]
		at, hasAt := pod.Annotations[intentAtKey]
		by, hasBy := pod.Annotations[intentByKey]
		owner, tracked := h.trackedOwner(pod)

		if prev != nil {
			if prevAt, ok := prev.Annotations[intentAtKey]; ok && prev.Annotations[intentKey] != "" {
				for _, k := range []string{intentKey, intentAtKey, intentByKey} {
					if pod.Annotations[k] != prev.Annotations[k] {
						report(pod, "sticky", "%s was %q (admitted at %s) and is now %q", k, prev.Annotations[k], prevAt, pod.Annotations[k])
					}
				}
			}
		}
		if finished && tracked && hasIntent && admittedBeforeEnd != reason {
			report(pod, "no intent after the end", "tracked with intent %q, which was not admitted before the pod finished", reason)
		}
		if !finished && hasIntent && hasAt {
			admittedBeforeEnd = reason
		}
		finished = finished || isFinished(pod)

		want := map[string]string{}
		if tracked {
			want = identityOf(owner)
		}
		got := map[string]string{}
		for _, k := range []string{parentUIDLabel, parentNameLabel} {
			if val, ok := pod.Labels[k]; ok {
				got["label "+k] = val
			}
		}
		if val, ok := pod.Annotations[parentAnnotation]; ok {
			got["annotation "+parentAnnotation] = val
		}
		if !mapsEqual(want, got) {
			report(pod, "identity", "carries %v, its controller %s says %v", got, describeOwner(owner, tracked), want)
		}

		if (hasAt || hasBy) && !hasIntent {
			report(pod, "stamps", "-at %q / -by %q without an intent", at, by)
		}
		if tracked && hasIntent && (!hasAt || !hasBy) {
			report(pod, "stamps", "tracked with intent %q but not stamped (-at %q, -by %q)", reason, at, by)
		}
		if hasAt && (prev == nil || prev.Annotations[intentAtKey] != at || prev.Annotations[intentByKey] != by) {
			out = append(out, h.checkStamp(pod, at, by)...)
		}

		hasTracking := slices.Contains(pod.Finalizers, trackingKey)
		switch {
		case i == 0 && hasTracking != h.keepsTotals(owner, tracked):
			report(pod, "tracking finalizer", "created with it %t, its controller %s", hasTracking, describeOwner(owner, tracked))
		case i > 0 && hasTracking && !slices.Contains(prev.Finalizers, trackingKey):
			report(pod, "tracking finalizer", "added by an update (%s)", h.requester(pod))
		}
		prev = pod
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
		return report("-at %q / -by %q stored by no request the fuzzer sent", at, by)
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
// names a tracked kind (in any version of its group).
func (h *history) trackedOwner(pod *corev1.Pod) (metav1.OwnerReference, bool) {
	for _, ref := range pod.OwnerReferences {
		if ref.Controller == nil || !*ref.Controller {
			continue
		}
		group, _, found := strings.Cut(ref.APIVersion, "/")
		if !found {
			group = ""
		}
		for _, k := range h.kinds {
			if k.kind == ref.Kind && k.group == group && (found || k.group == "") {
				return ref, true
			}
		}
		return ref, false
	}
	return metav1.OwnerReference{}, false
}

func (h *history) keepsTotals(owner metav1.OwnerReference, tracked bool) bool {
	if !tracked {
		return false
	}
	group, _, _ := strings.Cut(owner.APIVersion, "/")
	if !strings.Contains(owner.APIVersion, "/") {
		group = ""
	}
	for _, k := range h.kinds {
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
