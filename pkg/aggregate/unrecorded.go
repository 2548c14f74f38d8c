package aggregate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/servable"
)

// DefaultTrackingGrace is the default of --tracking-grace
// (docs/configuration.md says why).
const DefaultTrackingGrace = 2 * time.Minute

// unrecordedEvery is how often Unrecorded looks for pods to release.
const unrecordedEvery = 2 * time.Second

// parentReadWait bounds the parent reads of one release pass.
const parentReadWait = 2 * time.Second

// Unrecorded releases the pods whose finish tally cannot record, so that no
// pod waits on tally's finalizer for longer than a bound:
//   - every pod of a kind with totals that the API server does not serve
//     for them (servable.Gate: a kind not served, without a status
//     subresource, or whose schema lacks the ledger or a total), at once
//     and uncounted;
//   - a finished pod that is still held once the tracking grace has run
//     out for it, counted as lost unless its parent's ledger holds it (then
//     the fold counts it). This covers the pods the reconcilers release
//     uncounted (a parent gone, a kind that keeps no totals any more, a
//     namespace out of scope) whatever became of their reconciles.
//
// The grace counts only time during which this process could record the
// pod: from when it first saw the pod finished, once the pod's parent has
// been reconciled while this replica may write (so after the start-up
// sweep's read), and not while this replica does not hold the lease or the
// gate cannot tell whether the kind is servable. It keeps running while the
// pod view is stale: a pod past it is decided from live reads of the pod and
// of its parent's ledger (releaseLost). A pod whose finish no reconcile would
// record — its parent gone (as the cache shows it), its kind keeping no
// totals, its namespace out of scope — uses its grace without waiting for
// a reconcile. An aggregator that was away gives every pod the whole grace
// when it comes back, except a pod that finished, as its own metadata
// shows, heldAtMost graces ago or more: it is released once its grace has
// run for pastLimitRun in this process (a quarter of the grace, at most 30
// s), recorded or not. So no history of restarts and leader changes, each
// starting the grace anew, holds a pod much past heldAtMost graces after
// its finish, unless no process lives that long.
//
// The release of a parent's pods as lost and the recording of its pods in
// its ledger exclude each other (recordLocks): a pod is counted in a total
// or as lost, never both.
//
// Each release is logged with the pods' names, counted in a metric, and
// reported by a Warning Event on the parent when it exists. It runs on the
// leader only.
type Unrecorded struct {
	kinds   []config.Parent
	gate    *servable.Gate
	pods    count.Index
	parents client.Reader
	// live reads a parent from the API server, when set.
	live     client.Reader
	writer   client.Writer
	recorder events.EventRecorder
	grace    time.Duration
	// leads tells whether this replica holds the lease (nil: always),
	// whatever its pod view: the grace runs while it does.
	leads      func() bool
	reconciled *reconciledParents
	// recording is shared with the reconcilers; scope tells the namespaces
	// where pods are tracked (nil: every one).
	recording *recordLocks
	scope     *Scope
	log       logr.Logger
	now       func() time.Time
	// serverNow is the API server's time (apiclock), which the finish a
	// pod's metadata shows is compared with.
	serverNow func() time.Time

	mu sync.Mutex
	// held is what is known of each held pod, by kind; lastPass is when
	// each kind was last looked at.
	held     map[schema.GroupKind]map[types.UID]heldPod
	lastPass map[schema.GroupKind]time.Time
	// logged is when the held pods of each parent were last logged.
	logged map[parentKey]time.Time
}

// heldPod is what Unrecorded knows of a finished pod that still carries the
// tracking finalizer.
type heldPod struct {
	// seen is when this process first saw it held.
	seen time.Time
	// used is how much of the grace it has used since.
	used time.Duration
}

// NewUnrecorded returns the releaser of the pods of kinds whose finish
// cannot be recorded. pods is the pod index (with count.Indexers);
// parents reads parents from the cache.
func NewUnrecorded(kinds []config.Parent, gate *servable.Gate, pods count.Index, parents client.Reader, writer client.Writer,
	recorder events.EventRecorder, grace time.Duration, leads func() bool, reconciled *reconciledParents, log logr.Logger) *Unrecorded {
	return &Unrecorded{kinds: kinds, gate: gate, pods: pods, parents: parents, writer: writer, recorder: recorder,
		grace: grace, leads: leads, reconciled: reconciled, log: log, now: time.Now, serverNow: time.Now,
		held: map[schema.GroupKind]map[types.UID]heldPod{}, lastPass: map[schema.GroupKind]time.Time{}, logged: map[parentKey]time.Time{}}
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
	held, err := u.byIndex(count.HeldIndex, kind)
	if err != nil {
		return err
	}
	now := clocks{local: u.now(), server: u.serverNow()}
	var problem *servable.Problem
	if p.Tracked() {
		problem = u.gate.Problem(kind)
	}
	writes := u.leads == nil || u.leads()
	parents := map[types.NamespacedName]graceOf{}
	if writes && (problem == nil || !problem.Unknown) {
		parents = u.graceRuns(ctx, p, held)
	}
	of := func(pod *count.Pod) graceOf { return parents[parentOf(pod)] }
	u.mu.Lock()
	var elapsed time.Duration
	if last, ok := u.lastPass[kind]; ok {
		elapsed = now.local.Sub(last)
	}
	u.lastPass[kind] = now.local
	known, expired := overdue(held, u.held[kind], now, elapsed, u.grace, of)
	u.held[kind] = known
	reportHeld(kind, held, known, now)
	u.logWaiting(kind, held, known, now, func(pod *count.Pod) string {
		switch g := parents[parentOf(pod)]; {
		case !writes:
			return "this replica does not hold the lease: the grace waits"
		case problem != nil && problem.Unknown:
			return "whether the API server serves the kind with totals cannot be told: the grace waits"
		case g.orphaned:
			return "its parent is gone, its kind keeps no totals, or its namespace is not selected: released uncounted once the grace runs out"
		case !g.runs:
			return "its parent has not been reconciled by this leader yet: the grace waits"
		}
		return "not recorded yet: its parent's status writes fail (the reconciler's log says why); the grace runs"
	})
	// A pod held for a second grace is released even when whether it is
	// lost cannot be told (its parent's ledger unreadable): the bound
	// holds.
	forced := map[types.UID]bool{}
	for _, pod := range expired {
		forced[pod.UID] = known[pod.UID].used >= 2*u.grace
	}
	u.mu.Unlock()
	if !writes {
		// Fenced: the held pods are shown, and their grace waits until
		// this replica may release them.
		return nil
	}
	if problem != nil {
		if problem.Unknown {
			// The API server could not tell: nothing is released on that.
			return nil
		}
		pods, err := u.byIndex(count.TrackingKindIndex, kind)
		if err != nil || len(pods) == 0 {
			return err
		}
		return u.releaseAll(ctx, p, pods, nil, "unservable",
			fmt.Sprintf("tally cannot keep the totals of %s (%s): released without counting them", kind, problem.Err))
	}
	var lost, orphaned []*count.Pod
	for _, pod := range expired {
		if parents[parentOf(pod)].orphaned {
			orphaned = append(orphaned, pod)
		} else {
			lost = append(lost, pod)
		}
	}
	var errs []error
	if len(orphaned) > 0 {
		// What the reconcilers release uncounted, had they come to it: no
		// total ever holds these pods, so none is lost.
		errs = append(errs, u.releaseAll(ctx, p, orphaned, nil, "orphaned",
			"tally released these pods after the tracking grace, uncounted: their parent is gone, their kind keeps no totals, or their namespace is not one tally's webhook registration selects"))
	}
	if len(lost) > 0 {
		errs = append(errs, u.releaseAll(ctx, p, lost, forced, "lost",
			fmt.Sprintf("tally could not record these pods within the tracking grace (%s), or within %d graces of their finish: released; they are not counted in the totals", u.grace, heldAtMost)))
	}
	return errors.Join(errs...)
}

func (u *Unrecorded) byIndex(index string, kind schema.GroupKind) ([]*count.Pod, error) {
	pods, err := count.ByIndex(u.pods, index, kind.String())
	if err != nil {
		return nil, fmt.Errorf("listing the pods of %s held by the tracking finalizer: %w", kind, err)
	}
	return pods, nil
}

// releaseAll removes the finalizer of pods, grouped by parent, and reports
// each group. A group fails alone: the others are released all the same.
// force names the lost pods released even when their parent's ledger
// cannot be read.
func (u *Unrecorded) releaseAll(ctx context.Context, p config.Parent, pods []*count.Pod, force map[types.UID]bool, action, message string) error {
	byParent := map[types.NamespacedName][]*count.Pod{}
	for _, pod := range pods {
		byParent[parentOf(pod)] = append(byParent[parentOf(pod)], pod)
	}
	// A read of a kind whose informer has not synced (its list or watch
	// forbidden, its resource changed) blocks, from the cache, or waits,
	// from the API server while the kind's view is not known fresh: each
	// read is bounded, and once one timed out the kind's other parents are not
	// read from the cache in this pass, so that such a kind cannot stall
	// the releases of every kind. A parent not read gets no Event; its pods
	// are released all the same.
	stalled := false
	var errs []error
	for key, group := range byParent {
		if action == "lost" {
			// At most PodBatch under one lock: the parent's reconcile
			// waits for it.
			for batch := range slices.Chunk(group, ledger.PodBatch) {
				errs = append(errs, u.releaseLost(ctx, p, key, batch, force, message))
			}
			continue
		}
		parent, exists := (*unstructured.Unstructured)(nil), false
		if !stalled {
			parent, exists, stalled = u.readParent(ctx, u.parents, p, key, group[0].Controller.UID)
		}
		released, err := u.releaseGroup(ctx, p, group, action)
		u.report(p, key, parent, exists, action, message, released, released)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// releaseLost releases a parent's pods whose grace ran out, counting as
// lost those its ledger does not hold, as the API server shows it now (a
// pod recorded a moment ago may not be in the cached one yet), and that
// still carried the finalizer when read just before (one the reconciler
// recorded, released and folded meanwhile is in a total). The ledger and
// the pods are read, and the pods released, under the parent's record
// lock. A ledger that cannot be read (the parent's read failing, the
// ledger malformed) leaves the pods held until the next pass, whether they
// are lost cannot be told, except those in force.
func (u *Unrecorded) releaseLost(ctx context.Context, p config.Parent, key types.NamespacedName, group []*count.Pod, force map[types.UID]bool, message string) error {
	defer u.recording.lock(parentKey{kind: p.GroupKind(), name: key})()
	reader := u.parents
	if u.live != nil {
		reader = u.live
	}
	parent, exists, _ := u.readParent(ctx, reader, p, key, group[0].Controller.UID)
	var book ledger.Book
	var unread error
	if parent == nil {
		unread = fmt.Errorf("not read within %s", parentReadWait)
	} else if exists {
		book, unread = ledger.ReadBook(parent.Object, p.LedgerPath(), nil)
	}
	if unread != nil {
		group = slices.DeleteFunc(slices.Clone(group), func(pod *count.Pod) bool { return !force[pod.UID] })
		if len(group) == 0 {
			return fmt.Errorf("reading the ledger of %s %s, whose pods' tracking grace ran out, to tell whether it holds them (they are released after a second grace all the same): %w", p.GroupKind(), key, unread)
		}
	}
	var carried []*count.Pod
	var errs []error
	for _, pod := range group {
		switch still, err := u.stillTracked(ctx, pod); {
		case err != nil:
			errs = append(errs, err)
		case still:
			carried = append(carried, pod)
		}
	}
	released, err := u.releaseGroup(ctx, p, carried, "lost")
	var lost []string
	for _, pod := range carried {
		if slices.Contains(released, pod.Name) && !book.Has(pod.UID) {
			trackingLost.WithLabelValues(p.GroupKind().String()).Inc()
			lost = append(lost, pod.Name)
		}
	}
	u.report(p, key, parent, exists, "lost", message, released, lost)
	return errors.Join(append(errs, err)...)
}

// stillTracked reports whether pod, read from the API server when it can
// be, still carries the tracking finalizer; a pod gone, or whose name
// another pod took, does not.
func (u *Unrecorded) stillTracked(ctx context.Context, pod *count.Pod) (bool, error) {
	if u.live == nil {
		return true, nil
	}
	live := podMeta(pod.Namespace, pod.Name)
	switch err := u.live.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: pod.Name}, live); {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("reading pod %s/%s, whose tracking grace ran out: %w", pod.Namespace, pod.Name, err)
	}
	return live.GetUID() == pod.UID && slices.Contains(live.GetFinalizers(), keys.TrackingFinalizer), nil
}

// readParent reads the parent of kind p named key, within parentReadWait,
// and reports whether it exists with UID uid. parent is nil when the read
// failed; timedOut reports a read that ran out of time.
func (u *Unrecorded) readParent(ctx context.Context, reader client.Reader, p config.Parent, key types.NamespacedName, uid types.UID) (parent *unstructured.Unstructured, exists, timedOut bool) {
	readCtx, cancel := context.WithTimeout(ctx, parentReadWait)
	defer cancel()
	parent = &unstructured.Unstructured{}
	parent.SetGroupVersionKind(p.GroupVersionKind())
	switch err := reader.Get(readCtx, key, parent); {
	case gone(err):
		return parent, false, false
	case err != nil:
		return nil, false, readCtx.Err() != nil
	}
	// Another parent under the name is not the pods' parent.
	return parent, parent.GetUID() == uid, false
}

// releaseGroup removes the finalizer of pods, each on its own, counting
// each under action, and returns the names of those released.
func (u *Unrecorded) releaseGroup(ctx context.Context, p config.Parent, pods []*count.Pod, action string) ([]string, error) {
	counter := trackingFinalizers.WithLabelValues(p.GroupKind().String(), action)
	var released []string
	var errs []error
	for _, pod := range pods {
		if err := patchRelease(ctx, u.writer, pod); err != nil {
			errs = append(errs, err)
			continue
		}
		counter.Inc()
		released = append(released, pod.Name)
	}
	return released, errors.Join(errs...)
}

// report logs the release of a parent's pods and, when the parent exists,
// sends the Warning Event that names them (for lost, those counted as lost;
// none: no Event).
func (u *Unrecorded) report(p config.Parent, key types.NamespacedName, parent *unstructured.Unstructured, exists bool, action, message string, released, named []string) {
	if len(released) == 0 {
		return
	}
	kv := []any{"kind", p.GroupKind().String(), "parent", key, "reason", action, "pods", released}
	if action == "lost" {
		kv = append(kv, "lost", named)
	}
	u.log.Info("Released pods held by the tracking finalizer", kv...)
	if exists && len(named) > 0 {
		u.recorder.Eventf(parent, nil, corev1.EventTypeWarning, eventReason[action], "ReleaseTracking",
			"%s: %d pod(s): %s", message, len(named), listed(named))
	}
}

// eventReason is the reason of the Warning Event each kind of release sends.
var eventReason = map[string]string{"unservable": "TrackingReleasedUncounted", "orphaned": "TrackingReleasedUncounted", "lost": "TrackingLost"}

// patchRelease removes the tracking finalizer from pod; a pod already gone,
// or whose name another pod took since, counts as released.
func patchRelease(ctx context.Context, w client.Writer, pod *count.Pod) error {
	err := w.Patch(ctx, podMeta(pod.Namespace, pod.Name), releasePatch(pod.UID), client.FieldOwner(FieldManager))
	if !Released(err) {
		return fmt.Errorf("removing the tracking finalizer of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}
