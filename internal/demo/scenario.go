package demo

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/keys"
)

// scenario creates the pool and changes its replicas on a schedule over
// Options.Duration, while disrupt deletes or fails pods.
func (d *Demo) scenario(ctx context.Context) error {
	dur := d.opts.Duration
	at := func(frac float64, plus time.Duration) <-chan time.Time {
		return time.After(time.Duration(frac*float64(dur)) + plus)
	}
	d.say("creating WorkerPool %s/%s with 20 replicas", Namespace, Pool)
	if err := d.client.Create(ctx, operator.Pool(Namespace, Pool, 20)); err != nil {
		return err
	}
	d.timeline.mark(scaled, "20 replicas")
	steps := []struct {
		at   <-chan time.Time
		what string
		// replicas is what the step sets; 0 ends the scenario.
		replicas int64
	}{
		{at(0.25, 0), "the timer scales down to 8: the operator marks 12 pods scale-down", 8},
		// Marked pods take 0.5 to 3 s to exit: scale up while they do.
		{at(0.25, 1200*time.Millisecond), "scale-up to 12 in the middle of the scale-down", 12},
		{at(0.6, 0), "the timer scales down to 6", 6},
		{at(0.8, 0), "scale-up to 10", 10},
		{at(1, 0), "scenario over: no more disruptions; waiting for quiescence", 0},
	}
	disrupt := time.NewTicker(dur / 12)
	defer disrupt.Stop()
	disruptFrom, disruptTo := time.Now().Add(dur/5), time.Now().Add(dur*3/4)
	for _, step := range steps {
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-step.at:
				d.say("%s", step.what)
				waiting = false
				if step.replicas == 0 {
					d.timeline.mark(ended, "scenario over")
					break
				}
				if err := d.SetReplicas(ctx, step.replicas); err != nil {
					return err
				}
				d.timeline.mark(scaled, fmt.Sprintf("%d replicas", step.replicas))
			case now := <-disrupt.C:
				if now.After(disruptFrom) && now.Before(disruptTo) {
					d.disrupt(ctx)
				}
			}
		}
	}
	return nil
}

// disrupt deletes or fails a random running pod without intent, as a node
// loss or a crash would; then the operator, working from a list taken
// before, marks that pod for completion (markLate).
func (d *Demo) disrupt(ctx context.Context) {
	var pods corev1.PodList
	if err := d.client.List(ctx, &pods, client.InNamespace(Namespace)); err != nil {
		return
	}
	var running []corev1.Pod
	for _, p := range pods.Items {
		if _, marked := p.Annotations[keys.CompletionIntent]; !marked && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
			running = append(running, p)
		}
	}
	if len(running) == 0 {
		return
	}
	p := running[d.rng.IntN(len(running))]
	listed := p.DeepCopy()
	if d.opts.Cluster != nil || d.rng.IntN(2) == 0 {
		d.say("pod %s deleted unexpectedly", p.Name)
		if d.client.Delete(ctx, &p) == nil {
			d.timeline.mark(deleted, p.Name)
			d.markLate(ctx, listed)
		}
		return
	}
	d.say("pod %s crashed (phase Failed)", p.Name)
	if setPhase(ctx, d.client, &p, corev1.PodFailed) == nil {
		d.timeline.mark(crashed, p.Name)
		d.markLate(ctx, listed)
	}
}

// lateMarks counts what became of the marks markLate sent.
type lateMarks struct {
	// refused by the webhook because the pod had finished; marked is how
	// many were refused because the pod carried an intent admitted before
	// it finished (the operator marked it first); gone, how many found the
	// pod deleted, or replaced under its name.
	refused, marked, gone int
	// admitted names the pods whose late mark was admitted: each is a
	// broken rule.
	admitted []string
}

// lateReason is the reason markLate gives, apart from the operator's, so
// that a refusal for an intent the operator set first is told apart.
const lateReason = "retire"

// markLate marks pod, which has just crashed or been deleted, for
// completion from the copy listed before its end, as another handler of an
// operator acting on a list taken a moment earlier does. The webhook must
// refuse it: the pod ended without being asked to, so its end counts as
// unexpected, whenever tally records it. The patch names the pod's UID, so
// that a replacement that took the name is never marked instead.
func (d *Demo) markLate(ctx context.Context, listed *corev1.Pod) {
	patch := fmt.Appendf(nil, `{"metadata":{"uid":%q,"annotations":{%q:%q}}}`, listed.UID, keys.CompletionIntent, lateReason)
	err := d.client.Patch(ctx, listed, client.RawPatch(types.MergePatchType, patch))
	switch {
	case err == nil:
		d.say("pod %s marked for completion after it finished: ADMITTED", listed.Name)
		d.late.admitted = append(d.late.admitted, listed.Name)
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err) || apierrors.IsInvalid(err):
		d.late.gone++
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "cannot be set on a pod that has finished"):
		d.say("pod %s marked for completion from a list taken before its end: refused, it had finished", listed.Name)
		d.late.refused++
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "is sticky"):
		d.late.marked++
	default:
		d.say("marking %s after it finished failed: %v", listed.Name, err)
	}
}

// SetReplicas sets the pool's spec.replicas.
func (d *Demo) SetReplicas(ctx context.Context, n int64) error {
	patch := fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, n)
	pool := operator.Pool(Namespace, Pool, 0)
	return d.client.Patch(ctx, pool, client.RawPatch(types.MergePatchType, patch))
}
