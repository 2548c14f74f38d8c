package aggregate

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate/count"
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
	// pods is the pod index (PodCaches); synced waits for it.
	pods     count.Index
	synced   func(context.Context) bool
	interval time.Duration
	// Namespaces selects the namespaces whose pods are stamped (the
	// webhook registration's namespaceSelector); nil selects every one.
	Namespaces labels.Selector
	// within are the namespaces whose pods are listed: [""] (every
	// namespace) or a fixed list, which Namespaces selects too.
	within []string
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
	// refusedLast is set when the last sweep may not list the pods of a
	// namespace.
	refusedLast atomic.Bool
	mu          sync.Mutex
	// swept holds the namespaces a sweep has read ("" for every one).
	swept map[string]bool
}

// NewBackfill returns a sweep that decides with rules, reads pods through
// reader (uncached) and patches them through writer. pods is the pod index
// (an informer's indexer with count.Indexers, or count.Indexes) and synced
// waits until it has synced.
func NewBackfill(rules *mutate.Mutator, reader client.Reader, writer client.Writer, pods count.Index, synced func(context.Context) bool, interval time.Duration, log logr.Logger) *Backfill {
	return &Backfill{
		rules: rules, reader: reader, writer: writer, pods: pods, synced: synced,
		interval: interval, Unstamped: NewUnstamped(), log: log, done: make(chan struct{}), swept: map[string]bool{},
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

// fencedPoll is how often a sweep waiting to start checks whether this
// replica may write.
const fencedPoll = 500 * time.Millisecond

// Start runs the first sweep, retrying it until it completes, then sweeps
// every interval until ctx is done. It runs on the leader only, as the
// reconcilers do.
func (b *Backfill) Start(ctx context.Context) error {
	// (A cache reports synced once the manager stops: apiwait.Until.)
	if !b.synced(ctx) || ctx.Err() != nil {
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

	for {
		if !sleep(ctx, b.next()) {
			return nil
		}
		if _, err := b.Sweep(ctx); err != nil && ctx.Err() == nil {
			b.log.Error(err, "Backfill sweep failed; the next one retries", "in", b.next().String())
		}
	}
}

// next returns the wait before the next sweep: the interval, or less after
// a sweep that may not list the pods of a namespace, whose parents are not
// written until a sweep has read it (Swept).
func (b *Backfill) next() time.Duration {
	if b.refusedLast.Load() {
		return min(b.interval, refusedRetry)
	}
	return b.interval
}

// refusedRetry is how soon a sweep follows one that may not list the pods
// of a namespace.
const refusedRetry = 30 * time.Second

// Swept reports whether a sweep has read the pods of namespace ns (every
// namespace's, when it lists them all at once): the first count written
// for a parent includes its pods the webhook never saw. A namespace whose
// pods a sweep may not list (its Role missing) is not swept until one can.
func (b *Backfill) Swept(ns string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.swept[metav1.NamespaceAll] || b.swept[ns]
}

// markSwept records that a sweep read the pods of namespaces.
func (b *Backfill) markSwept(namespaces []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, ns := range namespaces {
		b.swept[ns] = true
	}
}

// Sweep stamps, with the webhook's rules, every pod without the
// keys.ParentUID label and every cached pod whose tally metadata those
// rules would change, in the namespaces Namespaces selects. It lists pods a
// page at a time, metadata only: once to read them (Unstamped holds those
// it will stamp), and, when any needs a patch, again to stamp them. Pods
// that cannot be stamped are logged, counted in
// tally_aggregator_unstamped_pods and tried again by the next sweep. It
// starts once this replica may write. It returns how many pods it patched,
// and an error when it could not go through every pod.
func (b *Backfill) Sweep(ctx context.Context) (int, error) { return b.sweep(ctx, nil) }

// sweep is Sweep, calling read (when set) once every pod has been read.
func (b *Backfill) sweep(ctx context.Context, read func()) (int, error) {
	for b.mayWrite != nil && !b.mayWrite() {
		// Not a sweep yet: it starts once this replica may write (a pod
		// view fresh again after an API server restart must not wait out
		// a back-off), or ends with ctx (the lease lost).
		if !sleep(ctx, fencedPoll) {
			return 0, ctx.Err()
		}
	}
	start := time.Now()
	s := sweep{Backfill: b}
	err := s.run(ctx, read)
	s.reportReleased()
	result := "complete"
	switch {
	case err != nil:
		result = "failed"
	case len(s.refused) > 0:
		result = "partial"
		unstampedPods.Set(float64(s.unstamped))
	default:
		unstampedPods.Set(float64(s.unstamped))
	}
	b.refusedLast.Store(len(s.refused) > 0)
	backfillSweeps.WithLabelValues(result).Inc()
	backfillDuration.Observe(time.Since(start).Seconds())
	kv := []any{"result", result, "seen", s.seen, "stamped", s.stamped, "unstamped", s.unstamped, "took", time.Since(start).Round(time.Millisecond).String()}
	if len(s.refused) > 0 {
		kv = append(kv, "refusedNamespaces", s.refused)
	}
	b.log.Info("Backfill sweep", kv...)
	return s.stamped, err
}
