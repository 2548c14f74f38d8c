package freshness

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
)

// StallAfter is how long a view may stay stale with nothing delivered,
// counting only time the API server answered, before the watchdog gives up on
// the informer.
const StallAfter = 20 * time.Second

// ErrStalled says the view stayed stale with nothing delivered while the
// API server answered.
var ErrStalled = errors.New("the pod view stayed stale with nothing delivered while the API server answered: starting a new manager with new caches (giving up the lease, if held)")

// watchdog returns ErrStalled once the view has been stale with nothing
// delivered (stalled) for after of time during which the API server
// answered (its version, read through cfg within 2 s), or nil when ctx is
// done. Whatever keeps the view from moving (a watch connection that
// stopped carrying anything, client-go's back-off, a first sync that never
// ends), a new informer starts afresh. A relist that makes progress, however
// long, is never cut: each byte it reads is progress. Time the API server
// did not answer pauses the count rather than starting it anew, so that a
// loaded API server that misses a check now and then cannot keep a view
// stale for good. A view that is stale because the API server throttles the
// informer (429) starts the count anew: every replica is throttled alike,
// and a new informer would only list again.
// The count also starts anew while excused (when set) says so (Views).
func (m *Monitor) watchdog(ctx context.Context, cfg *rest.Config, after time.Duration, excused func() bool) error {
	cfg = rest.CopyConfig(cfg)
	cfg.Timeout = 2 * time.Second
	disco, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return err
	}
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	// answered is how long the API server has answered while the view was
	// stalled.
	var answered time.Duration
	last := m.now()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
		now := m.now()
		step := now - last
		last = now
		stalled := m.stalled()
		if stalled == 0 || m.staleAnswered(http.StatusTooManyRequests) || (excused != nil && excused()) {
			answered = 0
			continue
		}
		if _, err := disco.ServerVersion(); err != nil {
			continue
		}
		// The first step may have begun before the stall.
		answered = min(answered+step, stalled)
		if answered >= after {
			return fmt.Errorf("%w (the view of %s: stale for %s, nothing delivered for %s, %s of it with the API server answering)", ErrStalled,
				m.opts.name(), m.Stale().Round(time.Second), stalled.Round(time.Second), answered.Round(time.Second))
		}
	}
}
