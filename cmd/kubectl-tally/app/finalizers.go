package app

import (
	"context"
	"fmt"
	"slices"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

func newFinalizersCommand(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "finalizers",
		Short: "Manage the tracking finalizer tally puts on the pods of kinds with totals",
	}
	var allNamespaces, dryRun bool
	remove := &cobra.Command{
		Use:   "remove",
		Short: "Remove the finalizer " + keys.TrackingFinalizer + " from every pod that carries it (after uninstalling tally)",
		Long: `Remove the finalizer ` + keys.TrackingFinalizer + ` from every pod of the namespace (-n), or of every namespace
(--all-namespaces), that carries it. Run it after uninstalling tally: the aggregator removes the finalizer once it
has recorded a finished pod, and nothing removes it once the aggregator is gone, so those pods could not be
deleted. While tally runs, a pod released this way is not counted in its parent's totals.`,
		Example: `  kubectl tally finalizers remove --all-namespaces --dry-run
  kubectl tally finalizers remove -n workers`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return o.removeFinalizers(cmd.Context(), allNamespaces, dryRun)
		},
	}
	remove.Flags().BoolVarP(&allNamespaces, "all-namespaces", "A", false, "remove it from the pods of every namespace")
	remove.Flags().BoolVar(&dryRun, "dry-run", false, "only list the pods that carry it")
	cmd.AddCommand(remove)
	return cmd
}

func (o *options) removeFinalizers(ctx context.Context, allNamespaces, dryRun bool) error {
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
	if !dryRun && o.installed(ctx, cs) {
		fmt.Fprintf(o.streams.ErrOut, "warning: tally's ConfigMap %s/%s still exists: if the aggregator runs, pods released now are not counted in their parent's totals\n",
			o.tallyNamespace, o.configMapName())
	}
	var found, removed int
	err = eachTracked(ctx, cs, ns, func(pod *corev1.Pod) error {
		found++
		if dryRun {
			fmt.Fprintf(o.streams.Out, "pod/%s -n %s carries %s\n", pod.Name, pod.Namespace, keys.TrackingFinalizer)
			return nil
		}
		_, err := cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.StrategicMergePatchType, aggregate.ReleasePatch, metav1.PatchOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("removing %s from pod %s/%s: %w", keys.TrackingFinalizer, pod.Namespace, pod.Name, err)
		}
		removed++
		fmt.Fprintf(o.streams.Out, "pod/%s -n %s: %s removed\n", pod.Name, pod.Namespace, keys.TrackingFinalizer)
		return nil
	})
	if err != nil {
		return err
	}
	if dryRun {
		fmt.Fprintf(o.streams.Out, "%d pod(s) carry %s (dry run: nothing changed)\n", found, keys.TrackingFinalizer)
	} else {
		fmt.Fprintf(o.streams.Out, "%d pod(s) released\n", removed)
	}
	return nil
}

// eachTracked calls fn for each pod of namespace ns (every namespace when
// empty) that carries the tracking finalizer, listing 500 pods at a time.
func eachTracked(ctx context.Context, cs kubernetes.Interface, ns string, fn func(*corev1.Pod) error) error {
	opts := metav1.ListOptions{Limit: 500}
	for {
		list, err := cs.CoreV1().Pods(ns).List(ctx, opts)
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
