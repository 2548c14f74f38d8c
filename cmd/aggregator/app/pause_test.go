package app

import (
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
)

type closeRecorder struct {
	io.Reader
	closed atomic.Bool
}

func (c *closeRecorder) Close() error { c.closed.Store(true); return nil }

func (c *closeRecorder) isClosed() bool { return c.closed.Load() }

// TestAPausedProcessCountsNothingFromBefore: once the process has not run
// for longer than pauseBound, its view is not fresh, from the moment it
// runs again (before its clock ticks), then in a new epoch with its pod
// watch ended; a tick on time changes nothing.
func TestAPausedProcessCountsNothingFromBefore(t *testing.T) {
	m := newWatchMonitor(logr.Discard())
	stream := &closeRecorder{Reader: strings.NewReader("")}
	m.current = stream
	start := time.Now()
	m.tick(start)
	assert.True(t, m.fresh())

	m.tick(start.Add(clockTick))
	assert.True(t, m.fresh(), "a tick on time")
	assert.False(t, stream.isClosed())
	epoch := m.viewEpoch()

	// The process was stopped 3 s ago, right after a tick, and runs again:
	// its clock has not ticked yet.
	m.lastTick.Store(int64(time.Since(m.started) - 3*time.Second))
	assert.False(t, m.fresh(), "counted from the view of before the pause")
	assert.Equal(t, epoch, m.viewEpoch())

	m.tick(time.Now())
	assert.False(t, m.fresh(), "fresh before a watch delivered again")
	assert.Equal(t, epoch+1, m.viewEpoch(), "a count taken before the pause could still be written")
	assert.Eventually(t, stream.isClosed, time.Second, 10*time.Millisecond, "the watch that held what was sent during the pause goes on")
}
