package app

import (
	"context"
	"time"
)

// pauseBound is how long the process may go without running before its pod
// view counts as stale. A process paused (SIGSTOP, a debugger, a stalled
// machine) keeps its watch connections: what the API server sent meanwhile
// waits in them, and the cache shows the pods as they were before the
// pause until the informer has read it all. Counts taken meanwhile would be
// as old as the pause, with the lease still held and the parent unchanged.
const pauseBound = 2 * time.Second

// clockTick is how often watchClock looks at the clock.
const clockTick = 250 * time.Millisecond

// watchClock notices the process not running for longer than pauseBound,
// until ctx is done: the view is then stale (a new epoch: no count taken
// before is written), and the pod watch is ended, so that client-go lists
// the pods again (it does so after a watch that ends with an error) and the
// view is fresh once that list is delivered.
func (m *watchMonitor) watchClock(ctx context.Context) {
	t := time.NewTicker(clockTick)
	defer t.Stop()
	m.tick(time.Now())
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.tick(time.Now())
		}
	}
}

// tick records that the process runs at now, after a pause if the last
// tick is more than pauseBound ago. Times are kept as monotonic offsets
// from the monitor's start: a step of the wall clock is no pause.
func (m *watchMonitor) tick(now time.Time) {
	at := int64(now.Sub(m.started))
	last := m.lastTick.Load()
	if last != 0 && time.Duration(at-last) > pauseBound {
		// Stale, in a new epoch, before the tick is recorded: no reconcile
		// sees the view fresh in between. Dated now, not when the pause
		// began: the time the process did not run is no time the view was
		// seen stale (the stale-view restart counts that).
		m.brokenAt(now, "the process did not run for "+time.Duration(at-last).Round(time.Millisecond).String())
		m.mu.Lock()
		current := m.current
		m.mu.Unlock()
		if current != nil {
			// Closing a stream the connection has data for may wait on it.
			go current.Close()
		}
	}
	m.lastTick.Store(at)
}

// paused reports whether the process has not run for longer than
// pauseBound as far as the clock goroutine knows: true from the moment a
// paused process runs again until watchClock has ticked (and marked the
// view stale), so that no reconcile that runs first counts from it.
func (m *watchMonitor) paused() bool {
	last := m.lastTick.Load()
	return last != 0 && time.Since(m.started)-time.Duration(last) > pauseBound
}
