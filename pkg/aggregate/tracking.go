package aggregate

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// OwnerIndex names the pod informer's index of the pods carrying the
// tracking finalizer, by "<namespace>/<controller name>": it finds the pods
// of a parent that is gone, whose UID is no longer known.
const OwnerIndex = "tally.dev/tracking-owner"

func indexTrackingOwner(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && p.Controller.Name != "" {
		return []string{p.Namespace + "/" + p.Controller.Name}, nil
	}
	return nil, nil
}

// ReleasePatch is the strategic merge patch that removes the tracking
// finalizer from a pod wherever it is in the list, and changes nothing when
// it is gone already (the Job controller removes its own the same way).
var ReleasePatch = []byte(`{"metadata":{"$deleteFromPrimitiveList/finalizers":["` + keys.TrackingFinalizer + `"]}}`)

var releasePatch = client.RawPatch(types.StrategicMergePatchType, ReleasePatch)

// trackPatch adds the tracking finalizer, with the resourceVersion the
// decision was made on as a precondition: a pod that finished since, and may
// have been recorded and released already, is never given it again.
func trackPatch(resourceVersion string) client.Patch {
	rv, _ := json.Marshal(resourceVersion) // a string always encodes
	return client.RawPatch(types.StrategicMergePatchType,
		[]byte(`{"metadata":{"finalizers":["`+keys.TrackingFinalizer+`"],"resourceVersion":`+string(rv)+`}}`))
}

// patchConcurrency bounds the pod patches one reconcile sends at once.
const patchConcurrency = 8

// releaseAll removes the tracking finalizer from pods, counting each under
// action. Pods already gone count as released.
func (r *Reconciler) releaseAll(ctx context.Context, parent types.UID, pods []*Pod, action string) error {
	counter := trackingFinalizers.WithLabelValues(r.kind, action)
	return forEach(ctx, pods, func(ctx context.Context, p *Pod) error {
		err := r.Writer.Patch(ctx, podMeta(p.Namespace, p.Name), releasePatch, client.FieldOwner(FieldManager))
		switch {
		case err == nil, apierrors.IsNotFound(err):
			counter.Inc()
			if parent != "" {
				r.releases.add(parent, p.UID)
			}
			return nil
		}
		return fmt.Errorf("removing the finalizer %s of pod %s/%s: %w", keys.TrackingFinalizer, p.Namespace, p.Name, err)
	})
}

// trackAll adds the tracking finalizer to pods that have not finished, as
// the cache shows them: pods admitted before their kind kept totals, or
// whose finalizer another client's write dropped (it is restored). A pod
// that changed since is left to the next reconcile; a refusal is logged and
// counted, and the pod stays untracked (its finish is not counted).
func (r *Reconciler) trackAll(ctx context.Context, pods []*Pod) error {
	counter := trackingFinalizers.WithLabelValues(r.kind, "added")
	return forEach(ctx, pods, func(ctx context.Context, p *Pod) error {
		err := r.Writer.Patch(ctx, podMeta(p.Namespace, p.Name), trackPatch(p.ResourceVersion), client.FieldOwner(FieldManager))
		switch {
		case err == nil:
			counter.Inc()
			return nil
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
			// Gone or changed: its own event brings it back.
			return nil
		case strings.Contains(err.Error(), "no new finalizers can be added if the object is being deleted"):
			// Being deleted since the cache showed it.
			return nil
		case apierrors.IsInvalid(err), apierrors.IsForbidden(err):
			trackErrors.WithLabelValues(r.kind).Inc()
			log.FromContext(ctx).Error(err, "The API server refused the tracking finalizer: this pod's finish will not be counted in the totals", "pod", p.Namespace+"/"+p.Name)
			return nil
		}
		return fmt.Errorf("adding the finalizer %s to pod %s/%s: %w", keys.TrackingFinalizer, p.Namespace, p.Name, err)
	})
}

func forEach(ctx context.Context, pods []*Pod, f func(context.Context, *Pod) error) error {
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(patchConcurrency)
	for _, p := range pods {
		g.Go(func() error { return f(ctx, p) })
	}
	return g.Wait()
}

// confirm reads from the API server what a step asked for: the pods in
// step.Confirm (at most PodBatch of them, metadata only), or every pod of the
// parent when its ledger holds a pod the cache has never shown.
func (r *Reconciler) confirm(ctx context.Context, parent client.Object, step *Step) (Live, error) {
	if step.Unlisted {
		return r.livePods(ctx, parent.GetNamespace(), parent.GetUID())
	}
	pods := step.Confirm[:min(len(step.Confirm), PodBatch)]
	live := Live{Pods: make(map[types.UID]LivePod, len(pods)), Asked: make(map[types.UID]bool, len(pods))}
	var mu sync.Mutex
	reads := ledgerLiveReads.WithLabelValues(r.kind)
	err := forEach(ctx, pods, func(ctx context.Context, p *Pod) error {
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
			_, intent := pod.Annotations[keys.CompletionIntent]
			live.Pods[p.UID] = LivePod{Tracking: slices.Contains(pod.Finalizers, keys.TrackingFinalizer), Intent: intent}
		}
		return nil
	})
	return live, err
}

// livePods reads the parent's pods from the API server (metadata only): the
// authoritative view of which still carry the finalizer.
func (r *Reconciler) livePods(ctx context.Context, ns string, uid types.UID) (Live, error) {
	ledgerLiveLists.WithLabelValues(r.kind).Inc()
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(podListGVK)
	if err := r.Live.List(ctx, list, client.InNamespace(ns), client.MatchingLabels{keys.ParentUID: string(uid)}); err != nil {
		return Live{}, fmt.Errorf("reading the pods of %s from the API server: %w", uid, err)
	}
	live := Live{Pods: make(map[types.UID]LivePod, len(list.Items)), All: true}
	for i := range list.Items {
		p := &list.Items[i]
		if ref := metav1.GetControllerOfNoCopy(p); ref == nil || ref.UID != uid {
			continue
		}
		_, intent := p.Annotations[keys.CompletionIntent]
		live.Pods[p.UID] = LivePod{Tracking: slices.Contains(p.Finalizers, keys.TrackingFinalizer), Intent: intent}
	}
	return live, nil
}

// orphans returns the cached pods carrying the finalizer whose controller
// is a parent of this kind named name that does not exist with their
// controller's UID (current is the UID the cache shows, "" when none). It
// confirms with the API server before it answers: a parent the cache does
// not show yet must not lose its pods' finalizers.
func (r *Reconciler) orphans(ctx context.Context, name types.NamespacedName, current types.UID) ([]*Pod, error) {
	objs, err := r.Pods.ByIndex(OwnerIndex, name.Namespace+"/"+name.Name)
	if err != nil {
		return nil, fmt.Errorf("listing the tracked pods of %s: %w", name, err)
	}
	var candidates []*Pod
	for _, obj := range objs {
		if p, ok := obj.(*Pod); ok && p.Tracking && p.Controller.Kind == r.gvk.GroupKind() && p.Controller.UID != current {
			candidates = append(candidates, p)
		}
	}
	if len(candidates) == 0 {
		return nil, nil
	}
	live := mutate.PartialMetadata(r.gvk)
	switch err := r.Live.Get(ctx, name, live); {
	case apierrors.IsNotFound(err):
		return candidates, nil
	case err != nil:
		return nil, fmt.Errorf("confirming that %s %s is gone: %w", r.kind, name, err)
	}
	out := candidates[:0]
	for _, p := range candidates {
		if p.Controller.UID != live.GetUID() {
			out = append(out, p)
		}
	}
	return out, nil
}

// releaseExpiry is how long this process remembers a finalizer it removed
// when the pod is neither in a ledger nor seen since: the memory only spares
// reads from the API server, so forgetting early costs one read.
const releaseExpiry = 10 * time.Minute

// releases remembers, per parent, the pods whose finalizer this process
// removed (the API server accepted the patch), until the cache shows it.
// Such a pod can be folded without reading it from the API server, and is
// not recorded again while the cache still shows its finalizer.
type releases struct {
	mu        sync.Mutex
	byParent  map[types.UID]map[types.UID]time.Time
	lastPrune time.Time
}

func newReleases() *releases {
	return &releases{byParent: map[types.UID]map[types.UID]time.Time{}}
}

func (r *releases) add(parent, pod types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.byParent[parent]
	if m == nil {
		m = map[types.UID]time.Time{}
		r.byParent[parent] = m
	}
	m[pod] = time.Now()
}

// of returns the parent's released pods, with when each was released.
func (r *releases) of(parent types.UID) map[types.UID]time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[types.UID]time.Time, len(r.byParent[parent]))
	for uid, at := range r.byParent[parent] {
		out[uid] = at
	}
	return out
}

// settle forgets the parent's released pods that neither ledger holds (the
// one the cached parent shows, read, and the one just written) and that the
// cache shows without the finalizer (or not at all), and, at most once a
// minute, every entry older than releaseExpiry. A parent cache one write
// behind still shows a pod folded just now: it is remembered until the
// cache has caught up, so that it is not read (or listed, once deleted) for
// nothing.
func (r *releases) settle(parent types.UID, pods []*Pod, read, written *Book) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if m := r.byParent[parent]; m != nil {
		cached := make(map[types.UID]*Pod, len(pods))
		for _, p := range pods {
			cached[p.UID] = p
		}
		for uid := range m {
			if p, ok := cached[uid]; !read.Has(uid) && !written.Has(uid) && (!ok || !p.Tracking) {
				delete(m, uid)
			}
		}
		if len(m) == 0 {
			delete(r.byParent, parent)
		}
	}
	now := time.Now()
	if now.Sub(r.lastPrune) < time.Minute {
		return
	}
	r.lastPrune = now
	for p, m := range r.byParent {
		for uid, at := range m {
			if now.Sub(at) > releaseExpiry {
				delete(m, uid)
			}
		}
		if len(m) == 0 {
			delete(r.byParent, p)
		}
	}
}
