package aggregate

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
)

// cachedPod is a pod as the cache shows it.
func cachedPod(uid types.UID, phase corev1.PodPhase, tracking, intent, deleting bool) *count.Pod {
	p := &count.Pod{Meta: count.Meta{Name: string(uid), Namespace: "ns", UID: uid}, Phase: phase, Tracking: tracking, Intent: intent}
	if deleting {
		p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	}
	return p
}

// names returns the UIDs of pods.
func names(pods []*count.Pod) []types.UID {
	var out []types.UID
	for _, p := range pods {
		out = append(out, p.UID)
	}
	return out
}
