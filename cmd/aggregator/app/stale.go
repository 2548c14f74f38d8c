package app

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// staleViewAfter is how long a manager runs on while its pod view is stale
// and the API server answers.
const staleViewAfter = 10 * time.Second

// relistAllowance is how long a relist under way (a LIST of every pod, or a
// watch-list's initial events) may take before its time counts as stale: at
// 150,000 pods one takes about 20 s, and a new manager would only start it
// again.
const relistAllowance = time.Minute

// errStaleView stops a manager whose pod view stays stale while the API
// server answers.
var errStaleView = errors.New("the pod view stayed stale while the API server answered: starting a new manager with new caches (giving up the lease, if held)")

// staleView stops the manager when its pod view has been stale for after
// (staleViewAfter) of time during which the API server answered: whatever
// keeps the view stale (a watch that cannot be reopened, a relist never
// counted as delivered, client-go's relist back-off), a new manager lists
// the pods afresh, and a leader gives the lease up, so that a replica with
// a fresh view takes over (this one competes again after 2 RetryPeriods).
// It runs on every replica, leader or not, so that a standby is ready.
//
// Only the time the API server answered counts, and a check it did not
// answer (it is away, or too slow for 2 s) pauses the count instead of
// starting it anew, so that a loaded API server that misses a check now and
// then cannot keep a view stale for good. Nor does the first allowance
// (relistAllowance) of a relist under way count (a new manager would start
// it again; relists retried one after another are one), nor the first
// allowance between two watches while the indexer catches up with what the
// reflector synced (the view is not stale then, only not yet known fresh).
// A view that is stale because the API server throttles the pod list or
// watch (429, API Priority and Fairness) starts the count anew: every
// replica is throttled alike, a new manager would only relist, and after an
// outage the watch needs a moment to deliver again. Nothing is written from
// the stale view meanwhile (MayWrite).
func staleView(restCfg *rest.Config, watch *watchMonitor, after, allowance time.Duration) manager.Runnable {
	return alwaysRunnable(func(ctx context.Context) error {
		cfg := rest.CopyConfig(restCfg)
		cfg.Timeout = 2 * time.Second
		disco, err := discovery.NewDiscoveryClientForConfig(cfg)
		if err != nil {
			return err
		}
		ticker := time.NewTicker(time.Second)
		defer ticker.Stop()
		// answered is how long the API server has answered while the view
		// was stale.
		var answered time.Duration
		last := time.Now()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-ticker.C:
			}
			now := time.Now()
			step := now.Sub(last)
			last = now
			if watch.fresh() || watch.isThrottled() {
				answered = 0
				continue
			}
			stale := watch.stale()
			if stale == 0 {
				// Between two watches: not stale, only not yet known
				// fresh, unless that lasts.
				if stale = watch.betweenFor(); stale < allowance {
					answered = 0
					continue
				}
			}
			if relist := watch.relistFor(); relist > 0 && relist < allowance {
				continue
			}
			if _, err := disco.ServerVersion(); err != nil {
				continue
			}
			// The first step may have begun before the view went stale.
			answered = min(answered+step, stale)
			if answered >= after {
				return fmt.Errorf("%w (stale for %s, %s of it with the API server answering)", errStaleView,
					stale.Round(time.Second), answered.Round(time.Second))
			}
		}
	})
}

// alwaysRunnable is a manager.Runnable that runs on every replica, not
// only on the leader.
type alwaysRunnable func(ctx context.Context) error

func (f alwaysRunnable) Start(ctx context.Context) error { return f(ctx) }

// NeedLeaderElection implements manager.LeaderElectionRunnable.
func (alwaysRunnable) NeedLeaderElection() bool { return false }

// managerRestarts counts the managers this process stopped and started
// again, by reason.
var managerRestarts = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "tally_aggregator_manager_restarts_total",
	Help: "Managers the aggregator stopped and started again in its process, by reason: stale_view (the pod view stayed stale for 10 s of time the API server answered, a relist under way counting after its first minute), lease_lost, or error (the API server unreachable at start, or another failure; the log says which).",
}, []string{"reason"})

func init() { metrics.Registry.MustRegister(managerRestarts) }

// restartReason names why a manager stopped with err, for managerRestarts.
func restartReason(err error) string {
	switch {
	case errors.Is(err, errStaleView):
		return "stale_view"
	case err != nil && strings.Contains(err.Error(), "leader election lost"):
		return "lease_lost"
	}
	return "error"
}
