package app

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

func newFinalizersCommand(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "finalizers",
		Short: "Manage the tracking finalizer tally puts on the pods of kinds with totals",
	}
	var allNamespaces, dryRun bool
	var parallel int
	var stop stopTracking
	remove := &cobra.Command{
		Use:   "remove",
		Short: "Remove the finalizer " + keys.TrackingFinalizer + " from every pod that carries it (after uninstalling tally)",
		Long: `Remove the finalizer ` + keys.TrackingFinalizer + ` from every pod of the namespace (-n), or of every namespace
(--all-namespaces), that carries it. Run it after uninstalling tally: the aggregator removes the finalizer once it
has recorded a finished pod, and nothing removes it once the aggregator is gone, so those pods could not be
deleted. While tally runs, a pod released this way is not counted in its parent's totals.

With --stop-webhook and --stop-aggregator (the chart's pre-delete hook sets both), it first stops tally from adding
the finalizer: it deletes the webhook's registration and scales the aggregator to zero, waiting for its pods to go.`,
		Example: `  kubectl tally finalizers remove --all-namespaces --dry-run
  kubectl tally finalizers remove -n workers
  kubectl tally finalizers remove -A --stop-webhook tally --stop-aggregator tally-aggregator`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !dryRun {
				if err := o.stopTracking(cmd.Context(), stop); err != nil {
					return err
				}
			}
			if parallel < 1 {
				return fmt.Errorf("--parallel must be at least 1, not %d", parallel)
			}
			return o.removeFinalizers(cmd.Context(), allNamespaces, dryRun, stop.aggregator != "", parallel)
		},
	}
	remove.Flags().BoolVarP(&allNamespaces, "all-namespaces", "A", false, "remove it from the pods of every namespace")
	remove.Flags().BoolVar(&dryRun, "dry-run", false, "only list the pods that carry it")
	remove.Flags().IntVar(&parallel, "parallel", 16, "how many pods to patch at once")
	remove.Flags().Float32Var(&o.qps, "qps", 100, "requests a second to the API server, at most (client-go's default is 5)")
	remove.Flags().IntVar(&o.burst, "burst", 200, "requests above --qps the client may send in a burst")
	remove.Flags().StringVar(&stop.webhook, "stop-webhook", "", "first delete this MutatingWebhookConfiguration (tally's), so that no new pod gets the finalizer")
	remove.Flags().StringVar(&stop.aggregator, "stop-aggregator", "", "first scale this Deployment of --tally-namespace (tally's aggregator) to zero and wait for its pods to go")
	remove.Flags().DurationVar(&stop.timeout, "stop-timeout", 2*time.Minute, "how long to wait for the aggregator's pods to go before removing the finalizers anyway")
	cmd.AddCommand(remove)
	return cmd
}

// stopTracking names what adds the finalizer, to stop before removing it.
type stopTracking struct {
	webhook, aggregator string
	timeout             time.Duration
}

// stopTracking deletes the webhook's registration and scales the aggregator
// to zero, waiting at most stop.timeout for its pods to go: afterwards
// nothing adds the finalizer again.
func (o *options) stopTracking(ctx context.Context, stop stopTracking) error {
	if stop.webhook == "" && stop.aggregator == "" {
		return nil
	}
	cs, _, err := o.clients()
	if err != nil {
		return err
	}
	if stop.webhook != "" {
		err := cs.AdmissionregistrationV1().MutatingWebhookConfigurations().Delete(ctx, stop.webhook, metav1.DeleteOptions{})
		switch {
		case apierrors.IsNotFound(err):
			fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s: already gone\n", stop.webhook)
		case err != nil:
			return fmt.Errorf("deleting the webhook's registration %s: %w", stop.webhook, err)
		default:
			fmt.Fprintf(o.streams.Out, "mutatingwebhookconfiguration/%s deleted: no new pod gets %s\n", stop.webhook, keys.TrackingFinalizer)
		}
	}
	if stop.aggregator == "" {
		return nil
	}
	deployments := cs.AppsV1().Deployments(o.tallyNamespace)
	dep, err := deployments.Get(ctx, stop.aggregator, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		fmt.Fprintf(o.streams.Out, "deployment/%s -n %s: already gone\n", stop.aggregator, o.tallyNamespace)
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading the aggregator's Deployment %s/%s: %w", o.tallyNamespace, stop.aggregator, err)
	}
	scale := []byte(`{"spec":{"replicas":0}}`)
	if _, err := deployments.Patch(ctx, stop.aggregator, types.MergePatchType, scale, metav1.PatchOptions{}, "scale"); err != nil {
		return fmt.Errorf("scaling the aggregator %s/%s to zero: %w", o.tallyNamespace, stop.aggregator, err)
	}
	selector, err := metav1.LabelSelectorAsSelector(dep.Spec.Selector)
	if err != nil {
		return fmt.Errorf("the aggregator's Deployment %s/%s: %w", o.tallyNamespace, stop.aggregator, err)
	}
	deadline := time.Now().Add(stop.timeout)
	for {
		pods, err := cs.CoreV1().Pods(o.tallyNamespace).List(ctx, metav1.ListOptions{LabelSelector: selector.String()})
		if err != nil {
			return fmt.Errorf("listing the aggregator's pods: %w", err)
		}
		if len(pods.Items) == 0 {
			fmt.Fprintf(o.streams.Out, "deployment/%s -n %s scaled to zero: no aggregator adds %s\n", stop.aggregator, o.tallyNamespace, keys.TrackingFinalizer)
			return nil
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(o.streams.ErrOut, "warning: %d pod(s) of deployment/%s still run after %s; removing the finalizers anyway\n", len(pods.Items), stop.aggregator, stop.timeout)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// removeFinalizers removes the finalizer from every pod of the namespace
// (every namespace with allNamespaces) that carries it, parallel patches at
// a time, as it lists them. Each patch names the pod's UID: a pod created
// since under the same name keeps its finalizer. A run stopped part-way
// leaves the rest for the next, which lists what still carries it.
func (o *options) removeFinalizers(ctx context.Context, allNamespaces, dryRun, stopped bool, parallel int) error {
	cs, _, err := o.clients()
	if err != nil {
		return err
	}
	ns := metav1.NamespaceAll
	if !allNamespaces {
		if ns, err = o.namespace(); err != nil {
			return err
		}
	}
	if !dryRun && !stopped && o.installed(ctx, cs) {
		fmt.Fprintf(o.streams.ErrOut, "warning: tally's ConfigMap %s/%s still exists: if the aggregator runs, pods released now are not counted in their parent's totals\n",
			o.tallyNamespace, o.configMapName())
	}
	md, err := o.metadataClient()
	if err != nil {
		return err
	}
	if dryRun {
		found := 0
		err := eachTracked(ctx, md, ns, "", func(pod *metav1.PartialObjectMetadata) error {
			found++
			fmt.Fprintf(o.streams.Out, "pod/%s -n %s carries %s\n", pod.Name, pod.Namespace, keys.TrackingFinalizer)
			return nil
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(o.streams.Out, "%d pod(s) carry %s (dry run: nothing changed)\n", found, keys.TrackingFinalizer)
		return nil
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	pods := make(chan *metav1.PartialObjectMetadata)
	var mu sync.Mutex // guards removed and the output
	removed := 0
	var workers sync.WaitGroup
	for range parallel {
		workers.Go(func() {
			for pod := range pods {
				_, err := cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, aggregate.ReleasePatch(pod.UID), metav1.PatchOptions{})
				if !aggregate.Released(err) {
					cancel(fmt.Errorf("removing %s from pod %s/%s: %w", keys.TrackingFinalizer, pod.Namespace, pod.Name, err))
					continue
				}
				mu.Lock()
				removed++
				fmt.Fprintf(o.streams.Out, "pod/%s -n %s: %s removed\n", pod.Name, pod.Namespace, keys.TrackingFinalizer)
				mu.Unlock()
			}
		})
	}
	err = eachTracked(ctx, md, ns, "", func(pod *metav1.PartialObjectMetadata) error {
		select {
		case pods <- pod:
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	close(pods)
	workers.Wait()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		err = cause
	}
	fmt.Fprintf(o.streams.Out, "%d pod(s) released\n", removed)
	return err
}

// eachTracked calls fn for each pod of namespace ns (every namespace when
// empty) that carries the tracking finalizer and matches fieldSelector. It
// lists metadata only, 500 pods at a time: what it holds at once does not
// grow with the cluster.
func eachTracked(ctx context.Context, md metadata.Interface, ns, fieldSelector string, fn func(*metav1.PartialObjectMetadata) error) error {
	opts := metav1.ListOptions{Limit: 500, FieldSelector: fieldSelector}
	pods := md.Resource(corev1.SchemeGroupVersion.WithResource("pods")).Namespace(ns)
	for {
		list, err := pods.List(ctx, opts)
		if err != nil {
			return fmt.Errorf("listing pods: %w", err)
		}
		for i := range list.Items {
			if !slices.Contains(list.Items[i].Finalizers, keys.TrackingFinalizer) {
				continue
			}
			if err := fn(&list.Items[i]); err != nil {
				return err
			}
		}
		if list.Continue == "" {
			return nil
		}
		opts.Continue = list.Continue
	}
}

// installed reports whether tally's ConfigMap is still there.
func (o *options) installed(ctx context.Context, cs kubernetes.Interface) bool {
	_, err := cs.CoreV1().ConfigMaps(o.tallyNamespace).Get(ctx, o.configMapName(), metav1.GetOptions{})
	return err == nil
}
