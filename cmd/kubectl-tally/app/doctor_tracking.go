package app

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

// maxStatusReads bounds the terminal pods carrying the tracking finalizer
// whose status doctor reads to learn when they finished.
const maxStatusReads = 200

// trackingCheck looks for finished pods that still carry the tracking
// finalizer longer after they finished than the aggregator's
// --tracking-grace (their deletion waits on tally; the aggregator releases
// a pod it could not record once the grace has passed), and for pods
// released without being counted in the totals.
type trackingCheck struct{}

func (trackingCheck) name() string { return "tracking finalizers" }

func (c trackingCheck) run(ctx context.Context, d *doctor) Check {
	name := c.name()
	now := time.Now()
	trackingStuck, graceFrom := d.trackingGrace(ctx)
	var carrying, read, unread int
	var stuck, namespaces []string
	report := func(namespace, name string, at time.Time) {
		if now.Sub(at) > trackingStuck {
			stuck = append(stuck, fmt.Sprintf("%s/%s (%v)", namespace, name, now.Sub(at).Round(time.Second)))
			if !slices.Contains(namespaces, namespace) {
				namespaces = append(namespaces, namespace)
			}
		}
	}
	md, err := d.metadataClient()
	if err != nil {
		return fail(name, "", "%v", err)
	}
	// Pods being deleted, from their metadata.
	err = eachTracked(ctx, md, metav1.NamespaceAll, "", func(pod *metav1.PartialObjectMetadata) error {
		carrying++
		if pod.DeletionTimestamp != nil {
			grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 0)) * time.Second
			report(pod.Namespace, pod.Name, pod.DeletionTimestamp.Add(-grace))
		}
		return nil
	})
	// Terminal pods, found by phase; when they finished is in their status,
	// read for at most maxStatusReads of them.
	for _, phase := range []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed} {
		if err != nil {
			break
		}
		err = eachTracked(ctx, md, metav1.NamespaceAll, "status.phase="+string(phase), func(meta *metav1.PartialObjectMetadata) error {
			if meta.DeletionTimestamp != nil {
				return nil
			}
			if read >= maxStatusReads {
				unread++
				return nil
			}
			read++
			pod, err := d.cs.CoreV1().Pods(meta.Namespace).Get(ctx, meta.Name, metav1.GetOptions{})
			switch {
			case apierrors.IsNotFound(err):
				return nil // gone since
			case err != nil:
				return fmt.Errorf("reading pod %s/%s: %w", meta.Namespace, meta.Name, err)
			}
			if at, ok := finishedAt(pod); ok && slices.Contains(pod.Finalizers, keys.TrackingFinalizer) {
				report(pod.Namespace, pod.Name, at)
			}
			return nil
		})
	}
	if apierrors.IsForbidden(err) {
		return skip(name, "this user may not list the pods of every namespace")
	}
	if err != nil {
		return fail(name, "", "%v", err)
	}
	lost, err := uncounted(ctx, d.cs, metav1.NamespaceAll, "")
	if err != nil && !apierrors.IsForbidden(err) {
		return fail(name, "", "%v", err)
	}
	if len(stuck) == 0 && len(lost) > 0 {
		shown := lost[:min(len(lost), 5)]
		return fail(name, "the totals of these parents miss the pods named: their kind could not keep totals (fix its CRD: status subresource, the totals and the ledger declared), "+
			"or the aggregator could not record them within --tracking-grace (read its logs)",
			"%d report(s) of pods released without being counted in the totals: %s", len(lost), strings.Join(shown, "; "))
	}
	if len(stuck) > 0 {
		shown := stuck[:min(len(stuck), 5)]
		more := ""
		if len(stuck) > len(shown) {
			more = fmt.Sprintf(" and %d more", len(stuck)-len(shown))
		}
		fix := fmt.Sprintf("the aggregator releases a finished pod once it has recorded it: read its logs (kubectl -n %s logs -l app.kubernetes.io/component=aggregator); "+
			"for pods of no tracked parent, or after uninstalling: kubectl tally finalizers remove -n NAMESPACE (%s)", d.tallyNamespace, strings.Join(namespaces, ", "))
		if unread > 0 {
			more += fmt.Sprintf(" (%d more finished pods carry it; when they finished was not read)", unread)
		}
		return fail(name, fix, "%d finished pod(s) still carry %s more than %v (%s) after they finished (their deletion waits on it): %s%s",
			len(stuck), keys.TrackingFinalizer, trackingStuck, graceFrom, strings.Join(shown, ", "), more)
	}
	return ok(name, "%d pod(s) carry %s; none finished more than %v (%s) ago", carrying, keys.TrackingFinalizer, trackingStuck, graceFrom)
}

// trackingGrace returns the aggregator's --tracking-grace, read from the
// release's aggregator Deployment, and where it comes from; the flag's
// default when that cannot be read.
func (d *doctor) trackingGrace(ctx context.Context) (time.Duration, string) {
	name := d.release + "-aggregator"
	dep, err := d.cs.AppsV1().Deployments(d.tallyNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return aggregate.DefaultTrackingGrace, fmt.Sprintf("--tracking-grace's default: Deployment %s/%s not read: %v", d.tallyNamespace, name, err)
	}
	for _, c := range dep.Spec.Template.Spec.Containers {
		grace, ok, err := trackingGraceOf(append(slices.Clone(c.Command), c.Args...))
		switch {
		case err != nil:
			return aggregate.DefaultTrackingGrace, fmt.Sprintf("--tracking-grace's default: Deployment %s/%s: %v", d.tallyNamespace, name, err)
		case ok:
			return grace, "the aggregator's --tracking-grace"
		}
	}
	return aggregate.DefaultTrackingGrace, "--tracking-grace's default"
}

// trackingGraceOf returns the --tracking-grace a command line sets, in any
// of the forms Go's flag package takes.
func trackingGraceOf(args []string) (time.Duration, bool, error) {
	for i, a := range args {
		if a == "--" {
			break
		}
		flag := strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
		if flag == a {
			continue
		}
		value, hasValue := "", false
		switch {
		case strings.HasPrefix(flag, "tracking-grace="):
			value, hasValue = strings.TrimPrefix(flag, "tracking-grace="), true
		case flag == "tracking-grace" && i+1 < len(args):
			value, hasValue = args[i+1], true
		}
		if !hasValue {
			continue
		}
		grace, err := time.ParseDuration(value)
		if err != nil {
			return 0, false, fmt.Errorf("--tracking-grace %q: %w", value, err)
		}
		return grace, true, nil
	}
	return 0, false, nil
}

// finishedAt is when a pod finished: its deletion was asked for, or (a
// terminal pod) its last container ended. A terminal pod without container
// states finished when its conditions last changed.
func finishedAt(pod *corev1.Pod) (time.Time, bool) {
	if pod.DeletionTimestamp != nil {
		grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 0)) * time.Second
		return pod.DeletionTimestamp.Add(-grace), true
	}
	if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
		return time.Time{}, false
	}
	var at time.Time
	for _, s := range slices.Concat(pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses) {
		if t := s.State.Terminated; t != nil && t.FinishedAt.After(at) {
			at = t.FinishedAt.Time
		}
	}
	if at.IsZero() {
		for _, c := range pod.Status.Conditions {
			if c.LastTransitionTime.After(at) {
				at = c.LastTransitionTime.Time
			}
		}
	}
	return at, !at.IsZero()
}
