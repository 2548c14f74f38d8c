package demo

import (
	"sync"
	"time"
)

// timeline is what a run showed over time, for its plot: a snapshot a
// quarter of a second, and what the scenario did when.
type timeline struct {
	start time.Time

	mu      sync.Mutex
	samples []sample
	events  []event
}

type sample struct {
	at time.Duration
	Snapshot
}

// eventKind says what the scenario did.
type eventKind int

const (
	// scaled: the pool's replicas were changed.
	scaled eventKind = iota
	// deleted: a running pod was deleted without intent.
	deleted
	// crashed: a running pod failed without intent.
	crashed
	// ended: the scenario stopped changing things.
	ended
)

type event struct {
	at   time.Duration
	kind eventKind
	what string
}

func newTimeline(start time.Time) *timeline { return &timeline{start: start} }

func (t *timeline) sample(now time.Time, s Snapshot) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.samples = append(t.samples, sample{at: now.Sub(t.start), Snapshot: s})
}

func (t *timeline) mark(kind eventKind, what string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.events = append(t.events, event{at: time.Since(t.start), kind: kind, what: what})
}

// read returns copies of the samples and events.
func (t *timeline) read() ([]sample, []event) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]sample(nil), t.samples...), append([]event(nil), t.events...)
}
