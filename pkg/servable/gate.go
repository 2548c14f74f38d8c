package servable

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"tally.dev/tally/pkg/config"
)

// Interval is how often a Gate checks its kinds again; RetryUnknown, while
// the API server could not tell for some kind.
const (
	Interval     = 30 * time.Second
	RetryUnknown = 2 * time.Second
)

// Gate tells which kinds with totals the API server serves as tally needs
// (Checker.Totals), checking again every Interval. Until its first check a
// kind is not served: the webhook then adds no finalizer, and the aggregator
// adds it to the running pods once the kind is served.
type Gate struct {
	checker TotalsChecker
	parents []config.Parent
	log     logr.Logger

	mu       sync.RWMutex
	problems map[schema.GroupKind]*Problem
	// notServedSince is when the API server began to say, in a row, that
	// it does not serve a kind (notServedYet).
	notServedSince map[schema.GroupKind]time.Time
	now            func() time.Time
	// checked is closed once every kind was checked once.
	checked chan struct{}
	once    sync.Once
}

// TotalsChecker tells whether the API server serves a kind's totals
// (Checker).
type TotalsChecker interface {
	Totals(p config.Parent) *Problem
}

// NewGate returns a Gate over the parents that keep totals.
func NewGate(checker TotalsChecker, parents []config.Parent, log logr.Logger) *Gate {
	g := &Gate{checker: checker, log: log, problems: map[schema.GroupKind]*Problem{}, checked: make(chan struct{}),
		notServedSince: map[schema.GroupKind]time.Time{}, now: time.Now}
	for _, p := range parents {
		if p.Tracked() {
			g.parents = append(g.parents, p)
			g.problems[p.GroupKind()] = unknown("not-checked", errNotChecked)
		}
	}
	return g
}

var errNotChecked = notChecked{}

type notChecked struct{}

func (notChecked) Error() string { return "not checked yet" }

// Serves reports whether kind keeps totals and is served for them.
func (g *Gate) Serves(kind schema.GroupKind) bool {
	g.mu.RLock()
	defer g.mu.RUnlock()
	problem, tracked := g.problems[kind]
	return tracked && problem == nil
}

// Problem returns why kind is not served for its totals; nil when it is.
func (g *Gate) Problem(kind schema.GroupKind) *Problem {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.problems[kind]
}

// Report records that kind cannot be served for its totals, as seen by a
// write the API server refused, until the next check says otherwise.
func (g *Gate) Report(kind schema.GroupKind, problem *Problem) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, tracked := g.problems[kind]; tracked {
		g.problems[kind] = problem
	}
}

// Wait blocks until every kind was checked once, or ctx is done.
func (g *Gate) Wait(ctx context.Context) error {
	select {
	case <-g.checked:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Check checks every kind now, and reports whether the API server could
// tell for each.
func (g *Gate) Check() (known bool) {
	defer g.once.Do(func() { close(g.checked) })
	known = true
	for _, p := range g.parents {
		problem := g.checker.Totals(p)
		g.mu.Lock()
		before := g.problems[p.GroupKind()]
		problem = g.notServedYet(p.GroupKind(), before, problem)
		kept := problem != nil && problem.Unknown && (before == nil || !before.Unknown)
		if !kept {
			g.problems[p.GroupKind()] = problem
		}
		g.mu.Unlock()
		if problem != nil && problem.Unknown {
			known = false
		}
		switch {
		case kept:
			// One failed read (discovery, the schema) does not undo what
			// the API server said before: the webhook would skip the
			// finalizer meanwhile. Checked again in RetryUnknown.
			if log := g.log.V(1); log.Enabled() {
				log.Info("Cannot tell now whether the kind can keep totals; keeping what was known", "kind", p.GroupKind().String(), "reason", problem.Err.Error())
			}
		case problem != nil && problem.Unknown:
			if log := g.log.V(1); log.Enabled() {
				log.Info("Cannot tell yet whether the kind can keep totals; checking again", "kind", p.GroupKind().String(), "reason", problem.Err.Error())
			}
		case problem != nil && (before == nil || before.Unknown):
			g.log.Error(problem, "Kind cannot keep totals: its pods get no tracking finalizer and lose it if they have it", "kind", p.GroupKind().String(), "problem", problem.Name)
		case problem == nil && before != nil:
			g.log.Info("Kind keeps totals: its pods get the tracking finalizer", "kind", p.GroupKind().String())
		}
	}
	return known
}

// NotServedAfter is how long the API server must say in a row that it does
// not serve a kind (discovery's 404, no mapping) before the kind counts as
// not served: a restarted API server answers so for every custom resource
// until it has read the CRDs, and a kind not served loses its pods'
// tracking finalizers, uncounted.
const NotServedAfter = 30 * time.Second

// notServedYet returns problem, or, while a "not-served" answer about kind
// has not lasted NotServedAfter in a row (and kind was not already not
// served), a problem that cannot tell. Call it with g.mu held.
func (g *Gate) notServedYet(kind schema.GroupKind, before, problem *Problem) *Problem {
	if problem == nil || problem.Name != "not-served" || problem.Unknown {
		delete(g.notServedSince, kind)
		return problem
	}
	if before != nil && before.Name == "not-served" && !before.Unknown {
		return problem
	}
	since, seen := g.notServedSince[kind]
	if !seen {
		since = g.now()
		g.notServedSince[kind] = since
	}
	if g.now().Sub(since) >= NotServedAfter {
		delete(g.notServedSince, kind)
		return problem
	}
	return unknown("not-served", fmt.Errorf("%w (said for %s; not served once said for %s in a row)", problem.Err, g.now().Sub(since).Round(time.Second), NotServedAfter))
}

// Start checks every kind, then again every Interval until ctx is done.
func (g *Gate) Start(ctx context.Context) error {
	if len(g.parents) == 0 {
		g.once.Do(func() { close(g.checked) })
		return nil
	}
	for {
		next := Interval
		if !g.Check() {
			next = RetryUnknown
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(next):
		}
	}
}

// NeedLeaderElection reports that every replica checks.
func (g *Gate) NeedLeaderElection() bool { return false }
