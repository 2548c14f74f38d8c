package aggregate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
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
// what that decision gives, and patches the pods that need it, in the
// namespaces the webhook is called for.
//
// A sweep first reads every unlabelled pod and holds those it will stamp in
// Unstamped, where the counts find them; then it stamps them at the
// client's rate. The reconcilers wait for the first sweep's read (Wait), so
// the first count written for a parent already includes its pods that
// existed before tally, however many stamps are still to be written.
type Backfill struct {
	rules *mutate.Mutator
	// reader lists and reads pods and namespaces from the API server,
	// metadata only.
	reader client.Reader
	writer client.Writer
	// pods is the pod informer's indexer; synced waits for it.
	pods     toolscache.Indexer
	synced   func(context.Context) bool
	interval time.Duration
	// Namespaces selects the namespaces whose pods are stamped (the
	// webhook registration's namespaceSelector); nil selects every one.
	Namespaces labels.Selector
	// Unstamped holds the pods the last read found, until the cache shows
	// them stamped.
	Unstamped *Unstamped
	// mayWrite, when set, tells whether this replica may still write.
	mayWrite func() bool
	// recorder, when set, reports the pods released because their kind
	// keeps no totals, by a Warning Event on their controller.
	recorder events.EventRecorder
	log      logr.Logger
	// done is closed once the first sweep has read every pod.
	done chan struct{}
}

// NewBackfill returns a sweep that decides with rules, reads pods through
// reader (uncached) and patches them through writer. pods is the pod
// informer's indexer (with Indexers) and synced waits until it has synced.
func NewBackfill(rules *mutate.Mutator, reader client.Reader, writer client.Writer, pods toolscache.Indexer, synced func(context.Context) bool, interval time.Duration, log logr.Logger) *Backfill {
	return &Backfill{
		rules: rules, reader: reader, writer: writer, pods: pods, synced: synced,
		interval: interval, Unstamped: NewUnstamped(), log: log, done: make(chan struct{}),
	}
}

// Wait blocks until the first sweep has read every pod, or ctx is done.
func (b *Backfill) Wait(ctx context.Context) error {
	select {
	case <-b.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Start runs the first sweep, retrying it until it completes, then sweeps
// every interval until ctx is done. It runs on the leader only, as the
// reconcilers do.
func (b *Backfill) Start(ctx context.Context) error {
	if !b.synced(ctx) {
		return nil
	}
	var once sync.Once
	read := func() { once.Do(func() { close(b.done) }) }
	for retry := time.Second; ; retry = min(2*retry, time.Minute) {
		if _, err := b.sweep(ctx, read); err == nil {
			break
		} else if ctx.Err() == nil {
			b.log.Error(err, "Start-up backfill sweep failed; no status is written until its read completes", "retryIn", retry.String())
		}
		if !sleep(ctx, retry) {
			return nil
		}
	}

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

// Sweep stamps, with the webhook's rules, every pod without the
// keys.ParentUID label and every cached pod whose tally metadata those
// rules would change, in the namespaces Namespaces selects. It lists pods a
// page at a time, metadata only: once to read them (Unstamped holds those
// it will stamp), and, when any needs a patch, again to stamp them. Pods
// that cannot be stamped are logged, counted in
// tally_aggregator_unstamped_pods and tried again by the next sweep. It returns how many pods it patched, and an error when it
// could not go through every pod.
func (b *Backfill) Sweep(ctx context.Context) (int, error) { return b.sweep(ctx, nil) }

// sweep is Sweep, calling read (when set) once every pod has been read.
func (b *Backfill) sweep(ctx context.Context, read func()) (int, error) {
	start := time.Now()
	s := sweep{Backfill: b}
	err := s.run(ctx, read)
	s.reportReleased()
	result := "complete"
	if err != nil {
		result = "failed"
	} else {
		unstampedPods.Set(float64(s.unstamped))
	}
	backfillSweeps.WithLabelValues(result).Inc()
	backfillDuration.Observe(time.Since(start).Seconds())
	b.log.Info("Backfill sweep", "result", result, "seen", s.seen, "stamped", s.stamped, "unstamped", s.unstamped,
		"took", time.Since(start).Round(time.Millisecond).String())
	return s.stamped, err
}

// sweep is the state of one Sweep.
type sweep struct {
	*Backfill
	seen, unstamped, stamped int
	// released holds the pods whose tracking finalizer the sweep removed
	// (their kind keeps no totals), by controller.
	released map[types.UID]*releasedPods
	// inScope reports whether the pods of a namespace are stamped.
	inScope func(ns string) bool
}

func (s *sweep) run(ctx context.Context, read func()) error {
	if s.mayWrite != nil && !s.mayWrite() {
		return errors.New("this replica's leader lease may have passed to another replica")
	}
	var err error
	if s.inScope, err = s.scope(ctx); err != nil {
		return err
	}
	found, patches, err := s.read(ctx)
	if err != nil {
		return err
	}
	s.Unstamped.replace(found)
	if read != nil {
		read()
	}

	if patches {
		if err := s.stampUnlabelled(ctx); err != nil {
			return err
		}
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
		if !ok || !s.inScope(cached.Namespace) {
			continue
		}
		pod := podMeta(cached.Namespace, cached.Name)
		if err := s.reader.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			if !apierrors.IsNotFound(err) {
				s.report(pod, fmt.Sprintf("reading the pod: %v", err))
			}
			continue
		}
		s.stamp(ctx, pod, "")
	}
	return ctx.Err()
}

// stampUnlabelled lists the unlabelled pods again and stamps those in scope,
// each decided again on what it is now; then it forgets the pods read that
// are no longer unlabelled and not cached: gone (or stamped by someone
// else, which the cache shows soon).
func (s *sweep) stampUnlabelled(ctx context.Context) error {
	listed := map[string]bool{}
	err := eachUnlabelled(ctx, s.reader, "", func(pod *metav1.PartialObjectMetadata) error {
		key := pod.Namespace + "/" + pod.Name
		listed[key] = true
		if s.inScope(pod.Namespace) {
			s.stamp(ctx, pod, key)
		}
		return ctx.Err()
	})
	if err != nil {
		return err
	}
	for _, key := range s.Unstamped.Keys() {
		if !listed[key] {
			if _, exists, err := s.pods.GetByKey(key); err == nil && !exists {
				s.Unstamped.Forget(key, true)
			}
		}
	}
	return nil
}

// scope returns whether the pods of a namespace are to be stamped, from the
// namespaces the API server lists now.
func (s *sweep) scope(ctx context.Context) (func(string) bool, error) {
	if s.Namespaces == nil || s.Namespaces.Empty() {
		return func(string) bool { return true }, nil
	}
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NamespaceList"))
	if err := s.reader.List(ctx, list); err != nil {
		return nil, fmt.Errorf("listing namespaces (the sweep stamps only the pods of those the webhook's namespaceSelector selects): %w", err)
	}
	selected := make(map[string]bool, len(list.Items))
	for i := range list.Items {
		ns := &list.Items[i]
		// As the API server matches a namespaceSelector: the namespace's
		// labels, which always include kubernetes.io/metadata.name.
		if s.Namespaces.Matches(labels.Set(ns.Labels)) {
			selected[ns.Name] = true
		}
	}
	return func(ns string) bool { return selected[ns] }, nil
}

// read returns, by pod key, the unlabelled pods in scope that the webhook's
// rules stamp, as Unstamped holds them: reduced as the cache reduces pods,
// under the parent their stamp names; and whether any unlabelled pod in
// scope needs a patch at all. A pod's phase is not in its metadata: when
// there are pods to hold, the terminal ones are found by listing each
// terminal phase.
func (s *sweep) read(ctx context.Context) (map[string]*Pod, bool, error) {
	found := map[string]*Pod{}
	patches := false
	err := eachUnlabelled(ctx, s.reader, "", func(pod *metav1.PartialObjectMetadata) error {
		if !s.inScope(pod.Namespace) {
			return nil
		}
		s.seen++
		meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences}
		d := s.rules.Decide(ctx, mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, Now: time.Now()})
		patches = patches || len(d.Patch) > 0 || len(s.untrack(pod)) > 0 || d.Denied != "" || d.Unavailable != ""
		if d.Denied != "" || d.Unavailable != "" || d.Parent.UID == "" {
			return nil
		}
		parent := types.UID(intern(string(d.Parent.UID)))
		p := &Pod{
			Meta:       Meta{Name: pod.Name, Namespace: intern(pod.Namespace), UID: pod.UID, DeletionTimestamp: pod.DeletionTimestamp},
			ParentUID:  parent,
			Controller: Controller{Kind: d.Parent.GroupKind, Name: intern(d.Parent.Name), UID: parent},
		}
		_, p.Intent = pod.Annotations[keys.CompletionIntent]
		found[pod.Namespace+"/"+pod.Name] = p
		return ctx.Err()
	})
	if err != nil || len(found) == 0 {
		return found, patches, err
	}
	for _, phase := range []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed} {
		err := eachUnlabelled(ctx, s.reader, "status.phase="+string(phase), func(pod *metav1.PartialObjectMetadata) error {
			if p, ok := found[pod.Namespace+"/"+pod.Name]; ok && p.UID == pod.UID {
				p.Phase = phase
			}
			return nil
		})
		if err != nil {
			return nil, false, err
		}
	}
	return found, patches, nil
}

// eachUnlabelled calls fn for each pod without the keys.ParentUID label
// matching fieldSelector ("" for all), listing metadata a page at a time.
func eachUnlabelled(ctx context.Context, reader client.Reader, fieldSelector string, fn func(*metav1.PartialObjectMetadata) error) error {
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(podListGVK)
	opts := []client.ListOption{client.MatchingLabelsSelector{Selector: unlabelled}, client.Limit(BackfillPageSize)}
	if fieldSelector != "" {
		sel, err := fields.ParseSelector(fieldSelector)
		if err != nil {
			return err
		}
		opts = append(opts, client.MatchingFieldsSelector{Selector: sel})
	}
	for n := len(opts); ; {
		if err := reader.List(ctx, list, opts...); err != nil {
			return fmt.Errorf("listing pods without %s: %w", keys.ParentUID, err)
		}
		for i := range list.Items {
			if err := fn(&list.Items[i]); err != nil {
				return err
			}
		}
		if list.Continue == "" {
			return nil
		}
		opts = append(opts[:n], client.Continue(list.Continue))
	}
}

// stamp applies the webhook's rules to pod and patches it when they change
// it, reading it again when it changed in between. key, when set, is the
// pod's entry in Unstamped: forgotten when the pod is gone.
func (s *sweep) stamp(ctx context.Context, pod *metav1.PartialObjectMetadata, key string) {
	if key == "" {
		s.seen++ // a cached pod; the unlabelled ones were seen by read
	}
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
		untrack := s.untrack(pod)
		patch := append(d.Patch, untrack...)
		if len(patch) == 0 {
			return
		}
		// The patch holds only if the pod is still the one decided on.
		ops := append([]mutate.PatchOp{{Op: "test", Path: "/metadata/resourceVersion", Value: pod.ResourceVersion}}, patch...)
		err := s.writer.Patch(ctx, pod, client.RawPatch(types.JSONPatchType, mutate.AppendPatch(nil, ops)), client.FieldOwner(FieldManager))
		switch {
		case err == nil:
			podsStamped.Inc()
			s.stamped++
			if len(untrack) > 0 {
				s.releasedOne(pod)
			}
			if log := s.log.V(1); log.Enabled() {
				log.Info("Stamped pod", "pod", client.ObjectKeyFromObject(pod), "parent", pod.Annotations[keys.Parent])
			}
			return
		case apierrors.IsNotFound(err):
			if key != "" {
				s.Unstamped.Forget(key, true)
			}
			return
		case (apierrors.IsConflict(err) || apierrors.IsInvalid(err)) && attempt < stampAttempts:
			// Changed since it was read: decide again on what it is now.
			k := client.ObjectKeyFromObject(pod)
			*pod = *podMeta(k.Namespace, k.Name)
			if err := s.reader.Get(ctx, k, pod); err != nil {
				if apierrors.IsNotFound(err) && key != "" {
					s.Unstamped.Forget(key, true)
				} else if !apierrors.IsNotFound(err) {
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

// releasedPods are the pods of one controller whose tracking finalizer a
// sweep removed.
type releasedPods struct {
	controller metav1.OwnerReference
	namespace  string
	names      []string
}

// releasedOne counts the release of pod's tracking finalizer by the sweep,
// and keeps it for reportReleased.
func (s *sweep) releasedOne(pod *metav1.PartialObjectMetadata) {
	ref := metav1.GetControllerOfNoCopy(pod)
	if ref == nil {
		trackingFinalizers.WithLabelValues("", "orphaned").Inc()
		return
	}
	gv, _ := schema.ParseGroupVersion(ref.APIVersion)
	trackingFinalizers.WithLabelValues(schema.GroupKind{Group: gv.Group, Kind: ref.Kind}.String(), "orphaned").Inc()
	if s.released == nil {
		s.released = map[types.UID]*releasedPods{}
	}
	r := s.released[ref.UID]
	if r == nil {
		r = &releasedPods{controller: *ref, namespace: pod.Namespace}
		s.released[ref.UID] = r
	}
	r.names = append(r.names, pod.Name)
}

// reportReleased sends one Warning Event on each controller whose pods the
// sweep released.
func (s *sweep) reportReleased() {
	if s.recorder == nil {
		return
	}
	for _, r := range s.released {
		parent := &unstructured.Unstructured{}
		parent.SetAPIVersion(r.controller.APIVersion)
		parent.SetKind(r.controller.Kind)
		parent.SetNamespace(r.namespace)
		parent.SetName(r.controller.Name)
		parent.SetUID(r.controller.UID)
		reportOptedOut(s.recorder, parent, parent.GroupVersionKind().GroupKind().String(), r.names)
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
