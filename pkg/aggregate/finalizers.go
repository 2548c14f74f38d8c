package aggregate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"

	"golang.org/x/sync/errgroup"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/keys"
)

// ReleasePatch is the strategic merge patch that removes the tracking
// finalizer from the pod with that UID, wherever it is in the list, and
// changes nothing when it is gone already (the Job controller removes its
// own the same way). The UID is a precondition: a pod created since under
// the same name is another pod, and the API server refuses the patch (see
// Released) instead of taking that pod's finalizer.
func ReleasePatch(uid types.UID) []byte {
	u, _ := json.Marshal(uid) // a string always encodes
	return []byte(`{"metadata":{"$deleteFromPrimitiveList/finalizers":["` + keys.TrackingFinalizer + `"],"uid":` + string(u) + `}}`)
}

// Released reports whether err, from a ReleasePatch, still means the pod
// it names holds the finalizer no more: the pod is gone (not found), or its
// name now belongs to another pod (the API server refuses the UID
// precondition as Invalid, metadata.uid being immutable).
func Released(err error) bool {
	if err == nil || apierrors.IsNotFound(err) {
		return true
	}
	var status apierrors.APIStatus
	if !apierrors.IsInvalid(err) || !errors.As(err, &status) || status.Status().Details == nil {
		return false
	}
	for _, cause := range status.Status().Details.Causes {
		if cause.Field == "metadata.uid" {
			return true
		}
	}
	return false
}

func releasePatch(uid types.UID) client.Patch {
	return client.RawPatch(types.StrategicMergePatchType, ReleasePatch(uid))
}

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
func (r *Reconciler) releaseAll(ctx context.Context, parent types.UID, pods []*count.Pod, action string) error {
	counter := trackingFinalizers.WithLabelValues(r.kind, action)
	return forEach(ctx, pods, func(ctx context.Context, p *count.Pod) error {
		err := r.Writer.Patch(ctx, podMeta(p.Namespace, p.Name), releasePatch(p.UID), client.FieldOwner(FieldManager))
		switch {
		case Released(err):
			counter.Inc()
			if parent != "" {
				r.releases.add(parent, p.UID)
			}
			passOf(ctx).release(p.UID)
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
func (r *Reconciler) trackAll(ctx context.Context, pods []*count.Pod) error {
	counter := trackingFinalizers.WithLabelValues(r.kind, "added")
	return forEach(ctx, pods, func(ctx context.Context, p *count.Pod) error {
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

// forEach calls f for each of pods, patchConcurrency at a time, and
// returns every error: one pod's failure does not stop the others.
func forEach(ctx context.Context, pods []*count.Pod, f func(context.Context, *count.Pod) error) error {
	var (
		g    errgroup.Group
		mu   sync.Mutex
		errs []error
	)
	g.SetLimit(patchConcurrency)
	for _, p := range pods {
		g.Go(func() error {
			if err := f(ctx, p); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
			return nil
		})
	}
	_ = g.Wait()
	return errors.Join(errs...)
}
