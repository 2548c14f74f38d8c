package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/pkg/keys"
)

// PauseCondition names the match condition that pauses tally's webhook
// registration while its finalizers are released: its expression is false,
// so the API server calls the webhook for no pod.
const PauseCondition = "tally-uninstalling"

// resumeTimeout bounds undoing a stop after a failure: a Job's pod has 30 s
// between SIGTERM and SIGKILL.
const resumeTimeout = 20 * time.Second

// stopTracking names what adds the finalizer, to stop before removing it.
type stopTracking struct {
	webhook, aggregator string
	// timeout bounds the wait for the aggregator's pods; settle is how long
	// after the stop a pass must start to be the last.
	timeout, settle time.Duration
}

// stopTracking pauses the webhook's registration and scales the aggregator
// to zero, waiting at most stop.timeout for its pods to go: afterwards
// nothing adds the finalizer again. It returns what undoes the steps taken,
// also when it fails part-way.
func (o *options) stopTracking(ctx context.Context, stop stopTracking) (func(context.Context) error, error) {
	var undo []func(context.Context) error
	resume := func(ctx context.Context) error {
		var errs []error
		for _, f := range slices.Backward(undo) {
			errs = append(errs, f(ctx))
		}
		return errors.Join(errs...)
	}
	if stop.webhook == "" && stop.aggregator == "" {
		return resume, nil
	}
	cs, _, err := o.clients()
	if err != nil {
		return resume, err
	}
	if stop.webhook != "" {
		paused, err := o.pauseWebhook(ctx, cs, stop.webhook)
		if err != nil {
			return resume, err
		}
		if paused {
			undo = append(undo, func(ctx context.Context) error { return o.unpauseWebhook(ctx, cs, stop.webhook) })
		}
	}
	if stop.aggregator == "" {
		return resume, nil
	}
	replicas, err := o.scaleAggregatorToZero(ctx, cs, stop)
	if replicas > 0 {
		undo = append(undo, func(ctx context.Context) error { return o.scaleAggregator(ctx, cs, stop.aggregator, replicas) })
	}
	return resume, err
}

// resumeTracking undoes a stop after the run failed with cause (its context
// may be cancelled: the undoing has a context of its own) and returns cause,
// with the undoing's own failure if any.
func (o *options) resumeTracking(ctx context.Context, resume func(context.Context) error, cause error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resumeTimeout)
	defer cancel()
	if err := resume(ctx); err != nil {
		return errors.Join(cause, fmt.Errorf("undoing the stop: %w", err))
	}
	return cause
}

// pauseWebhook adds PauseCondition to every webhook of the registration
// that lacks it, and reports whether it added any.
func (o *options) pauseWebhook(ctx context.Context, cs kubernetes.Interface, name string) (bool, error) {
	regs := cs.AdmissionregistrationV1().MutatingWebhookConfigurations()
	reg, err := regs.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s: already gone\n", name)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("reading the webhook's registration %s: %w", name, err)
	}
	var ops []jsonPatchOp
	for i, wh := range reg.Webhooks {
		if pauseIndex(wh) >= 0 {
			continue
		}
		cond := admissionv1.MatchCondition{Name: PauseCondition, Expression: "false"}
		if wh.MatchConditions == nil {
			ops = append(ops, jsonPatchOp{Op: "add", Path: fmt.Sprintf("/webhooks/%d/matchConditions", i), Value: []admissionv1.MatchCondition{cond}})
		} else {
			ops = append(ops, jsonPatchOp{Op: "add", Path: fmt.Sprintf("/webhooks/%d/matchConditions/-", i), Value: cond})
		}
	}
	if len(ops) == 0 {
		fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s: already paused\n", name)
		return false, nil
	}
	if err := patchRegistration(ctx, cs, name, reg.ResourceVersion, ops); err != nil {
		return false, fmt.Errorf("pausing the webhook's registration %s: %w", name, err)
	}
	fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s paused: no new pod gets %s\n", name, keys.TrackingFinalizer)
	return true, nil
}

// unpauseWebhook removes PauseCondition from every webhook of the
// registration.
func (o *options) unpauseWebhook(ctx context.Context, cs kubernetes.Interface, name string) error {
	reg, err := cs.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading the webhook's registration %s: %w", name, err)
	}
	var ops []jsonPatchOp
	for i, wh := range reg.Webhooks {
		if j := pauseIndex(wh); j >= 0 {
			ops = append(ops, jsonPatchOp{Op: "remove", Path: fmt.Sprintf("/webhooks/%d/matchConditions/%d", i, j)})
		}
	}
	if len(ops) == 0 {
		return nil
	}
	if err := patchRegistration(ctx, cs, name, reg.ResourceVersion, ops); err != nil {
		return fmt.Errorf("resuming the webhook's registration %s: %w", name, err)
	}
	fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s resumed\n", name)
	return nil
}

func pauseIndex(wh admissionv1.MutatingWebhook) int {
	return slices.IndexFunc(wh.MatchConditions, func(c admissionv1.MatchCondition) bool { return c.Name == PauseCondition })
}

// jsonPatchOp is one operation of a JSON patch (RFC 6902).
type jsonPatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// patchRegistration applies ops to the registration as it was at
// resourceVersion: the indexes they name are that version's.
func patchRegistration(ctx context.Context, cs kubernetes.Interface, name, resourceVersion string, ops []jsonPatchOp) error {
	ops = append([]jsonPatchOp{{Op: "test", Path: "/metadata/resourceVersion", Value: resourceVersion}}, ops...)
	body, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	_, err = cs.AdmissionregistrationV1().MutatingWebhookConfigurations().Patch(ctx, name, types.JSONPatchType, body, metav1.PatchOptions{})
	return err
}

// scaleAggregatorToZero scales the aggregator's Deployment to zero and
// waits at most stop.timeout for its pods to go. It returns the replicas
// the Deployment had, to scale it back to.
func (o *options) scaleAggregatorToZero(ctx context.Context, cs kubernetes.Interface, stop stopTracking) (int32, error) {
	dep, err := cs.AppsV1().Deployments(o.tallyNamespace).Get(ctx, stop.aggregator, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		fmt.Fprintf(o.streams.Out, "deployment/%s -n %s: already gone\n", stop.aggregator, o.tallyNamespace)
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading the aggregator's Deployment %s/%s: %w", o.tallyNamespace, stop.aggregator, err)
	}
	selector, err := metav1.LabelSelectorAsSelector(dep.Spec.Selector)
	if err != nil {
		return 0, fmt.Errorf("the aggregator's Deployment %s/%s: %w", o.tallyNamespace, stop.aggregator, err)
	}
	var replicas int32 = 1
	if dep.Spec.Replicas != nil {
		replicas = *dep.Spec.Replicas
	}
	if replicas > 0 {
		if err := o.scaleAggregator(ctx, cs, stop.aggregator, 0); err != nil {
			return 0, err
		}
	}
	deadline := time.Now().Add(stop.timeout)
	for {
		pods, err := cs.CoreV1().Pods(o.tallyNamespace).List(ctx, metav1.ListOptions{LabelSelector: selector.String()})
		if err != nil {
			return replicas, fmt.Errorf("listing the aggregator's pods: %w", err)
		}
		if len(pods.Items) == 0 {
			fmt.Fprintf(o.streams.Out, "deployment/%s -n %s scaled to zero: no aggregator adds %s\n", stop.aggregator, o.tallyNamespace, keys.TrackingFinalizer)
			return replicas, nil
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(o.streams.ErrOut, "warning: %d pod(s) of deployment/%s still run after %s; removing the finalizers anyway\n", len(pods.Items), stop.aggregator, stop.timeout)
			return replicas, nil
		}
		select {
		case <-ctx.Done():
			return replicas, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// scaleAggregator sets the aggregator's replicas through its scale
// subresource.
func (o *options) scaleAggregator(ctx context.Context, cs kubernetes.Interface, name string, replicas int32) error {
	scale := fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, replicas)
	if _, err := cs.AppsV1().Deployments(o.tallyNamespace).Patch(ctx, name, types.MergePatchType, scale, metav1.PatchOptions{}, "scale"); err != nil {
		return fmt.Errorf("scaling the aggregator %s/%s to %d: %w", o.tallyNamespace, name, replicas, err)
	}
	if replicas > 0 {
		fmt.Fprintf(o.streams.Out, "deployment/%s -n %s scaled back to %d\n", name, o.tallyNamespace, replicas)
	}
	return nil
}
