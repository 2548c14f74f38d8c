// Package truth computes what tally must produce straight from the
// specification, sharing no code with tally: a parent's counts from its
// pods (the demo and the suites compare what tally writes with them,
// computed from a fresh List), and what the pod metadata contract makes of
// one request (the contract fuzzers run it beside the webhook).
package truth

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// Counts counts the pods of the parent with UID uid in namespace ns: S(P)
// is the pods in P's namespace whose controller ownerReference carries P's
// UID, labelled or not. A pod's intent counts when tally admitted it, or
// admits it when it first sees the pod: a valid reason stamped -at/-by on a
// pod stamped with P's identity, or a valid reason on a pod that has not
// finished.
func Counts(pods []corev1.Pod, ns string, uid types.UID) map[config.Count]int64 {
	got := map[config.Count]int64{config.Completing: 0, config.Completed: 0, config.Active: 0, config.Unexpected: 0}
	for i := range pods {
		p := &pods[i]
		ref := metav1.GetControllerOf(p)
		if p.Namespace != ns || ref == nil || ref.UID != uid {
			continue
		}
		reason, intent := p.Annotations[keys.CompletionIntent]
		terminal := p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
		_, at := p.Annotations[keys.CompletionIntentAt]
		_, by := p.Annotations[keys.CompletionIntentBy]
		gv, _ := schema.ParseGroupVersion(ref.APIVersion)
		stamped := at && by && stampedFor(PodOf(p), schema.GroupKind{Group: gv.Group, Kind: ref.Kind}, *ref)
		intent = intent && reasonRule.MatchString(reason) && (stamped || !terminal && p.DeletionTimestamp == nil)
		switch {
		case intent && !terminal:
			got[config.Completing]++
		case intent && terminal:
			got[config.Completed]++
		case !intent && (terminal || p.DeletionTimestamp != nil):
			got[config.Unexpected]++
		default:
			got[config.Active]++
		}
	}
	return got
}
