package aggregate

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// stamp applies the webhook's rules to pod and patches it when they change
// it, reading it again when it changed in between. key, when set, is the
// pod's entry in Unstamped: forgotten when the pod is gone.
func (s *sweep) stamp(ctx context.Context, pod *metav1.PartialObjectMetadata, key string) {
	if key == "" {
		s.seen++ // a cached pod; the unlabelled ones were seen by read
	}
	for attempt := 1; ; attempt++ {
		var phase corev1.PodPhase
		if _, marked := pod.Annotations[keys.CompletionIntent]; marked {
			// An intent tally did not admit is judged now, and whether the
			// pod had finished decides it: read the phase, at the version
			// the patch is tested against.
			full := &corev1.Pod{}
			if err := s.reader.Get(ctx, client.ObjectKeyFromObject(pod), full); err != nil {
				if apierrors.IsNotFound(err) && key != "" {
					s.Unstamped.Forget(key, true)
				} else if !apierrors.IsNotFound(err) {
					s.report(pod, fmt.Sprintf("reading the pod: %v", err))
				}
				return
			}
			pod.ObjectMeta, phase = full.ObjectMeta, full.Status.Phase
		}
		meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, DeletionTimestamp: pod.DeletionTimestamp}
		d := s.rules.Decide(ctx, mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, OldPhase: phase, Now: time.Now()})
		switch {
		case d.Denied != "":
			s.report(pod, d.Denied)
			return
		case d.Unavailable != "":
			s.report(pod, d.Unavailable)
			return
		case d.Unverified != "" && attempt == 1:
			// Not stamped, as the webhook would not; identity keys a client
			// set are still removed by the patch.
			s.report(pod, d.Unverified)
		}
		if d.Dropped != "" {
			s.log.Info("Removing a completion intent first seen on a pod: it is not admitted, and the pod's end counts as unexpected",
				"pod", client.ObjectKeyFromObject(pod), "intent", pod.Annotations[keys.CompletionIntent], "reason", d.Dropped)
		}
		untrack := s.untrack(pod)
		patch := append(d.Patch, untrack...)
		if len(patch) == 0 {
			return
		}
		// The patch holds only if the pod is still the one decided on.
		ops := append([]mutate.PatchOp{{Op: "test", Path: "/metadata/resourceVersion", Value: pod.ResourceVersion}}, patch...)
		err := s.writer.Patch(ctx, pod, client.RawPatch(types.JSONPatchType, mutate.AppendPatch(nil, ops)), client.FieldOwner(FieldManager))
		switch {
		case err == nil:
			podsStamped.Inc()
			s.stamped++
			if len(untrack) > 0 {
				s.releasedOne(pod)
			}
			if log := s.log.V(1); log.Enabled() {
				log.Info("Stamped pod", "pod", client.ObjectKeyFromObject(pod), "parent", pod.Annotations[keys.Parent])
			}
			return
		case apierrors.IsNotFound(err):
			if key != "" {
				s.Unstamped.Forget(key, true)
			}
			return
		case (apierrors.IsConflict(err) || apierrors.IsInvalid(err)) && attempt < stampAttempts:
			// Changed since it was read: decide again on what it is now.
			k := client.ObjectKeyFromObject(pod)
			*pod = *podMeta(k.Namespace, k.Name)
			if err := s.reader.Get(ctx, k, pod); err != nil {
				if apierrors.IsNotFound(err) && key != "" {
					s.Unstamped.Forget(key, true)
				} else if !apierrors.IsNotFound(err) {
					s.report(pod, fmt.Sprintf("reading the pod: %v", err))
				}
				return
			}
		default:
			s.report(pod, fmt.Sprintf("patching the pod: %v", err))
			return
		}
	}
}

// releasedPods are the pods of one controller whose tracking finalizer a
// sweep removed.
type releasedPods struct {
	controller metav1.OwnerReference
	namespace  string
	names      []string
}

// releasedOne counts the release of pod's tracking finalizer by the sweep,
// and keeps it for reportReleased.
func (s *sweep) releasedOne(pod *metav1.PartialObjectMetadata) {
	ref := metav1.GetControllerOfNoCopy(pod)
	if ref == nil {
		trackingFinalizers.WithLabelValues("", "orphaned").Inc()
		return
	}
	gv, _ := schema.ParseGroupVersion(ref.APIVersion)
	trackingFinalizers.WithLabelValues(schema.GroupKind{Group: gv.Group, Kind: ref.Kind}.String(), "orphaned").Inc()
	if s.released == nil {
		s.released = map[types.UID]*releasedPods{}
	}
	r := s.released[ref.UID]
	if r == nil {
		r = &releasedPods{controller: *ref, namespace: pod.Namespace}
		s.released[ref.UID] = r
	}
	r.names = append(r.names, pod.Name)
}

// reportReleased sends one Warning Event on each controller whose pods the
// sweep released.
func (s *sweep) reportReleased() {
	if s.recorder == nil {
		return
	}
	for _, r := range s.released {
		parent := &unstructured.Unstructured{}
		parent.SetAPIVersion(r.controller.APIVersion)
		parent.SetKind(r.controller.Kind)
		parent.SetNamespace(r.namespace)
		parent.SetName(r.controller.Name)
		parent.SetUID(r.controller.UID)
		reportOptedOut(s.recorder, parent, parent.GroupVersionKind().GroupKind().String(), r.names)
	}
}

// untrack returns the operation that removes the tracking finalizer from a
// pod whose controller's kind keeps no totals (it was removed from the
// configuration, or its totals were), and none otherwise. The pods of kinds
// that keep totals lose it through their parent's reconciler.
func (s *sweep) untrack(pod *metav1.PartialObjectMetadata) []mutate.PatchOp {
	i := slices.Index(pod.Finalizers, keys.TrackingFinalizer)
	if i < 0 {
		return nil
	}
	if ref := metav1.GetControllerOfNoCopy(pod); ref != nil {
		if gv, err := schema.ParseGroupVersion(ref.APIVersion); err == nil && s.rules.KeepsTotals(schema.GroupKind{Group: gv.Group, Kind: ref.Kind}) {
			return nil
		}
	}
	return []mutate.PatchOp{{Op: "remove", Path: "/metadata/finalizers/" + strconv.Itoa(i)}}
}

// report records a pod that could not be stamped.
func (s *sweep) report(pod *metav1.PartialObjectMetadata, reason string) {
	s.unstamped++
	s.log.Info("Pod could not be stamped; the next backfill sweep tries again", "pod", client.ObjectKeyFromObject(pod), "reason", reason)
}

var (
	podListGVK = corev1.SchemeGroupVersion.WithKind("PodList")
	// unlabelled selects the pods without the keys.ParentUID label.
	unlabelled = func() labels.Selector {
		req, err := labels.NewRequirement(keys.ParentUID, selection.DoesNotExist, nil)
		if err != nil {
			panic(err) // the key is a valid label key
		}
		return labels.NewSelector().Add(*req)
	}()
)

func podMeta(ns, name string) *metav1.PartialObjectMetadata {
	pod := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	pod.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Pod"))
	return pod
}

// sleep waits for d, and reports false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
