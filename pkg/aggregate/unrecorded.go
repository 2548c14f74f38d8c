package aggregate

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/servable"
)

// TrackingKindIndex names the pod informer's index of the pods carrying
// the tracking finalizer, by their controller's kind: the pods to release
// when a kind cannot keep its totals.
const TrackingKindIndex = "tally.dev/tracking-kind"

// HeldIndex names the pod informer's index of the finished pods that still
// carry the tracking finalizer, by their controller's kind: the pods waiting
// on tally to go.
const HeldIndex = "tally.dev/held"

func indexTrackingKind(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && !p.Controller.Kind.Empty() {
		return []string{p.Controller.Kind.String()}, nil
	}
	return nil, nil
}

func indexHeld(obj any) ([]string, error) {
	if p, ok := obj.(*Pod); ok && p.Tracking && p.Finished() && !p.Controller.Kind.Empty() {
		return []string{p.Controller.Kind.String()}, nil
	}
	return nil, nil
}

// DefaultTrackingGrace is the default of --tracking-grace
// (docs/configuration.md says why).
const DefaultTrackingGrace = 2 * time.Minute

// unrecordedEvery is how often Unrecorded looks for pods to release.
const unrecordedEvery = 2 * time.Second

// Unrecorded releases the pods whose finish tally cannot record, so that no
// pod waits on tally's finalizer for longer than a bound:
//   - every pod of a kind with totals that the API server does not serve
//     for them (servable.Gate: a kind not served, without a status
//     subresource, or whose schema lacks the ledger or a total), at once
//     and uncounted;
//   - a finished pod of a served kind that is still held tracking grace
//     after this process first saw it finished (its deletion time when it
//     is being deleted, if earlier), counted as lost unless its parent's
//     ledger holds it (then the fold counts it).
//
// Each release is logged with the pods' names, counted in a metric, and
// reported by a Warning Event on the parent when it exists. It runs on the
// leader only.
type Unrecorded struct {
	kinds    []config.Parent
	gate     *servable.Gate
	pods     toolscache.Indexer
	parents  client.Reader
	writer   client.Writer
	recorder events.EventRecorder
	grace    time.Duration
	mayWrite func() bool
	log      logr.Logger
	now      func() time.Time

	mu sync.Mutex
	// finishedSince is when this process first saw each held pod finished,
	// by kind.
	finishedSince map[schema.GroupKind]map[types.UID]time.Time
}

// NewUnrecorded returns the releaser of the pods of kinds (those with totals)
// whose finish cannot be recorded. pods is the pod informer's indexer (with
// Indexers); parents reads parents from the cache.
func NewUnrecorded(kinds []config.Parent, gate *servable.Gate, pods toolscache.Indexer, parents client.Reader, writer client.Writer,
	recorder events.EventRecorder, grace time.Duration, mayWrite func() bool, log logr.Logger) *Unrecorded {
	var tracked []config.Parent
	for _, p := range kinds {
		if p.Tracked() {
			tracked = append(tracked, p)
		}
	}
	return &Unrecorded{kinds: tracked, gate: gate, pods: pods, parents: parents, writer: writer, recorder: recorder,
		grace: grace, mayWrite: mayWrite, log: log, now: time.Now, finishedSince: map[schema.GroupKind]map[types.UID]time.Time{}}
}

// Start looks for pods to release every few seconds until ctx is done.
func (u *Unrecorded) Start(ctx context.Context) error {
	ticker := time.NewTicker(unrecordedEvery)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
		for _, p := range u.kinds {
			if err := u.release(ctx, p); err != nil && ctx.Err() == nil {
				u.log.Error(err, "Releasing pods whose finish cannot be recorded; trying again", "kind", p.GroupKind().String())
			}
		}
	}
}

// release releases the pods of kind p that must not wait any longer.
func (u *Unrecorded) release(ctx context.Context, p config.Parent) error {
	kind := p.GroupKind()
	held, err := u.byIndex(HeldIndex, kind)
	if err != nil {
		return err
	}
	now := u.now()
	u.mu.Lock()
	since, expired := overdue(held, u.finishedSince[kind], now, u.grace)
	reportHeld(kind, since, now)
	if u.mayWrite != nil && !u.mayWrite() {
		// Fenced: the held pods are shown, and their clocks start only when
		// this replica may release them.
		u.mu.Unlock()
		return nil
	}
	u.finishedSince[kind] = since
	u.mu.Unlock()
	if problem := u.gate.Problem(kind); problem != nil {
		if problem.Unknown {
			// The API server could not tell: nothing is released on that.
			return nil
		}
		pods, err := u.byIndex(TrackingKindIndex, kind)
		if err != nil || len(pods) == 0 {
			return err
		}
		return u.releaseAll(ctx, p, pods, "unservable",
			fmt.Sprintf("tally cannot keep the totals of %s (%s): released without counting them", kind, problem.Err))
	}
	if len(expired) == 0 {
		return nil
	}
	return u.releaseAll(ctx, p, expired, "lost",
		fmt.Sprintf("tally could not record these pods within the tracking grace (%s): released; they are not counted in the totals", u.grace))
}

// reportHeld sets the held-pod gauges of kind from since, when each held pod
// has been held since.
func reportHeld(kind schema.GroupKind, since map[types.UID]time.Time, now time.Time) {
	var oldest time.Duration
	for _, at := range since {
		oldest = max(oldest, now.Sub(at))
	}
	heldPods.WithLabelValues(kind.String()).Set(float64(len(since)))
	oldestHeldPod.WithLabelValues(kind.String()).Set(oldest.Seconds())
}

// overdue returns since when each held pod has been held — since it was
// first seen finished (before remembers it; now for a pod not seen yet), or
// since its deletion when that is earlier — and the pods held for grace or
// longer. Pods no longer held are forgotten.
func overdue(held []*Pod, before map[types.UID]time.Time, now time.Time, grace time.Duration) (map[types.UID]time.Time, []*Pod) {
	since := make(map[types.UID]time.Time, len(held))
	var expired []*Pod
	for _, pod := range held {
		at, ok := before[pod.UID]
		if !ok {
			at = now
		}
		if d := pod.DeletionTimestamp; d != nil && d.Time.Before(at) {
			at = d.Time
		}
		since[pod.UID] = at
		if now.Sub(at) >= grace {
			expired = append(expired, pod)
		}
	}
	return since, expired
}

func (u *Unrecorded) byIndex(index string, kind schema.GroupKind) ([]*Pod, error) {
	pods, err := byIndex(u.pods, index, kind.String())
	if err != nil {
		return nil, fmt.Errorf("listing the pods of %s held by the tracking finalizer: %w", kind, err)
	}
	return pods, nil
}

// releaseAll removes the finalizer of pods, grouped by parent, and reports
// each group.
func (u *Unrecorded) releaseAll(ctx context.Context, p config.Parent, pods []*Pod, action, message string) error {
	kind := p.GroupKind().String()
	byParent := map[types.NamespacedName][]*Pod{}
	for _, pod := range pods {
		key := types.NamespacedName{Namespace: pod.Namespace, Name: pod.Controller.Name}
		byParent[key] = append(byParent[key], pod)
	}
	counter := trackingFinalizers.WithLabelValues(kind, action)
	for key, group := range byParent {
		parent := &unstructured.Unstructured{}
		parent.SetGroupVersionKind(p.GroupVersionKind())
		exists := u.parents.Get(ctx, key, parent) == nil
		var ledger Book
		if exists && action == "lost" {
			ledger, _ = ReadBook(parent.Object, p.LedgerPath(), nil)
		}
		var released, lost []string
		var err error
		for _, pod := range group {
			if err = patchRelease(ctx, u.writer, pod); err != nil {
				break
			}
			counter.Inc()
			released = append(released, pod.Name)
			if action == "lost" && !ledger.Has(pod.UID) {
				trackingLost.WithLabelValues(kind).Inc()
				lost = append(lost, pod.Name)
			}
		}
		if len(released) > 0 {
			u.log.Info("Released pods held by the tracking finalizer", "kind", kind, "parent", key, "reason", action, "pods", released, "lost", lost)
			if exists && (action != "lost" || len(lost) > 0) {
				names := released
				if action == "lost" {
					names = lost
				}
				u.recorder.Eventf(parent, nil, corev1.EventTypeWarning, eventReason[action], "ReleaseTracking",
					"%s: %s", message, strings.Join(names, ", "))
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// eventReason is the reason of the Warning Event each kind of release sends.
var eventReason = map[string]string{"unservable": "TrackingReleasedUncounted", "lost": "TrackingLost"}

// patchRelease removes the tracking finalizer from pod; a pod already gone,
// or whose name another pod took since, counts as released.
func patchRelease(ctx context.Context, w client.Writer, pod *Pod) error {
	err := w.Patch(ctx, podMeta(pod.Namespace, pod.Name), releasePatch(pod.UID), client.FieldOwner(FieldManager))
	if !Released(err) {
		return fmt.Errorf("removing the tracking finalizer of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}
