// Package identity holds the rule that names a pod's parent in the pod's
// metadata: the tally.dev/parent-uid and tally.dev/parent-name labels and
// the tally.dev/parent annotation, derived from the pod's controller
// ownerReference. The webhook and the aggregator's sweep apply it to every
// pod; an operator may apply it itself, with Stamp, to the pods it creates,
// so that the API server need not call the webhook for them.
package identity

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"tally.dev/tally/pkg/keys"
)

// Parent identifies a pod's controller owner.
type Parent struct {
	GroupKind schema.GroupKind
	Name      string
	UID       types.UID
}

// Of returns the parent an ownerReference names. The group is the
// apiVersion up to its last '/', and empty when it has none (the core
// group), whatever the version; "/v1" names no group at all (noGroup).
func Of(ref metav1.OwnerReference) Parent {
	group := ""
	if i := strings.LastIndexByte(ref.APIVersion, '/'); i >= 0 {
		group = ref.APIVersion[:i]
		if group == "" {
			// "/v1" names no group: the core group's apiVersion has no
			// '/' (the registration's match conditions read it so too).
			group = noGroup
		}
	}
	return Parent{GroupKind: schema.GroupKind{Group: group, Kind: ref.Kind}, Name: ref.Name, UID: ref.UID}
}

// noGroup is the group of an apiVersion with an empty group before its '/':
// no kind is tracked in it.
const noGroup = "/"

// Controller returns the first ownerReference of refs that is a controller,
// and false when there is none.
func Controller(refs []metav1.OwnerReference) (metav1.OwnerReference, bool) {
	for _, ref := range refs {
		if ref.Controller != nil && *ref.Controller {
			return ref, true
		}
	}
	return metav1.OwnerReference{}, false
}

// String returns the parent's full identity, the keys.Parent annotation's
// value: "<Kind>.<group>/<name>", or "<Kind>/<name>" for the core group.
func (p Parent) String() string {
	if p.GroupKind.Group == "" {
		return p.GroupKind.Kind + "/" + p.Name
	}
	return p.GroupKind.Kind + "." + p.GroupKind.Group + "/" + p.Name
}

// NameLabel returns the keys.ParentName label's value, and false when the
// pod carries no such label because the name is not a valid label value
// (longer than 63 characters).
func (p Parent) NameLabel() (string, bool) {
	return p.Name, len(validation.IsValidLabelValue(p.Name)) == 0
}

// Stamp sets on pod, which an operator is about to create, the identity of
// its controller owner, exactly as the webhook would: the API server then
// need not call the webhook for it. Set the controller ownerReference first
// (controllerutil.SetControllerReference), and stamp only pods whose parent
// kind tally tracks: the webhook removes identity keys from other pods. It
// reports false, and changes nothing, when pod has no controller owner.
//
// Stamping is an optimisation, never a requirement: pods that are not
// stamped are stamped by the webhook. A pod whose kind keeps cumulative
// totals is still sent to the webhook on creation, which alone decides
// whether it gets the tracking finalizer.
func Stamp(pod *corev1.Pod) bool {
	ref, ok := Controller(pod.OwnerReferences)
	if !ok {
		return false
	}
	p := Of(ref)
	if pod.Labels == nil {
		pod.Labels = map[string]string{}
	}
	pod.Labels[keys.ParentUID] = string(p.UID)
	if name, ok := p.NameLabel(); ok {
		pod.Labels[keys.ParentName] = name
	} else {
		delete(pod.Labels, keys.ParentName)
	}
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	pod.Annotations[keys.Parent] = p.String()
	return true
}
