// Package app wires tally's aggregator into controller-runtime managers,
// run one after the other in the process: the shared pod cache, one
// controller per parent kind, leader election; the metrics and health
// endpoints are the process's, across them. cmd/aggregator and the test
// suites start the aggregator through Run.
package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/internal/apiwait"
	"tally.dev/tally/internal/command"
	"tally.dev/tally/internal/version"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/apiclock"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/freshness"
)

// Options configure the aggregator process.
type Options struct {
	// MetricsAddr is the metrics endpoint's address; "0" disables it.
	MetricsAddr string
	// ProbeAddr is the address of /healthz and /readyz; "0" disables them.
	ProbeAddr string
	// MetricsSecure serves metrics over HTTPS to authorized requesters.
	MetricsSecure bool
	// LeaderElect makes replicas elect one writer through a Lease.
	LeaderElect bool
	// LeaderElectionNamespace holds the Lease; the pod's own namespace when
	// empty and running in a cluster.
	LeaderElectionNamespace string
	// LeaderElectionID names the Lease; DefaultLeaderElectionID when empty.
	LeaderElectionID string
	// MaxConcurrentReconciles is how many parents of one kind are reconciled
	// at once.
	MaxConcurrentReconciles int
	// BackfillInterval is the time between two backfill sweeps;
	// DefaultBackfillInterval when zero.
	BackfillInterval time.Duration
	// TrackingGrace bounds how long a finished tracked pod waits to be
	// recorded; aggregate.DefaultTrackingGrace when zero.
	TrackingGrace time.Duration
	// QPS and Burst limit the requests to the API server; client-go's
	// defaults when zero.
	QPS   float32
	Burst int
	// DriftAfter is how long a field a parent's operator keeps may differ
	// from tally's count before the parent gets a Warning Event;
	// aggregate.DefaultDriftAfter when zero. (No flag sets it: the tests
	// shorten it.)
	DriftAfter time.Duration
	// ContentType is how pods travel from the API server: "protobuf" (the
	// default: less CPU for the initial list and the watch) or "json".
	ContentType string
}

// DefaultBackfillInterval is the default time between two backfill sweeps.
const DefaultBackfillInterval = 10 * time.Minute

// DefaultLeaderElectionID names the Lease the aggregator replicas elect a
// leader through, unless told otherwise.
const DefaultLeaderElectionID = "tally-aggregator"

// Run runs the aggregator until ctx is done. /readyz reports ready once the
// caches have synced, on the leader and on standbys alike; no status is
// written before that, nor by a replica that may have lost the lease, nor
// from a pod view not known to be fresh (freshness.Monitor). When its
// manager cannot start (the API server unreachable) or stops (the lease
// lost, the pod view stale with nothing delivered while the API server
// answers: freshness.Views.Watchdog), the aggregator starts a new one in
// this process after a bounded back-off, not ready meanwhile: a process that
// exited instead would pile up the kubelet's restart back-off (up to 5
// minutes) on top of the outage.
func Run(ctx context.Context, cfg *config.Config, restCfg *rest.Config, opts Options) error {
	log := ctrl.Log.WithName("aggregator")
	ctx = ctrl.LoggerInto(ctx, log)
	if err := opts.Validate(); err != nil {
		return err
	}
	// A custom count that cannot be kept matches no pod, and is left
	// unwritten: the rest is served. It is reported once per process.
	reducer := count.NewReducer(cfg.Parents)
	reports := aggregate.NewCustomCountReports(cfg.Parents)
	if err := cfg.CompareErrors(); err != nil {
		// Like a custom count: a comparison that cannot be made is left
		// out, the others are made.
		log.Error(err, "Comparisons that cannot be made are left out, the others are made (fix the configuration: kubectl tally doctor shows the error)")
	}
	restCfg = rest.CopyConfig(restCfg)
	sendAppliesOnce(restCfg)
	if opts.QPS > 0 {
		restCfg.QPS = opts.QPS
	}
	if opts.Burst > 0 {
		restCfg.Burst = opts.Burst
	}
	// controller-runtime asks for protobuf for built-in kinds when the
	// config names no content type; custom resources travel as JSON.
	if opts.ContentType == "json" {
		restCfg.ContentType = runtime.ContentTypeJSON
	}
	// One pod view per namespace of a fixed list, or one of every
	// namespace. The monitors' barriers read through a config they do not
	// observe.
	namespaces := cfg.FixedNamespaces()
	if namespaces != nil {
		log.Info("Watching pods and parents only in the namespaces the namespaceSelector lists", "namespaces", namespaces)
	}
	watched := namespaces
	if watched == nil {
		watched = []string{metav1.NamespaceAll}
	}
	var view freshness.Views
	for _, ns := range watched {
		m, err := freshness.New(log, rest.CopyConfig(restCfg), freshness.Options{
			Resource: corev1.SchemeGroupVersion.WithResource("pods"), LabelSelector: aggregate.PodSelector().String(), Namespace: ns,
		})
		if err != nil {
			return err
		}
		view = append(view, m)
	}
	// The metrics endpoint's reviews of its requesters are not the
	// informers'.
	metricsCfg := rest.CopyConfig(restCfg)
	view.Wrap(restCfg)
	view.Publish()
	go view.Run(ctx)
	go checkKubernetes(log, rest.CopyConfig(restCfg))
	// The finish a pod's metadata shows is compared with the API server's
	// clock, not this machine's.
	var apiClock apiclock.Clock
	apiClock.Wrap(restCfg)

	identity, err := newIdentity()
	if err != nil {
		return err
	}
	if opts.LeaderElect {
		// The Lease's holderIdentity: which replica leads.
		log.Info("Electing a leader", "lease", opts.LeaderElectionID, "identity", identity)
	}
	var p probes
	stopProbes, err := p.serve(ctx, opts.ProbeAddr)
	if err != nil {
		return fmt.Errorf("serving /healthz and /readyz on %s: %w", opts.ProbeAddr, err)
	}
	defer stopProbes()
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	stopMetrics, err := serveMetrics(ctx, metricsCfg, opts, fail)
	if err != nil {
		return err
	}
	defer stopMetrics()
	backoff := restartBackoff{min: 500 * time.Millisecond, max: 2 * time.Second}
	for {
		start := time.Now()
		err := runManager(ctx, cfg, reducer, reports, restCfg, opts, view, namespaces, apiClock.Now, identity, &p)
		p.set(nil)
		if ctx.Err() != nil {
			if err := failure(ctx); err != nil {
				return err
			}
			log.Info("Aggregator stopped", "ran", time.Since(start).Round(time.Second).String())
			return nil
		}
		if errors.Is(err, errConfig) {
			return err
		}
		wait := backoff.next(time.Since(start))
		if errors.Is(err, freshness.ErrStalled) && opts.LeaderElect {
			// Let a replica with a fresh view take the lease first.
			wait = 2 * RetryPeriod
		}
		managerRestarts.WithLabelValues(restartReason(err)).Inc()
		log.Error(err, "Aggregator stopped; starting again in this process", "ran", time.Since(start).Round(time.Second).String(), "in", wait.String())
		select {
		case <-ctx.Done():
			return failure(ctx)
		case <-time.After(wait):
		}
	}
}

// failure returns why the process's run ended, once ctx is done: nil when
// it was told to stop, the error of what it serves otherwise.
func failure(ctx context.Context) error {
	if cause := context.Cause(ctx); !errors.Is(cause, context.Canceled) && !errors.Is(cause, context.DeadlineExceeded) {
		return cause
	}
	return nil
}

// errConfig marks a configuration the API server refuses: starting again
// cannot help, the aggregator exits.
var errConfig = errors.New("the configuration cannot be served")

// checkKubernetes logs an error when the API server is older than tally
// supports (version.CheckKubernetes). The aggregator runs on: its view is
// proved fresh there too, but only once a pod changes.
func checkKubernetes(log logr.Logger, cfg *rest.Config) {
	cfg.Timeout = 30 * time.Second
	disco, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		log.Error(err, "Cannot check the API server's version")
		return
	}
	info, err := disco.ServerVersion()
	if err != nil {
		log.Error(err, "Cannot check the API server's version")
		return
	}
	if err := version.CheckKubernetes(info.GitVersion); err != nil {
		log.Error(err, "Unsupported Kubernetes version", "minimum", version.MinKubernetes)
	}
}

// Validate checks the options and fills in their defaults.
func (opts *Options) Validate() error {
	if opts.MaxConcurrentReconciles < 1 {
		return fmt.Errorf("--max-concurrent-reconciles must be at least 1, not %d", opts.MaxConcurrentReconciles)
	}
	if opts.BackfillInterval == 0 {
		opts.BackfillInterval = DefaultBackfillInterval
	}
	if opts.BackfillInterval < time.Second {
		return fmt.Errorf("--backfill-interval must be at least 1s, not %s", opts.BackfillInterval)
	}
	if opts.TrackingGrace == 0 {
		opts.TrackingGrace = aggregate.DefaultTrackingGrace
	}
	if opts.TrackingGrace < time.Second {
		return fmt.Errorf("--tracking-grace must be at least 1s, not %s", opts.TrackingGrace)
	}
	if opts.LeaderElectionID == "" {
		opts.LeaderElectionID = DefaultLeaderElectionID
	}
	switch opts.ContentType {
	case "", "protobuf", "json":
	default:
		return fmt.Errorf("--kube-api-content-type must be protobuf or json, not %q", opts.ContentType)
	}
	if opts.LeaderElect && opts.LeaderElectionNamespace == "" {
		ns, err := os.ReadFile(inClusterNamespace)
		if err != nil {
			return errors.New("--leader-election-namespace is required outside a cluster")
		}
		opts.LeaderElectionNamespace = string(ns)
	}
	return nil
}

// runManager runs one manager until ctx is done or it stops.
func runManager(ctx context.Context, cfg *config.Config, reducer *count.Reducer, reports *aggregate.CustomCountReports, restCfg *rest.Config, opts Options, view freshness.Views, namespaces []string, serverNow func() time.Time, identity string, p *probes) error {
	log := ctrl.LoggerFrom(ctx)
	// The watchdog runs from before the manager starts: a first sync that
	// never ends is a stall too.
	ctx, stop := context.WithCancelCause(ctx)
	watchdog := make(chan struct{})
	defer func() {
		stop(nil)
		<-watchdog
	}()
	go func() {
		defer close(watchdog)
		if err := view.Watchdog(ctx, restCfg, freshness.StallAfter); err != nil {
			stop(err)
		}
	}()
	mgrOpts := manager.Options{
		// With a fixed list of namespaces, the pods are in caches of
		// their own (aggregate.NewPodCaches), one per namespace.
		Cache:    aggregate.CacheOptions(reducer, namespaces),
		NewCache: apiwait.Until(ctx, apiwait.NewCache),
		// The process serves the metrics and the probes (serveMetrics,
		// probes), across managers.
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 log,
	}
	aggOpts := aggregate.Options{
		MaxConcurrentReconciles: opts.MaxConcurrentReconciles, BackfillInterval: opts.BackfillInterval, VerifyOwner: cfg.VerifyOwner,
		TrackingGrace: opts.TrackingGrace, Namespaces: cfg.Namespaces(), NewCache: mgrOpts.NewCache, ServerNow: serverNow,
		CustomCountReports: reports, DriftAfter: opts.DriftAfter,
		// Never from a pod view not known to be fresh: a parent event
		// while the pod watch is broken would be counted from pods that
		// moved since.
		MayWrite: view.FreshIn, ViewEpoch: view.EpochIn,
	}
	if opts.LeaderElect {
		lock, err := newFencedLock(restCfg, opts.LeaderElectionNamespace, opts.LeaderElectionID, identity)
		if err != nil {
			return err
		}
		mgrOpts.LeaderElection = true
		mgrOpts.LeaderElectionResourceLockInterface = lock
		// Names the lease in leader_election_master_status, which the
		// chart's TallyAggregatorNoLeader alert selects.
		mgrOpts.LeaderElectionID, mgrOpts.LeaderElectionNamespace = opts.LeaderElectionID, opts.LeaderElectionNamespace
		mgrOpts.LeaseDuration, mgrOpts.RenewDeadline, mgrOpts.RetryPeriod = ptr.To(LeaseDuration), ptr.To(RenewDeadline), ptr.To(RetryPeriod)
		mgrOpts.LeaderElectionReleaseOnCancel = true
		aggOpts.MayWrite = func(ns string) bool { return lock.Holds() && view.FreshIn(ns) }
		aggOpts.Leads = lock.Holds
	}
	mgr, err := ctrl.NewManager(restCfg, mgrOpts)
	if err != nil {
		return fmt.Errorf("creating manager: %w", err)
	}
	if err := command.CheckScopes(mgr.GetRESTMapper(), cfg.Parents); err != nil {
		return fmt.Errorf("%w: %w", errConfig, err)
	}
	pods, err := aggregate.NewPodCaches(ctx, mgr, mgrOpts.NewCache, reducer, namespaces)
	if err != nil {
		return err
	}
	aggOpts.Pods = pods
	if err := aggregate.Setup(ctx, mgr, cfg.Parents, aggOpts); err != nil {
		return err
	}
	for i, ns := range pods.Namespaces() {
		view[i].Attach(pods.Informer(ns))
	}
	synced, err := command.CachesSynced(mgr, pods.WaitForCacheSync)
	if err != nil {
		return err
	}
	p.set(synced)
	log.Info("Starting aggregator", "parents", len(cfg.Parents), "leaderElect", opts.LeaderElect, "leaderElectionID", opts.LeaderElectionID,
		"maxConcurrentReconciles", opts.MaxConcurrentReconciles, "backfillInterval", opts.BackfillInterval.String(), "trackingGrace", opts.TrackingGrace.String(), "verifyOwner", cfg.VerifyOwner)
	err = mgr.Start(ctx)
	if cause := context.Cause(ctx); errors.Is(cause, freshness.ErrStalled) {
		return cause
	}
	return err
}
