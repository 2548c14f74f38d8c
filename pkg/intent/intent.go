// Package intent is the helper for operators written with controller-runtime:
// it marks a pod for completion the way tally's webhook admits, and holds
// the rule for reason tokens. Operators in other languages write the same
// annotation (docs/frameworks.md).
package intent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/keys"
)

var reasonToken = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

// ValidReason returns an error when reason is not a valid completion-intent
// reason: 1 to 63 lowercase letters, digits or '-', starting and ending with
// a letter or digit.
func ValidReason(reason string) error {
	if !reasonToken.MatchString(reason) {
		return fmt.Errorf("%q is not a valid reason: it must be 1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit (e.g. scale-down)", reason)
	}
	return nil
}

// Marked reports whether the pod carries a completion intent, and its reason.
func Marked(pod *corev1.Pod) (reason string, ok bool) {
	reason, ok = pod.Annotations[keys.CompletionIntent]
	return reason, ok
}

// Finished reports whether a pod in phase, whose deletion was requested or
// not, has finished: it will never run again. It is terminal, or it is being
// deleted (the Kubernetes Job controller's rule: the kubelet never starts
// the containers of a pod being deleted again). An intent counts only when
// it is admitted before its pod finishes: tally's webhook refuses one set on
// a pod that has finished, whose end is then counted as unexpected.
func Finished(phase corev1.PodPhase, deleting bool) bool {
	return phase == corev1.PodSucceeded || phase == corev1.PodFailed || deleting
}

// ErrFinished is returned by MarkForCompletion for a pod that has already
// finished: its end is counted as unexpected, and marking it would be
// refused.
var ErrFinished = errors.New("the pod has already finished: an intent must be set before a pod finishes")

// MarkForCompletion records on the pod that its parent asked it to complete,
// for reason. It patches that one annotation, so it never conflicts with
// other writers of the pod; marking a pod already marked with the same
// reason changes nothing. The webhook refuses to change an admitted reason,
// and to mark a pod that has finished: for a pod that pod shows finished it
// returns ErrFinished without a request, and if the pod finished after pod
// was read the API server's refusal (Forbidden) is returned; the caller's
// next read shows it finished. On success pod holds the pod as stored, with
// the webhook's -at and -by stamps.
func MarkForCompletion(ctx context.Context, c client.Client, pod *corev1.Pod, reason string) error {
	if err := ValidReason(reason); err != nil {
		return fmt.Errorf("marking pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if current, ok := Marked(pod); ok && current == reason {
		return nil
	}
	if Finished(pod.Status.Phase, pod.DeletionTimestamp != nil) {
		return fmt.Errorf("marking pod %s/%s (phase %s): %w", pod.Namespace, pod.Name, pod.Status.Phase, ErrFinished)
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{keys.CompletionIntent: reason}}})
	if err != nil {
		return err
	}
	if err := c.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return fmt.Errorf("marking pod %s/%s for completion: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}
