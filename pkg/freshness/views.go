package freshness

import (
	"context"
	"net/http"
	"sync"
	"time"

	"k8s.io/client-go/rest"
)

// Views judges a view made of several informers' views, one Monitor each:
// the pods or parents of a fixed list of namespaces, watched one namespace
// at a time; or one Monitor of every namespace. As a whole it is fresh only
// while every one is, and its epoch changes whenever any one's does; what
// is read of one namespace needs only that namespace's view (FreshIn,
// EpochIn).
type Views []*Monitor

// in returns the views that cover namespace ns: all of them for "" (every
// namespace) or when one watches every namespace; the one of ns otherwise,
// and false when none does.
func (v Views) in(ns string) (Views, bool) {
	if ns == "" {
		return v, true
	}
	for _, m := range v {
		if m.opts.Namespace == "" || m.opts.Namespace == ns {
			return Views{m}, true
		}
	}
	return nil, false
}

// FreshIn reports whether the view of namespace ns ("" for every
// namespace) is known fresh; false for a namespace no view watches.
func (v Views) FreshIn(ns string) bool {
	w, ok := v.in(ns)
	return ok && w.Fresh()
}

// EpochIn returns the generation of doubt of the view of namespace ns (""
// for every namespace); 0 for a namespace no view watches.
func (v Views) EpochIn(ns string) uint64 {
	w, _ := v.in(ns)
	return w.Epoch()
}

// Fresh reports whether every view is known fresh.
func (v Views) Fresh() bool {
	fresh := true
	for _, m := range v {
		// Each is asked: Fresh brings a monitor up to date.
		fresh = m.Fresh() && fresh
	}
	return fresh
}

// Epoch returns the sum of the views' generations of doubt: each only
// grows, so the sum changes whenever one of them does.
func (v Views) Epoch() uint64 {
	var sum uint64
	for _, m := range v {
		sum += m.Epoch()
	}
	return sum
}

// Stale returns how long the stalest view has not been known fresh; 0
// while every one is.
func (v Views) Stale() time.Duration {
	var stale time.Duration
	for _, m := range v {
		stale = max(stale, m.Stale())
	}
	return stale
}

// Wrap makes cfg's requests observed by every monitor, each seeing its own
// informer's.
func (v Views) Wrap(cfg *rest.Config) {
	for _, m := range v {
		m.Wrap(cfg)
	}
}

// Run runs every monitor until ctx is done.
func (v Views) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, m := range v {
		wg.Go(func() { m.Run(ctx) })
	}
	wg.Wait()
}

// Watchdog runs every monitor's watchdog, and returns the first one's
// ErrStalled (the others stop), or nil once ctx is done. Of several, a view
// the API server refuses (401, 403: the Role of its namespace missing) is
// not a stall while another view is fresh: a new manager would be refused
// again, and would stop the namespaces that are served. One refused while
// no other is fresh is (a lagging API server may refuse one replica and
// not another).
func (v Views) Watchdog(ctx context.Context, cfg *rest.Config, after time.Duration) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(v))
	for _, m := range v {
		var excused func() bool
		if len(v) > 1 {
			excused = func() bool { return m.staleAnswered(http.StatusUnauthorized, http.StatusForbidden) && v.freshBut(m) }
		}
		go func() { errs <- m.watchdog(ctx, cfg, after, excused) }()
	}
	var first error
	for range v {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

// freshBut reports whether a view other than m is fresh.
func (v Views) freshBut(m *Monitor) bool {
	for _, o := range v {
		if o != m && o.Fresh() {
			return true
		}
	}
	return false
}

// Publish makes v the view that tally_aggregator_pod_watch_stale_seconds
// reads.
func (v Views) Publish() {
	published.Lock()
	defer published.Unlock()
	published.view = v
}
