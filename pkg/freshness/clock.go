package freshness

import (
	"context"
	"time"
)

// PauseBound is how long the process may go without running before its
// view is in doubt. A process paused (SIGSTOP, a debugger, a stalled
// machine) keeps its watch connections: what the API server sent meanwhile
// waits in them, and the cache shows the objects as they were before the
// pause until the informer has read it all. The pause is a doubt like any
// other: the streams stay open, a relist under way goes on, and the view
// is fresh once the cache holds a version read after it.
const PauseBound = 2 * time.Second

// clockTick is how often the clock looks at the time.
const clockTick = 250 * time.Millisecond

// clock notices the process not running for longer than PauseBound, until
// ctx is done.
func (m *Monitor) clock(ctx context.Context) {
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
// tick is more than PauseBound ago. Times are monotonic offsets: a step of
// the wall clock is no pause.
func (m *Monitor) tick(now time.Time) {
	at := int64(now.Sub(m.started))
	last := m.lastTick.Load()
	if last != 0 && time.Duration(at-last) > PauseBound {
		// A doubt before the tick is recorded: no reconcile sees the view
		// fresh in between.
		m.doubt("the process did not run for "+time.Duration(at-last).Round(time.Millisecond).String(), true)
	}
	m.lastTick.Store(at)
}

// paused reports whether the process has not run for longer than
// PauseBound as far as the clock knows: true from the moment a paused
// process runs again until the clock has ticked (and raised the doubt), so
// that no reconcile that runs first counts from the view of before.
func (m *Monitor) paused() bool {
	last := m.lastTick.Load()
	return last != 0 && m.now()-time.Duration(last) > PauseBound
}
