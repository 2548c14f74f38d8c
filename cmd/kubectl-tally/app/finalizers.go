package app

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
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
	var namespaces []string
	var parallel int
	var stop stopTracking
	remove := &cobra.Command{
		Use:   "remove",
		Short: "Remove the finalizer " + keys.TrackingFinalizer + " from every pod that carries it (after uninstalling tally)",
		Long: `Remove the finalizer ` + keys.TrackingFinalizer + ` from every pod of the namespace (-n), of each namespace listed
(--namespaces), or of every namespace (--all-namespaces), that carries it. Run it after uninstalling tally: the aggregator removes the finalizer once it
has recorded a finished pod, and nothing removes it once the aggregator is gone, so those pods could not be
deleted. While tally runs, a pod released this way is not counted in its parent's totals.

With --stop-webhook and --stop-aggregator (the chart's pre-delete hook sets both), it first stops tally from adding
the finalizer: it pauses the webhook's registration (a match condition that is always false, so the API server
calls the webhook for no pod) and scales the aggregator to zero, waiting for its pods to go. Then it releases in
passes until a pass that starts --settle after the stop finds no pod to release: the pause takes effect on the API
server a moment after it is written, a CREATE the webhook admitted before may still be on its way, and an
aggregator still running after --stop-timeout may put the finalizer back. If the run fails or is stopped (SIGTERM,
SIGINT) before every pod is released, it undoes both before it exits: tally runs again as it did, the aggregator
puts the finalizer back on the running pods released so far, and a later run starts over.`,
		Example: `  kubectl tally finalizers remove --all-namespaces --dry-run
  kubectl tally finalizers remove -n workers
  kubectl tally finalizers remove -A --stop-webhook tally --stop-aggregator tally-aggregator`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if parallel < 1 {
				return fmt.Errorf("--parallel must be at least 1, not %d", parallel)
			}
			if stop.settle < 0 {
				return fmt.Errorf("--settle must not be negative, not %s", stop.settle)
			}
			within, err := o.within(allNamespaces, namespaces)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			if dryRun {
				_, err := o.removeFinalizers(ctx, within, true, false, parallel)
				return err
			}
			resume, err := o.stopTracking(ctx, stop)
			if err == nil {
				err = o.releaseUntilQuiet(ctx, within, stop, parallel)
			}
			if err != nil {
				return o.resumeTracking(ctx, resume, err)
			}
			return nil
		},
	}
	remove.Flags().BoolVarP(&allNamespaces, "all-namespaces", "A", false, "remove it from the pods of every namespace")
	remove.Flags().StringSliceVar(&namespaces, "namespaces", nil, "remove it from the pods of each of these namespaces only, instead of -n's (the chart's pre-delete hook sets it when tally is installed with a fixed list of namespaces, and has no permission elsewhere)")
	remove.Flags().BoolVar(&dryRun, "dry-run", false, "only list the pods that carry it")
	remove.Flags().IntVar(&parallel, "parallel", 16, "how many pods to patch at once")
	remove.Flags().Float32Var(&o.qps, "qps", 100, "requests a second to the API server, at most (client-go's default is 5)")
	remove.Flags().IntVar(&o.burst, "burst", 200, "requests above --qps the client may send in a burst")
	remove.Flags().StringVar(&stop.webhook, "stop-webhook", "", "first pause this MutatingWebhookConfiguration (tally's), so that no new pod gets the finalizer")
	remove.Flags().StringVar(&stop.aggregator, "stop-aggregator", "", "first scale this Deployment of --tally-namespace (tally's aggregator) to zero and wait for its pods to go")
	remove.Flags().DurationVar(&stop.timeout, "stop-timeout", 2*time.Minute, "how long to wait for the aggregator's pods to go before removing the finalizers anyway")
	remove.Flags().DurationVar(&stop.settle, "settle", 65*time.Second, "with --stop-webhook or --stop-aggregator: release again until a pass that starts this long after the stop finds nothing (long enough for a pod CREATE admitted just before the pause to end: the API server's request timeout, 60 s by default, bounds its admission chain)")
	cmd.AddCommand(remove)
	return cmd
}

// releaseUntilQuiet releases the finalizers once without stop; after a
// stop, in passes, until a pass that starts stop.settle after it releases
// nothing: what was on its way when tally stopped (a CREATE the webhook
// admitted, the pause not yet in effect, an aggregator that outlived
// --stop-timeout) is released too, or the run goes on until its deadline.
func (o *options) releaseUntilQuiet(ctx context.Context, within []string, stop stopTracking, parallel int) error {
	stopped := stop.webhook != "" || stop.aggregator != ""
	quietFrom := time.Now().Add(stop.settle)
	for pass := 1; ; pass++ {
		began := time.Now()
		released, err := o.removeFinalizers(ctx, within, false, stopped, parallel)
		if err != nil || !stopped || (released == 0 && !began.Before(quietFrom)) {
			return err
		}
		wait := max(time.Until(quietFrom), 0)
		if released > 0 && !began.Before(quietFrom) {
			// Something still adds it: a whole settle before the next.
			wait = stop.settle
		}
		fmt.Fprintf(o.streams.Out, "pass %d released %d pod(s); releasing again in %s, until a pass finds none\n", pass, released, wait.Round(time.Second))
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(wait):
		}
	}
}

// within returns the namespaces whose pods are released: every one ("")
// with allNamespaces, those listed, or the namespace of -n (or the
// kubeconfig's).
func (o *options) within(allNamespaces bool, listed []string) ([]string, error) {
	switch {
	case allNamespaces && len(listed) > 0:
		return nil, errors.New("--all-namespaces and --namespaces cannot be given together")
	case allNamespaces:
		return []string{metav1.NamespaceAll}, nil
	case len(listed) > 0:
		for _, ns := range listed {
			if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
				return nil, fmt.Errorf("--namespaces: %q is not a namespace name: %s", ns, strings.Join(errs, "; "))
			}
		}
		return listed, nil
	}
	ns, err := o.namespace()
	if err != nil {
		return nil, err
	}
	return []string{ns}, nil
}

// removeFinalizers removes the finalizer from every pod of the namespaces
// within ("" for every namespace) that carries it, parallel patches at a
// time, as it lists them. Each patch names the pod's UID: a pod created
// since under the same name keeps its finalizer. A run stopped part-way
// leaves the rest for the next, which lists what still carries it. It
// returns how many pods it released.
func (o *options) removeFinalizers(ctx context.Context, within []string, dryRun, stopped bool, parallel int) (int, error) {
	cs, _, err := o.clients()
	if err != nil {
		return 0, err
	}
	if !dryRun && !stopped && o.installed(ctx, cs) {
		fmt.Fprintf(o.streams.ErrOut, "warning: tally's ConfigMap %s/%s still exists: if the aggregator runs, pods released now are not counted in their parent's totals\n",
			o.tallyNamespace, o.configMapName())
	}
	md, err := o.metadataClient()
	if err != nil {
		return 0, err
	}
	each := func(ctx context.Context, fn func(*metav1.PartialObjectMetadata) error) error {
		for _, ns := range within {
			if err := eachTracked(ctx, md, ns, "", fn); err != nil {
				return err
			}
		}
		return nil
	}
	if dryRun {
		found := 0
		err := each(ctx, func(pod *metav1.PartialObjectMetadata) error {
			found++
			fmt.Fprintf(o.streams.Out, "pod/%s -n %s carries %s\n", pod.Name, pod.Namespace, keys.TrackingFinalizer)
			return nil
		})
		if err != nil {
			return 0, err
		}
		fmt.Fprintf(o.streams.Out, "%d pod(s) carry %s (dry run: nothing changed)\n", found, keys.TrackingFinalizer)
		return 0, nil
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
	err = each(ctx, func(pod *metav1.PartialObjectMetadata) error {
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
	return removed, err
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
