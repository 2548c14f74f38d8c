// Package counttest builds pods as the aggregator's cache shows them, for
// tests.
package counttest

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
)

// Pod returns a cached pod named uid in namespace "ns", with the phase,
// the tracking finalizer and an intent as given, being deleted when
// deleting.
func Pod(uid types.UID, phase corev1.PodPhase, tracking, intent, deleting bool) *count.Pod {
	p := &count.Pod{Meta: count.Meta{Name: string(uid), Namespace: "ns", UID: uid}, Phase: phase, Tracking: tracking, Intent: intent}
	if deleting {
		p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	}
	return p
}

// UIDs returns the UIDs of pods, in order; nil for none.
func UIDs(pods []*count.Pod) []types.UID {
	var out []types.UID
	for _, p := range pods {
		out = append(out, p.UID)
	}
	return out
}
