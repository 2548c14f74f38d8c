package truth

import (
	"regexp"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"tally.dev/tally/pkg/config"
)

// Pod is what the pod metadata contract speaks of: a pod's metadata, its
// phase and whether its deletion was requested.
type Pod struct {
	ResourceVersion string
	Labels          map[string]string
	Annotations     map[string]string
	OwnerReferences []metav1.OwnerReference
	Finalizers      []string
	Phase           corev1.PodPhase
	Deleting        bool
}

// PodOf returns the part of pod the contract speaks of.
func PodOf(pod *corev1.Pod) *Pod {
	return &Pod{ResourceVersion: pod.ResourceVersion, Labels: pod.Labels, Annotations: pod.Annotations,
		OwnerReferences: pod.OwnerReferences, Finalizers: pod.Finalizers, Phase: pod.Status.Phase, Deleting: pod.DeletionTimestamp != nil}
}

// Contract is the pod metadata contract of the SPEC (and docs/metadata.md),
// written from them and not from the webhook's code: given the stored pod
// (none on CREATE) and the pod a client asks for, the tally keys the
// admitted pod must carry, or that the request is refused. Every kind with
// totals is served.
type Contract struct {
	tracked, totals map[schema.GroupKind]bool
	// Verified, when set (verifyOwner), says whether an owner exists as
	// its reference names it.
	Verified func(metav1.OwnerReference) bool
}

// NewContract returns the contract for the parent kinds of a configuration.
func NewContract(parents []config.Parent) Contract {
	c := Contract{tracked: map[schema.GroupKind]bool{}, totals: map[schema.GroupKind]bool{}}
	for _, p := range parents {
		c.tracked[p.GroupKind()] = true
		c.totals[p.GroupKind()] = p.Tracked()
	}
	return c
}

// Outcome is what the contract says of one request.
type Outcome struct {
	// Conflict: the API server refuses the request as stale (409), and
	// nothing is stored, whatever admission decides.
	Conflict bool
	// Denied: the request is refused (403).
	Denied bool
	// Keys are the admitted pod's tally.dev/ labels ("label:" prefix) and
	// annotations ("annotation:" prefix), as Keys reads them.
	Keys map[string]string
	// Tracking says whether it carries the tracking finalizer.
	Tracking bool
}

// The contract's names, spelled out from the SPEC rather than taken from
// the code it checks.
const (
	create = "CREATE"
	update = "UPDATE"

	parentUIDKey = "tally.dev/parent-uid"
	parentKey    = "tally.dev/parent"
	intentKey    = "tally.dev/completion-intent"
	intentAtKey  = "tally.dev/completion-intent-at"
	intentByKey  = "tally.dev/completion-intent-by"
	trackingKey  = "tally.dev/tracking"
	unobserved   = "system:tally:unobserved"
	// reinvocationWindow: a stamp already on a request, by its requester,
	// within this of now, is the webhook's own from an earlier invocation
	// of the same request.
	reinvocationWindow = 30 * time.Second
)

var (
	reasonRule = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	labelValue = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)
)

// owner returns the kind and ref of the pod's controller ownerReference,
// and whether it names a tracked kind: the group is what precedes the
// version in the apiVersion ("v1": the core group; "/v1" names none).
func (c Contract) owner(pod *Pod) (schema.GroupKind, metav1.OwnerReference, bool) {
	if pod == nil {
		return schema.GroupKind{}, metav1.OwnerReference{}, false
	}
	for _, ref := range pod.OwnerReferences {
		if ref.Controller == nil || !*ref.Controller {
			continue
		}
		group := ""
		if i := strings.LastIndex(ref.APIVersion, "/"); i >= 0 {
			group = ref.APIVersion[:i]
			if group == "" {
				return schema.GroupKind{}, ref, false
			}
		}
		gk := schema.GroupKind{Group: group, Kind: ref.Kind}
		return gk, ref, c.tracked[gk]
	}
	return schema.GroupKind{}, metav1.OwnerReference{}, false
}

// stampedFor reports whether pod carries every identity key of the
// controller ref, of kind.
func stampedFor(pod *Pod, kind schema.GroupKind, ref metav1.OwnerReference) bool {
	name, hasName := pod.Labels["tally.dev/parent-name"]
	wantName := len(ref.Name) <= 63 && labelValue.MatchString(ref.Name)
	return pod.Labels[parentUIDKey] == string(ref.UID) && pod.Annotations[parentKey] == identity(kind, ref) &&
		hasName == wantName && (!wantName || name == ref.Name)
}

// identity is the tally.dev/parent value of a controller of kind.
func identity(kind schema.GroupKind, ref metav1.OwnerReference) string {
	if kind.Group == "" {
		return ref.Kind + "/" + ref.Name
	}
	return ref.Kind + "." + kind.Group + "/" + ref.Name
}

// Stale reports whether the API server refuses an UPDATE as stale: the
// request's resourceVersion, read as the API server reads it (a decimal
// uint64; 0 or empty: an unconditional update), names another version than
// the stored one.
func Stale(op string, stored, req *Pod) bool {
	if op != update || stored == nil {
		return false
	}
	sent, err := strconv.ParseUint(req.ResourceVersion, 10, 64)
	if err != nil || sent == 0 {
		return false
	}
	have, err := strconv.ParseUint(stored.ResourceVersion, 10, 64)
	return err == nil && sent != have
}

// Admit says what the contract makes of the request op ("CREATE" or
// "UPDATE") by user at now, of the pod req, stored as stored before (nil on
// CREATE).
func (c Contract) Admit(op string, stored, req *Pod, user string, now time.Time) Outcome {
	if Stale(op, stored, req) {
		return Outcome{Conflict: true}
	}
	kind, ref, trackedNow := c.owner(req)
	oldKind, oldRef, trackedBefore := c.owner(stored)
	if trackedNow && c.Verified != nil && !c.Verified(ref) {
		// verifyOwner: an owner not found is not tracked, unless the
		// stored pod already carries its identity (checked before).
		trackedNow = op == update && stampedFor(stored, kind, ref)
	}
	var storedIntent, storedAt, storedBy string
	var had, hadAt, hadBy, stampedBefore bool
	if stored != nil {
		storedIntent, had = stored.Annotations[intentKey]
		storedAt, hadAt = stored.Annotations[intentAtKey]
		storedBy, hadBy = stored.Annotations[intentByKey]
		// Stamped by tally: the stored pod carries the identity of its
		// controller, of a tracked kind.
		stampedBefore = trackedBefore && stampedFor(stored, oldKind, oldRef)
	}
	reason, has := req.Annotations[intentKey]
	// Sticky, whatever the owner after: a valid intent stamped -at/-by on
	// a pod tally stamped was admitted. Nothing else is proof of it.
	wasAdmitted := op == update && had && reasonRule.MatchString(storedIntent) && hadAt && hadBy && stampedBefore
	if wasAdmitted && (!has || reason != storedIntent) {
		return Outcome{Denied: true}
	}
	finished := stored != nil && (stored.Phase == corev1.PodSucceeded || stored.Phase == corev1.PodFailed || stored.Deleting)
	// carried: the request keeps an intent the stored pod carried
	// unadmitted, which tally judges at first sight, refusing nothing.
	carried := had && has && storedIntent == reason
	if trackedNow && has && !wasAdmitted && !carried && !reasonRule.MatchString(reason) {
		return Outcome{Denied: true}
	}
	// An intent not admitted before the pod finished is never admitted:
	// one set now is refused, one carried from before tally saw it is
	// removed, as is an invalid one.
	if trackedNow && has && !wasAdmitted && !carried && finished {
		return Outcome{Denied: true}
	}
	dropped := trackedNow && !wasAdmitted && carried && (finished || !reasonRule.MatchString(reason))

	out := Outcome{Keys: map[string]string{}}
	if trackedNow {
		out.Keys["label:"+parentUIDKey] = string(ref.UID)
		if len(ref.Name) <= 63 && labelValue.MatchString(ref.Name) {
			out.Keys["label:tally.dev/parent-name"] = ref.Name
		}
		out.Keys["annotation:"+parentKey] = identity(kind, ref)
	}
	nowStamp := now.UTC().Format(time.RFC3339)
	if has && !dropped {
		out.Keys["annotation:"+intentKey] = reason
		switch {
		case wasAdmitted:
			out.Keys["annotation:"+intentAtKey], out.Keys["annotation:"+intentByKey] = storedAt, storedBy
		case trackedNow:
			by := user
			if carried {
				by = unobserved // set while tally did not see it: nobody seen setting it
			}
			at := nowStamp
			if t, err := time.Parse(time.RFC3339, req.Annotations[intentAtKey]); err == nil && t.Location() == time.UTC &&
				req.Annotations[intentByKey] == by && t.After(now.Add(-reinvocationWindow)) && t.Before(now.Add(reinvocationWindow)) {
				at = req.Annotations[intentAtKey]
			}
			out.Keys["annotation:"+intentAtKey], out.Keys["annotation:"+intentByKey] = at, by
		}
	}
	// Only tally adds the tracking finalizer: the webhook at CREATE, to
	// the pods of a kind with totals, and a client's is removed then.
	for _, f := range req.Finalizers {
		out.Tracking = out.Tracking || f == trackingKey
	}
	if op == create {
		out.Tracking = trackedNow && c.totals[kind]
	}
	return out
}

// Keys reads what Outcome.Keys and Outcome.Tracking hold from a pod.
func Keys(pod *Pod) (map[string]string, bool) {
	keys := map[string]string{}
	for k, v := range pod.Labels {
		if strings.HasPrefix(k, "tally.dev/") {
			keys["label:"+k] = v
		}
	}
	for k, v := range pod.Annotations {
		if strings.HasPrefix(k, "tally.dev/") {
			keys["annotation:"+k] = v
		}
	}
	tracking := false
	for _, f := range pod.Finalizers {
		tracking = tracking || f == trackingKey
	}
	return keys, tracking
}
