package aggregate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// BackfillPageSize is how many pods one page of a sweep's List holds: the
// most a sweep keeps in memory at once.
const BackfillPageSize = 500

// stampAttempts bounds how often one pod is read again and patched when it
// changed between the read and the patch.
const stampAttempts = 3

// Backfill stamps the pods the webhook never saw: pods created before tally
// was installed or before their kind was tracked, admitted while the webhook
// was unreachable, or skipped by owner verification. It applies the
// webhook's own decision (mutate.Mutator) to every pod without the
// keys.ParentUID label and to every cached pod whose tally metadata is not
// what that decision gives, and patches the pods that need it.
//
// A sweep runs once the pod cache has synced, and then every interval. The
// reconcilers wait for the first sweep's stamps to reach the cache (Wait),
// so the first count written for a parent already includes its pods that
// existed before tally.
type Backfill struct {
	rules *mutate.Mutator
	// reader lists and reads pods from the API server, metadata only.
	reader client.Reader
	writer client.Writer
	// pods is the pod informer's indexer; synced waits for it.
	pods     toolscache.Indexer
	synced   func(context.Context) bool
	interval time.Duration
	// mayWrite, when set, tells whether this replica may still write.
	mayWrite func() bool
	log      logr.Logger
	// done is closed once the first sweep's stamps are in the cache.
	done chan struct{}
}

// NewBackfill returns a sweep that decides with rules, reads pods through
// reader (uncached) and patches them through writer. pods is the pod
// informer's indexer (with Indexers) and synced waits until it has synced.
func NewBackfill(rules *mutate.Mutator, reader client.Reader, writer client.Writer, pods toolscache.Indexer, synced func(context.Context) bool, interval time.Duration, log logr.Logger) *Backfill {
	return &Backfill{
		rules: rules, reader: reader, writer: writer, pods: pods, synced: synced,
		interval: interval, log: log, done: make(chan struct{}),
	}
}

// Wait blocks until the first sweep's stamps are in the pod cache, or ctx
// is done.
func (b *Backfill) Wait(ctx context.Context) error {
	select {
	case <-b.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Start runs the first sweep, retrying it until it completes, waits for its
// stamps to reach the cache, then sweeps every interval until ctx is done.
// It runs on the leader only, as the reconcilers do.
func (b *Backfill) Start(ctx context.Context) error {
	if !b.synced(ctx) {
		return nil
	}
	for retry := time.Second; ; retry = min(2*retry, time.Minute) {
		stamped, err := b.Sweep(ctx)
		if err == nil {
			if err := b.awaitCached(ctx, stamped); err != nil {
				return nil // ctx is done
			}
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		b.log.Error(err, "Start-up backfill sweep failed; no status is written until it completes", "retryIn", retry.String())
		if !sleep(ctx, retry) {
			return nil
		}
	}
	close(b.done)

	ticker := time.NewTicker(b.interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
			if _, err := b.Sweep(ctx); err != nil && ctx.Err() == nil {
				b.log.Error(err, "Backfill sweep failed; the next one retries", "in", b.interval.String())
			}
		}
	}
}

// Stamped is a pod a sweep patched, with the parent UID label it now
// carries ("" when the label was removed).
type Stamped struct {
	Key       string
	UID       types.UID
	ParentUID types.UID
}

// Sweep stamps, with the webhook's rules, every pod without the
// keys.ParentUID label and every cached pod whose tally metadata those
// rules would change. It lists pods a page at a time, metadata only. Pods
// that cannot be stamped are logged, counted in
// tally_aggregator_unstamped_pods and tried again by the next sweep. It
// returns the pods it patched, and an error when it could not go through
// every pod.
func (b *Backfill) Sweep(ctx context.Context) ([]Stamped, error) {
	start := time.Now()
	s := sweep{Backfill: b}
	err := s.run(ctx)
	result := "complete"
	if err != nil {
		result = "failed"
	} else {
		unstampedPods.Set(float64(s.unstamped))
	}
	backfillSweeps.WithLabelValues(result).Inc()
	backfillDuration.Observe(time.Since(start).Seconds())
	b.log.Info("Backfill sweep", "result", result, "seen", s.seen, "stamped", len(s.stamped), "unstamped", s.unstamped,
		"took", time.Since(start).Round(time.Millisecond).String())
	return s.stamped, err
}

// sweep is the state of one Sweep.
type sweep struct {
	*Backfill
	seen, unstamped int
	stamped         []Stamped
}

func (s *sweep) run(ctx context.Context) error {
	if s.mayWrite != nil && !s.mayWrite() {
		return errors.New("this replica's leader lease may have passed to another replica")
	}
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(podListGVK)
	opts := []client.ListOption{client.MatchingLabelsSelector{Selector: unlabelled}, client.Limit(BackfillPageSize)}
	for {
		if err := s.reader.List(ctx, list, opts...); err != nil {
			return fmt.Errorf("listing pods without %s: %w", keys.ParentUID, err)
		}
		for i := range list.Items {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			s.stamp(ctx, &list.Items[i])
		}
		if list.Continue == "" {
			break
		}
		opts = append(opts[:2], client.Continue(list.Continue))
	}

	misstamped, err := s.pods.ByIndex(MisstampedIndex, misstampedValue)
	if err != nil {
		return fmt.Errorf("listing misstamped pods: %w", err)
	}
	for _, obj := range misstamped {
		if ctx.Err() != nil {
			break
		}
		cached, ok := obj.(*Pod)
		if !ok {
			continue
		}
		pod := podMeta(cached.Namespace, cached.Name)
		if err := s.reader.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			if !apierrors.IsNotFound(err) {
				s.report(pod, fmt.Sprintf("reading the pod: %v", err))
			}
			continue
		}
		s.stamp(ctx, pod)
	}
	return ctx.Err()
}

// stamp applies the webhook's rules to pod and patches it when they change
// it, reading it again when it changed in between.
func (s *sweep) stamp(ctx context.Context, pod *metav1.PartialObjectMetadata) {
	s.seen++
	for attempt := 1; ; attempt++ {
		meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences}
		d := s.rules.Decide(ctx, mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, Now: time.Now()})
		switch {
		case d.Denied != "":
			s.report(pod, d.Denied)
			return
		case d.Unavailable != "":
			s.report(pod, d.Unavailable)
			return
		case d.Unverified != "" && attempt == 1:
			// Not stamped, as the webhook would not; identity keys a client
			// set are still removed by the patch.
			s.report(pod, d.Unverified)
		}
		patch := append(d.Patch, s.untrack(pod)...)
		if len(patch) == 0 {
			return
		}
		// The patch holds only if the pod is still the one decided on.
		ops := append([]mutate.PatchOp{{Op: "test", Path: "/metadata/resourceVersion", Value: pod.ResourceVersion}}, patch...)
		uid := pod.UID
		err := s.writer.Patch(ctx, pod, client.RawPatch(types.JSONPatchType, mutate.AppendPatch(nil, ops)), client.FieldOwner(FieldManager))
		switch {
		case err == nil:
			podsStamped.Inc()
			s.stamped = append(s.stamped, Stamped{Key: pod.Namespace + "/" + pod.Name, UID: uid, ParentUID: types.UID(pod.Labels[keys.ParentUID])})
			if log := s.log.V(1); log.Enabled() {
				log.Info("Stamped pod", "pod", client.ObjectKeyFromObject(pod), "parent", pod.Annotations[keys.Parent])
			}
			return
		case apierrors.IsNotFound(err):
			return
		case (apierrors.IsConflict(err) || apierrors.IsInvalid(err)) && attempt < stampAttempts:
			// Changed since it was read: decide again on what it is now.
			key := client.ObjectKeyFromObject(pod)
			*pod = *podMeta(key.Namespace, key.Name)
			if err := s.reader.Get(ctx, key, pod); err != nil {
				if !apierrors.IsNotFound(err) {
					s.report(pod, fmt.Sprintf("reading the pod: %v", err))
				}
				return
			}
		default:
			s.report(pod, fmt.Sprintf("patching the pod: %v", err))
			return
		}
	}
}

// untrack returns the operation that removes the tracking finalizer from a
// pod whose controller's kind keeps no totals (it was removed from the
// configuration, or its totals were), and none otherwise. The pods of kinds
// that keep totals lose it through their parent's reconciler.
func (s *sweep) untrack(pod *metav1.PartialObjectMetadata) []mutate.PatchOp {
	i := slices.Index(pod.Finalizers, keys.TrackingFinalizer)
	if i < 0 {
		return nil
	}
	if ref := metav1.GetControllerOfNoCopy(pod); ref != nil {
		if gv, err := schema.ParseGroupVersion(ref.APIVersion); err == nil && s.rules.KeepsTotals(schema.GroupKind{Group: gv.Group, Kind: ref.Kind}) {
			return nil
		}
	}
	return []mutate.PatchOp{{Op: "remove", Path: "/metadata/finalizers/" + strconv.Itoa(i)}}
}

// report records a pod that could not be stamped.
func (s *sweep) report(pod *metav1.PartialObjectMetadata, reason string) {
	s.unstamped++
	s.log.Info("Pod could not be stamped; the next backfill sweep tries again", "pod", client.ObjectKeyFromObject(pod), "reason", reason)
}

// awaitCached waits until the pod cache shows every stamped pod as it was
// stamped, dropping pods that are gone or changed again since.
func (b *Backfill) awaitCached(ctx context.Context, stamped []Stamped) error {
	const recheck = 5 * time.Second
	last := time.Now()
	for {
		pending := stamped[:0]
		for _, s := range stamped {
			if !b.cached(s) {
				pending = append(pending, s)
			}
		}
		stamped = pending
		if len(stamped) == 0 {
			return nil
		}
		if time.Since(last) > recheck {
			// A pod deleted, or changed by someone else, right after it was
			// stamped may never show in the cache as stamped.
			stamped = b.stillStamped(ctx, stamped)
			last = time.Now()
		}
		if !sleep(ctx, 50*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func (b *Backfill) cached(s Stamped) bool {
	obj, exists, err := b.pods.GetByKey(s.Key)
	if err != nil {
		return false
	}
	pod, ok := obj.(*Pod)
	if s.ParentUID == "" {
		return !exists || !ok || pod.UID != s.UID
	}
	return exists && ok && pod.UID == s.UID && pod.ParentUID == s.ParentUID
}

// stillStamped returns the pods that the API server still shows as they
// were stamped.
func (b *Backfill) stillStamped(ctx context.Context, stamped []Stamped) []Stamped {
	var out []Stamped
	for _, s := range stamped {
		ns, name, _ := toolscache.SplitMetaNamespaceKey(s.Key)
		pod := podMeta(ns, name)
		err := b.reader.Get(ctx, client.ObjectKeyFromObject(pod), pod)
		if err == nil && (pod.UID != s.UID || types.UID(pod.Labels[keys.ParentUID]) != s.ParentUID) {
			continue
		}
		if apierrors.IsNotFound(err) {
			continue
		}
		out = append(out, s)
	}
	return out
}

var (
	podListGVK = corev1.SchemeGroupVersion.WithKind("PodList")
	// unlabelled selects the pods without the keys.ParentUID label.
	unlabelled = func() labels.Selector {
		req, err := labels.NewRequirement(keys.ParentUID, selection.DoesNotExist, nil)
		if err != nil {
			panic(err) // the key is a valid label key
		}
		return labels.NewSelector().Add(*req)
	}()
)

func podMeta(ns, name string) *metav1.PartialObjectMetadata {
	pod := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	pod.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Pod"))
	return pod
}

// sleep waits for d, and reports false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
