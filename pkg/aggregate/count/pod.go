package count

import (
	"context"
	"slices"
	"time"
	"unique"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/intent"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// Pod is what the aggregator's cache keeps of a pod: its identity and the
// few fields the counts read. The informer's transform (Reducer.Transform)
// replaces every watched pod with one, so that a cached pod costs a few
// hundred bytes instead of the whole object.
type Pod struct {
	// Meta holds name, namespace, UID, resourceVersion and
	// deletionTimestamp; labels, annotations, finalizers and
	// ownerReferences are folded into the fields below.
	Meta

	// ParentUID is the UID of the parent whose identity the pod carries in
	// the keys.ParentUID label or, for a misstamped pod, will carry once the
	// sweep corrects it (the one the webhook's rules give): the counts do
	// not wait for the correction.
	ParentUID types.UID
	// Controller is the pod's controller ownerReference; zero when it has
	// none.
	Controller Controller
	// Intent reports whether the pod carries keys.CompletionIntent.
	Intent bool
	// Phase is the pod's status.phase.
	Phase corev1.PodPhase
	// Tracking reports that the pod carries keys.TrackingFinalizer.
	Tracking bool
	// Misstamped reports that the pod's tally metadata is not what the
	// webhook's rules give it (set by a client the webhook did not see);
	// the backfill sweep corrects it.
	Misstamped bool
	// Unevaluated reports a pod read without its spec and status (by a
	// backfill sweep): its kind's custom counts cannot tell whether it
	// matches.
	Unevaluated bool
	// Matches has bit i set when custom count i of the pod's kind matches
	// the pod: each expression is evaluated on the whole pod as it
	// arrives, before the cache reduces it, so no field an expression
	// reads is ever missing (and none is kept).
	Matches uint32
	// FinishedAt is, for a finished pod carrying keys.TrackingFinalizer,
	// the time its own metadata shows for its finish (finishedAt), in Unix
	// seconds; 0 otherwise, or when it shows none. It bounds how
	// long the pod is held whatever became of the processes that saw it.
	FinishedAt int64
}

// Controller is a pod's controller ownerReference.
type Controller struct {
	// Kind is set only when the controller is of a tracked parent kind.
	Kind schema.GroupKind
	Name string
	UID  types.UID
}

var _ client.Object = (*Pod)(nil)

// DeepCopyObject implements runtime.Object.
func (p *Pod) DeepCopyObject() runtime.Object {
	out := *p
	if p.DeletionTimestamp != nil {
		t := *p.DeletionTimestamp
		out.DeletionTimestamp = &t
	}
	return &out
}

// Terminal reports whether the pod's phase is Succeeded or Failed.
func (p *Pod) Terminal() bool {
	return p.Phase == corev1.PodSucceeded || p.Phase == corev1.PodFailed
}

// Reducer reduces pods to what the cache keeps of them.
type Reducer struct {
	// kinds maps each tracked kind to itself, so that every cached pod
	// shares the configuration's strings.
	kinds map[schema.GroupKind]schema.GroupKind
	// rules are the webhook's, without owner verification: they tell
	// whether a pod's tally metadata is what it should be.
	rules *mutate.Mutator
	// custom are the custom counts of the kinds that define some.
	custom map[schema.GroupKind]*customCounts
}

// NewReducer returns a Reducer for the given parent kinds. A custom count
// that cannot be kept (config.CustomCount.Err) matches no pod.
func NewReducer(parents []config.Parent) *Reducer {
	kinds := make(map[schema.GroupKind]schema.GroupKind, len(parents))
	custom := map[schema.GroupKind]*customCounts{}
	for _, p := range parents {
		kinds[p.GroupKind()] = p.GroupKind()
		if len(p.CustomCounts) == 0 {
			continue
		}
		custom[p.GroupKind()] = newCustomCounts(p)
	}
	return &Reducer{kinds: kinds, rules: mutate.NewMutator(parents, nil), custom: custom}
}

// Transform is the pod informer's transform: it reduces a *corev1.Pod to a
// *Pod. Anything else (a tombstone, an object already reduced) passes
// through unchanged.
func (r *Reducer) Transform(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return r.Pod(pod), nil
}

// Pod returns what the cache keeps of pod. The strings many pods share (the
// namespace, the parent's UID and name, the phase) are interned: one copy
// for all the pods of a parent instead of one each.
func (r *Reducer) Pod(pod *corev1.Pod) *Pod {
	out := &Pod{
		Meta: Meta{
			Name: pod.Name, Namespace: Intern(pod.Namespace), UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			DeletionTimestamp: pod.DeletionTimestamp,
		},
		ParentUID: types.UID(Intern(pod.Labels[keys.ParentUID])),
		Phase:     phase(pod.Status.Phase),
	}
	_, out.Intent = pod.Annotations[keys.CompletionIntent]
	out.Tracking = slices.Contains(pod.Finalizers, keys.TrackingFinalizer)
	if out.Tracking && out.Finished() {
		if t := finishedAt(pod); !t.IsZero() {
			out.FinishedAt = t.Unix()
		}
	}
	if ref := metav1.GetControllerOfNoCopy(pod); ref != nil {
		out.Controller = Controller{Name: Intern(ref.Name), UID: ref.UID}
		if out.Controller.UID == out.ParentUID {
			// Share one string for the two equal UIDs.
			out.Controller.UID = out.ParentUID
		}
		if gv, err := schema.ParseGroupVersion(ref.APIVersion); err == nil {
			out.Controller.Kind = r.kinds[schema.GroupKind{Group: gv.Group, Kind: ref.Kind}]
		}
	}
	if c := r.custom[out.Controller.Kind]; c != nil {
		out.Matches = c.match(pod)
	}
	var parent types.UID
	var dropped bool
	out.Misstamped, parent, dropped = r.misstamped(pod, out)
	// An intent tally did not admit, and will not (firstSight), counts as
	// none: the sweep removes it.
	out.Intent = out.Intent && !dropped
	if out.Misstamped && parent != out.ParentUID {
		out.ParentUID = parent
		if parent == out.Controller.UID {
			out.ParentUID = out.Controller.UID
		}
	}
	return out
}

// finishedAt returns the time that pod's own metadata shows for its
// finish, never earlier than it: for a pod being deleted, when its
// deletion was asked for (deletionTimestamp less its grace period; a pod
// being deleted counts as finished from then on); for a terminal pod, the
// last change any client made to it (managedFields: the change to a
// terminal phase is one of them). Zero when the pod shows none.
func finishedAt(pod *corev1.Pod) time.Time {
	if dt := pod.DeletionTimestamp; dt != nil {
		t := dt.Time
		if g := pod.DeletionGracePeriodSeconds; g != nil {
			t = t.Add(-time.Duration(*g) * time.Second)
		}
		return t
	}
	var t time.Time
	for _, f := range pod.ManagedFields {
		if f.Time != nil && f.Time.After(t) {
			t = f.Time.Time
		}
	}
	return t
}

// Intern returns the canonical copy of s: the strings that pods share
// are held once. The canonical map holds them weakly (package unique), so it
// never outgrows what the cache holds.
func Intern(s string) string {
	if s == "" {
		return ""
	}
	return unique.Make(s).Value()
}

// phase returns p as one of the constants, which take no memory per pod.
func phase(p corev1.PodPhase) corev1.PodPhase {
	for _, known := range []corev1.PodPhase{corev1.PodPending, corev1.PodRunning, corev1.PodSucceeded, corev1.PodFailed, corev1.PodUnknown} {
		if p == known {
			return known
		}
	}
	return p
}

// misstamped applies the webhook's rules to the pod as if it were updated
// unchanged: any patch means its tally metadata is not what it should be.
// A pod carrying the tracking finalizer while its controller's kind keeps
// no totals (any more) is misstamped too: the backfill removes it. It also
// returns the UID of the parent whose identity the rules give the pod, and
// whether they remove the intent it carries (mutate.Decision.Dropped).
func (r *Reducer) misstamped(pod *corev1.Pod, reduced *Pod) (bool, types.UID, bool) {
	meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, DeletionTimestamp: pod.DeletionTimestamp}
	d := r.rules.Decide(context.Background(), mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, OldPhase: pod.Status.Phase})
	if reduced.Tracking && !r.rules.KeepsTotals(reduced.Controller.Kind) {
		return true, reduced.ParentUID, d.Dropped != ""
	}
	return len(d.Patch) > 0, d.Parent.UID, d.Dropped != ""
}

// Finished reports whether a pod will never run again (intent.Finished:
// terminal, or being deleted; the Job controller's rule).
func (p *Pod) Finished() bool {
	return intent.Finished(p.Phase, p.DeletionTimestamp != nil)
}
