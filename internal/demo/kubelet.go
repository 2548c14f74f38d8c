package demo

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/keys"
)

// kubelet stands in for the node agent the control plane lacks: it starts
// new pods after a short delay and reports them Ready (condition Ready
// True) a moment later, as a readiness probe would. Like a kubelet it runs
// the pods of every namespace, so that other operators (examples/kopf) can
// use the demo's control plane too. In the demo's namespace, where the
// example's workers read their completion intent, it lets a pod marked for
// completion finish its work and exit (phase Succeeded, no longer Ready)
// after a random delay; elsewhere a marked pod ends when its operator stops
// it, as a worker that does not read its intent does.
func (d *Demo) kubelet(ctx context.Context) {
	due := map[types.UID]time.Time{}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var pods corev1.PodList
		if err := d.client.List(ctx, &pods); err != nil {
			d.say("kubelet: %v", err)
			continue
		}
		now := time.Now()
		for i := range pods.Items {
			p := &pods.Items[i]
			_, marked := p.Annotations[keys.CompletionIntent]
			var next corev1.PodPhase
			var delay time.Duration
			switch {
			case p.DeletionTimestamp != nil:
				continue
			case p.Status.Phase == "" || p.Status.Phase == corev1.PodPending:
				next, delay = corev1.PodRunning, time.Duration(100+d.kubeletRNG.IntN(500))*time.Millisecond
			case p.Status.Phase == corev1.PodRunning && marked && p.Namespace == Namespace:
				next, delay = corev1.PodSucceeded, time.Duration(500+d.kubeletRNG.IntN(2500))*time.Millisecond
			case p.Status.Phase == corev1.PodRunning && !ready(p):
				// Running, not Ready yet: the same phase, now Ready.
				next, delay = corev1.PodRunning, time.Duration(300+d.kubeletRNG.IntN(1000))*time.Millisecond
			default:
				continue
			}
			when, ok := due[p.UID]
			if !ok {
				due[p.UID] = now.Add(delay)
				continue
			}
			if now.After(when) {
				if err := setPhase(ctx, d.client, p, next); client.IgnoreNotFound(err) != nil {
					d.say("kubelet: %v", err)
				} else {
					delete(due, p.UID)
				}
			}
		}
	}
}

// setPhase moves pod to phase, with the Ready condition a kubelet reports
// with it: True once Running again (the second step of a pod that
// started), False once it ran.
func setPhase(ctx context.Context, c client.Client, pod *corev1.Pod, phase corev1.PodPhase) error {
	patch := client.MergeFrom(pod.DeepCopy())
	switch {
	case phase == corev1.PodRunning && pod.Status.Phase == corev1.PodRunning:
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
	case phase == corev1.PodSucceeded || phase == corev1.PodFailed:
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse, LastTransitionTime: metav1.Now()}}
	}
	pod.Status.Phase = phase
	return c.Status().Patch(ctx, pod, patch)
}

// ready reports whether pod's Ready condition is True.
func ready(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
