package aggregate

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

var (
	reconciles = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_reconciles_total",
		Help: "Parents reconciled, by parent kind.",
	}, []string{"kind"})
	applies = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_applies_total",
		Help: "Server-side applies of status counts sent, by parent kind.",
	}, []string{"kind"})
	appliesSkipped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_applies_skipped_total",
		Help: "Reconciles that sent no apply because every mapped field already held its count, by parent kind.",
	}, []string{"kind"})
	applyErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_apply_errors_total",
		Help: "Server-side applies of status counts that failed, by parent kind.",
	}, []string{"kind"})
	applyConflicts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_apply_conflicts_total",
		Help: "Applies refused because the parent changed since the cache showed it (expected under load, and from a deposed leader); the parent is counted again, by parent kind.",
	}, []string{"kind"})
	parentLiveReads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_parent_live_reads_total",
		Help: "Reads of parents (a Get, or a List of a namespace's parents) sent to the API server instead of the kind's cache, by parent kind: any read while the kind's view is not known fresh (a doubt about it not yet cleared), and a reconcile's when the cache shows a version older than this replica's last write.",
	}, []string{"kind"})
	appliesFenced = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_applies_fenced_total",
		Help: "Reconciles and applies held back because this replica's leader lease may have passed to another replica, or its pod view is known to be stale (the pod watch broken) or stopped being fresh since the count, by parent kind.",
	}, []string{"kind"})
	kindProblems = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "tally_aggregator_parent_kind_problems",
		Help: "1 for each configured parent kind the aggregator cannot serve, by kind and problem (not-served, cluster-scoped, no-status-subresource, resource-mismatch, field-not-in-schema: a mapped count, totals-not-in-schema: a mapped total or the ledger not declared, or declared with a type that refuses what tally writes, status-not-found).",
	}, []string{"kind", "problem"})
	customCountInvalid = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "tally_aggregator_custom_count_invalid",
		Help: "1 for each custom count the aggregator cannot keep (its name, path or expression is not valid: a configuration edited by hand, a rollback to a version whose CEL lacks a function), by parent kind and count: its field is left unwritten, everything else is served.",
	}, []string{"kind", "count"})
	podsStamped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tally_aggregator_backfill_stamped_pods_total",
		Help: "Pods the backfill sweep stamped (or corrected) with the webhook's rules.",
	})
	unstampedPods = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "tally_aggregator_unstamped_pods",
		Help: "Pods of a tracked kind that the last complete backfill sweep could not stamp (owner not verified, API error); they are not counted.",
	})
	pendingStamps = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "tally_aggregator_pending_stamps",
		Help: "Pods a backfill sweep read and will stamp, counted from what it read until the pod cache shows them stamped.",
	})
	backfillSweeps = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_backfill_sweeps_total",
		Help: "Backfill sweeps, by result: complete, partial (a namespace of a fixed list could not be listed, its Role missing; the others were swept), failed.",
	}, []string{"result"})
	trackingFinalizers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_tracking_finalizers_total",
		Help: "Changes to pods' tally.dev/tracking finalizer, by parent kind and action (added: a running pod without it, which the webhook did not give it or whose finalizer another client removed; released: a finished pod, once recorded; orphaned: a pod whose parent is gone, whose kind keeps no totals, or whose namespace the webhook registration does not select; unservable: a pod of a kind whose totals the API server does not serve, released uncounted; lost: a finished pod not recorded within --tracking-grace).",
	}, []string{"kind", "action"})
	trackingLost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_tracking_lost_pods_total",
		Help: "Finished pods released after --tracking-grace without being recorded: they are missing from the totals, by parent kind.",
	}, []string{"kind"})
	trackErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_tracking_errors_total",
		Help: "Tracking finalizers the API server refused to add (forbidden or invalid: a policy or RBAC denial), by parent kind.",
	}, []string{"kind"})
	ledgerLiveLists = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_ledger_live_lists_total",
		Help: "Lists of a parent's pods read from the API server, made when its ledger holds a pod the cache has never shown (after a restart, a pod deleted meanwhile), by parent kind.",
	}, []string{"kind"})
	ledgerLiveReads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_aggregator_ledger_live_reads_total",
		Help: "Pods read one by one from the API server, made when the cache alone cannot tell whether a finished pod still carries the tracking finalizer, by parent kind.",
	}, []string{"kind"})
	heldPods = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "tally_aggregator_held_pods",
		Help: "Finished pods that still carry the tally.dev/tracking finalizer, by parent kind (on the leader).",
	}, []string{"kind"})
	oldestHeldPod = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "tally_aggregator_oldest_held_pod_seconds",
		Help: "How long the finished pod held longest by the tally.dev/tracking finalizer has been held, since this process first saw it finished, by parent kind (on the leader); 0 when none is held.",
	}, []string{"kind"})
	backfillDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tally_aggregator_backfill_duration_seconds",
		Help:    "Time one backfill sweep took.",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
	})
)

// observed is what one manager's controllers feed the process's metrics
// with: when each parent's first unprocessed change was seen, and each
// parent's last counts. A manager owns its own (Setup), and the metrics,
// registered once per process, read the current manager's: a change a
// stopped manager saw and never picked up (a deposed leader's) is not
// reported as waiting by the manager started after it.
type observed struct {
	changes  *pending
	counted  *published
	compared *compared
}

func newObserved() *observed {
	return &observed{changes: newPending(), counted: newPublished(), compared: newCompared()}
}

// current is the observed of the manager running, or of none (empty).
var current atomic.Pointer[observed]

// observe makes a new observed current, for a manager about to start, and
// clears the gauges a previous manager set: what it held and what its
// sweeps left to stamp.
func observe() *observed {
	o := newObserved()
	current.Store(o)
	heldPods.Reset()
	oldestHeldPod.Reset()
	unstampedPods.Set(0)
	pendingStamps.Set(0)
	return o
}

// forget clears what o reported once its manager stopped, unless another
// manager's is current already.
func (o *observed) forget() {
	if current.Load() == o {
		observe()
	}
}

// currentCounts collects the counts of the current observed.
type currentCounts struct{}

func (currentCounts) Describe(ch chan<- *prometheus.Desc) {
	ch <- podsDesc
	ch <- parentsDesc
	ch <- comparedDesc
	ch <- differingDesc
	ch <- differenceDesc
}

func (currentCounts) Collect(ch chan<- prometheus.Metric) {
	o := current.Load()
	o.counted.Collect(ch)
	o.compared.Collect(ch)
}

func init() {
	current.Store(newObserved())
	metrics.Registry.MustRegister(reconciles, applies, appliesSkipped, applyErrors, applyConflicts, parentLiveReads, appliesFenced, kindProblems, customCountInvalid,
		podsStamped, unstampedPods, pendingStamps, backfillSweeps, backfillDuration, trackingFinalizers, trackingLost, trackErrors, heldPods, oldestHeldPod, ledgerLiveLists, ledgerLiveReads, currentCounts{},
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "tally_aggregator_oldest_unprocessed_change_seconds",
			Help: "Age of the oldest change to a parent or its pods that no reconcile has picked up yet; 0 when there is none.",
		}, func() float64 { return current.Load().changes.oldest(time.Now()).Seconds() }))
}

// trackingActions are the values of tally_aggregator_tracking_finalizers_total's
// action label.
var trackingActions = []string{"added", "released", "orphaned", "unservable", "lost"}

// initTrackingMetrics creates the tracking series of a kind with totals at
// zero, so that alerts and dashboards see them before their first event.
func initTrackingMetrics(kind string) {
	trackingLost.WithLabelValues(kind)
	trackErrors.WithLabelValues(kind)
	for _, action := range trackingActions {
		trackingFinalizers.WithLabelValues(kind, action)
	}
}

// parentKey identifies a parent across kinds.
type parentKey struct {
	kind schema.GroupKind
	name types.NamespacedName
}

// pending records when each parent first had an unprocessed change.
type pending struct {
	mu    sync.Mutex
	since map[parentKey]time.Time
}

func newPending() *pending { return &pending{since: map[parentKey]time.Time{}} }

// seen records a change to parent at now, unless an earlier one is pending.
func (p *pending) seen(parent parentKey, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.since[parent]; !ok {
		p.since[parent] = now
	}
}

// picked records that a reconcile of parent started: every change seen so
// far is being processed.
func (p *pending) picked(parent parentKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.since, parent)
}

func (p *pending) oldest(now time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	var age time.Duration
	for _, t := range p.since {
		age = max(age, now.Sub(t))
	}
	return age
}
