// Package intent is the helper for operators written with controller-runtime:
// it marks a pod for completion the way tally's webhook admits, and holds
// the rule for reason tokens. Operators in other languages write the same
// annotation (docs/frameworks.md).
package intent

import (
	"context"
	"encoding/json"
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

// MarkForCompletion records on the pod that its parent asked it to complete,
// for reason. It patches that one annotation, so it never conflicts with
// other writers of the pod; marking a pod already marked with the same
// reason changes nothing. The webhook refuses to change an admitted reason.
// On success pod holds the pod as stored, with the webhook's -at and -by
// stamps.
func MarkForCompletion(ctx context.Context, c client.Client, pod *corev1.Pod, reason string) error {
	if err := ValidReason(reason); err != nil {
		return fmt.Errorf("marking pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if current, ok := Marked(pod); ok && current == reason {
		return nil
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
