package aggregate

import (
	"context"
	"fmt"
	"slices"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// confirm reads from the API server what a step asked for: the pods in
// step.Confirm (at most PodBatch of them, metadata only), or every pod of the
// parent when its ledger holds a pod the cache has never shown.
func (r *Reconciler) confirm(ctx context.Context, parent client.Object, step *ledger.Step) (ledger.Live, error) {
	if step.Unlisted {
		return r.livePods(ctx, parent.GetNamespace(), parent.GetUID())
	}
	pods := step.Confirm[:min(len(step.Confirm), ledger.PodBatch)]
	live := ledger.Live{Pods: make(map[types.UID]ledger.LivePod, len(pods)), Asked: make(map[types.UID]bool, len(pods))}
	var mu sync.Mutex
	reads := ledgerLiveReads.WithLabelValues(r.kind)
	err := forEach(ctx, pods, func(ctx context.Context, p *count.Pod) error {
		reads.Inc()
		pod := podMeta(p.Namespace, p.Name)
		err := r.Live.Get(ctx, client.ObjectKeyFromObject(pod), pod)
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("reading pod %s/%s from the API server: %w", p.Namespace, p.Name, err)
		}
		mu.Lock()
		defer mu.Unlock()
		live.Asked[p.UID] = true
		if err == nil && pod.UID == p.UID {
			live.Pods[p.UID] = r.livePod(pod)
		}
		return nil
	})
	return live, err
}

// livePods reads the parent's pods from the API server (metadata only): the
// authoritative view of which still carry the finalizer.
func (r *Reconciler) livePods(ctx context.Context, ns string, uid types.UID) (ledger.Live, error) {
	ledgerLiveLists.WithLabelValues(r.kind).Inc()
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(podListGVK)
	if err := r.Live.List(ctx, list, client.InNamespace(ns), client.MatchingLabels{keys.ParentUID: string(uid)}); err != nil {
		return ledger.Live{}, fmt.Errorf("reading the pods of %s from the API server: %w", uid, err)
	}
	live := ledger.Live{Pods: make(map[types.UID]ledger.LivePod, len(list.Items)), All: true}
	for i := range list.Items {
		p := &list.Items[i]
		if ref := metav1.GetControllerOfNoCopy(p); ref == nil || ref.UID != uid {
			continue
		}
		live.Pods[p.UID] = r.livePod(p)
	}
	return live, nil
}

// livePod is what the ledger reads of a pod read from the API server. Its
// intent counts only if tally admitted it (mutate.Mutator.Admitted): the
// ledger reads it for finished pods, on which tally admits no other.
func (r *Reconciler) livePod(pod *metav1.PartialObjectMetadata) ledger.LivePod {
	meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, DeletionTimestamp: pod.DeletionTimestamp}
	return ledger.LivePod{Tracking: slices.Contains(pod.Finalizers, keys.TrackingFinalizer), Intent: r.rules.Admitted(meta)}
}
