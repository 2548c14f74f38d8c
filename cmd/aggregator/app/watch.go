package app

import (
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/pkg/aggregate"
)

// podWatchPath and podSelector are the path and label selector of the
// aggregator's pod informer (one, all namespaces).
const podWatchPath = "/api/v1/pods"

var podSelector = aggregate.PodSelector().String()

// watchSettle is how long a resumed pod watch must stay open before it
// counts as settled (watchStream): a watch the API server answers with "too
// old resource version" is a 200 response that ends at once.
const watchSettle = time.Second

// watchMonitor tells how long the pod view has been stale: from the moment
// a pod watch ends or cannot be opened (an API server restart, a network
// cut) until what the API server sent since has been delivered to the
// cache the reconcilers read. client-go retries silently meanwhile (and
// backs off for up to half a minute after a long outage), so without it the
// counts are stale with nothing to show for it. It observes the
// aggregator's own requests through its transport, and the pod informer
// through client-go's own signals (delivered).
type watchMonitor struct {
	log logr.Logger
	mu  sync.Mutex
	// brokenSince is when the pod watch stopped delivering; zero while it
	// is healthy.
	brokenSince time.Time
	// stream counts the watch streams opened, so that a settle timer knows
	// whether its stream is still the current one.
	stream int
	// throttled is set while the last answer to the pod list or watch was
	// 429 Too Many Requests: the API server's back-pressure (API Priority
	// and Fairness), which every replica meets alike.
	throttled bool
	// informer is the running manager's pod informer (attach).
	informer podInformer
	// relisting is set once a relist (a LIST, or a watch-list: a watch with
	// sendInitialEvents) was sent since the watch broke, with what the
	// reflector had synced (relistFrom) and when (relistAt) the last one was
	// sent, and when the first was (relistSince: relists retried one after
	// another are one relist under way).
	relisting   bool
	relistFrom  string
	relistAt    time.Time
	relistSince time.Time
	// settled is set once a watch resumed from the reflector's last
	// resourceVersion stayed open for watchSettle since the watch broke.
	settled bool
	// between is set from when a pod watch ends (endedStream) until a
	// newer one is open and what came before it (a relist) is delivered:
	// nothing is written meanwhile. The API server ends every watch after
	// a few minutes and client-go opens the next at once, so only a watch
	// that stays closed is counted as broken (brokenAt).
	between     bool
	betweenAt   time.Time
	endedStream int
	// epoch counts the times the view stopped being fresh (a break, a
	// watch ended, the process paused): a count taken in one epoch is not
	// written in another.
	epoch uint64
	// current is the last pod watch stream opened, which a pause ends.
	current io.Closer
	// lastTick is when watchClock last saw the process run, as a
	// monotonic offset from started; 0 before it runs.
	lastTick atomic.Int64
	started  time.Time
}

// podInformer is what the monitor reads of the pod informer: the
// resourceVersion its reflector last synced (set once a relist's result, or
// a watch event, is in the informer's queue) and its indexer's (set once
// that is delivered to the cache the reconcilers read; client-go's
// AtomicFIFO, on by default since 1.36, delivers a relist as one replace).
type podInformer interface {
	LastSyncResourceVersion() string
	GetIndexer() toolscache.Indexer
}

func newWatchMonitor(log logr.Logger) *watchMonitor {
	// A moment before now: a first tick is never at offset 0.
	return &watchMonitor{log: log, started: time.Now().Add(-time.Nanosecond)}
}

// wrap makes cfg's requests observed by m.
func (m *watchMonitor) wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			if req.URL.Path != podWatchPath || req.URL.Query().Get("labelSelector") != podSelector {
				return rt.RoundTrip(req)
			}
			query := req.URL.Query()
			watching := query.Get("watch") == "true"
			// A relist: a first page of a LIST, or a watch-list stream (its
			// initial events, then the initial-events-end bookmark).
			relist := (!watching && query.Get("continue") == "") || (watching && query.Get("sendInitialEvents") == "true")
			if relist {
				m.relist()
			}
			resp, err := rt.RoundTrip(req)
			switch {
			case err != nil && req.Context().Err() == nil:
				m.broken(err.Error())
			case err != nil:
			case resp.StatusCode == http.StatusTooManyRequests:
				m.throttle(resp.Status)
			case resp.StatusCode != http.StatusOK:
				m.broken(resp.Status)
			case watching:
				resp.Body = m.watchStream(req, resp.Body, !relist)
			}
			return resp, err
		})
	})
}

// attach makes the monitor read inf, the pod informer of the manager about
// to start. Its first list is a relist: the view is not fresh again before
// it is delivered.
func (m *watchMonitor) attach(inf podInformer) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.informer = inf
	m.relisting, m.relistFrom = false, ""
}

// relist records that a relist was sent, with what the reflector had synced
// then: the view is fresh once the reflector synced something else and the
// indexer holds it too.
func (m *watchMonitor) relist() {
	m.mu.Lock()
	inf := m.informer
	m.mu.Unlock()
	from := ""
	if inf != nil {
		from = inf.LastSyncResourceVersion()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	if !m.relisting {
		m.relistSince = now
	}
	m.relisting, m.relistFrom, m.relistAt = true, from, now
}

// watchStream follows a pod watch: a watch resumed from the reflector's
// last resourceVersion (resumed) counts as settled once it stayed open for
// watchSettle (the API server replays every event after that version
// before anything newer, or answers 410 Gone and the reflector relists); a
// watch-list stream never settles by time, it is a relist (delivered). The
// watch counts as broken when it ends (while its request was not
// cancelled) and no new watch is opened soon after: the API server ends
// every watch after a few minutes, and client-go opens the next one at
// once.
func (m *watchMonitor) watchStream(req *http.Request, body io.ReadCloser, resumed bool) io.ReadCloser {
	m.mu.Lock()
	m.stream++
	stream := m.stream
	m.mu.Unlock()
	ended := make(chan struct{})
	var once sync.Once
	end := func() {
		once.Do(func() {
			close(ended)
			if req.Context().Err() != nil {
				return
			}
			endedAt := time.Now()
			m.mu.Lock()
			if stream == m.stream {
				if !m.between {
					m.epoch++
					m.betweenAt = endedAt
				}
				m.between, m.endedStream = true, stream
			}
			m.mu.Unlock()
			time.AfterFunc(2*watchSettle, func() {
				m.mu.Lock()
				reopened := stream != m.stream
				m.mu.Unlock()
				if !reopened {
					m.brokenAt(endedAt, "the pod watch ended and was not reopened")
				}
			})
		})
	}
	if resumed {
		go func() {
			select {
			case <-ended:
			case <-time.After(watchSettle):
				m.mu.Lock()
				if stream == m.stream {
					m.settled = true
				}
				m.mu.Unlock()
			}
		}()
	}
	observed := &observedBody{ReadCloser: body, end: end}
	m.mu.Lock()
	if stream == m.stream {
		m.current = observed
	}
	m.mu.Unlock()
	return observed
}

func (m *watchMonitor) broken(reason string) { m.brokenAt(time.Now(), reason) }

// throttle marks the view stale because the API server throttles the pod
// list or watch: back-pressure, not an outage (isThrottled).
func (m *watchMonitor) throttle(reason string) {
	m.brokenAt(time.Now(), reason)
	m.mu.Lock()
	m.throttled = true
	m.mu.Unlock()
}

func (m *watchMonitor) brokenAt(t time.Time, reason string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	// What recovered before this break, or was sent before it, does not
	// count. A relist sent after it does: a watch that ended at t is found
	// broken 2 s later, when the relist that followed it (a LIST, or a
	// watch-list whose headers are slow) may still be under way, and
	// forgetting it would leave a watch-list stream never delivered.
	m.throttled, m.settled = false, false
	m.relisting = m.relisting && m.relistAt.After(t)
	if !m.brokenSince.IsZero() {
		return
	}
	m.epoch++
	m.brokenSince = t
	m.log.Info("Pod watch interrupted: counts may be stale until it recovers", "reason", reason)
}

// relistFor returns how long a relist sent since the view broke has been
// under way (not yet delivered), from the first of the relists retried one
// after another; 0 when none is.
func (m *watchMonitor) relistFor() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.relisting || m.brokenSince.IsZero() {
		return 0
	}
	return time.Since(m.relistSince)
}

// betweenFor returns how long the view has been between two watches (the
// next one open, what came before it not yet delivered); 0 when it is not.
func (m *watchMonitor) betweenFor() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.between {
		return 0
	}
	return time.Since(m.betweenAt)
}

// isThrottled reports whether the view is stale because the API server
// throttles the pod list or watch (its last answer was 429).
func (m *watchMonitor) isThrottled() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.throttled && !m.brokenSince.IsZero()
}

// fresh reports whether the pod view is not known to be stale: the pod
// watch has not been seen broken since it last delivered, and no watch
// ended without what came after it being delivered.
func (m *watchMonitor) fresh() bool {
	if m.paused() {
		return false
	}
	stale, between := m.check()
	return stale == 0 && !between
}

// viewEpoch returns the number of times the pod view stopped being fresh:
// counts taken while it returns one value were taken from one unbroken
// view.
func (m *watchMonitor) viewEpoch() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epoch
}

// stale returns how long the pod view has been stale: since the pod watch
// broke, until what was listed or watched since has been delivered.
func (m *watchMonitor) stale() time.Duration {
	stale, _ := m.check()
	return stale
}

// check brings the monitor up to date with what the pod informer has
// delivered, and returns how long the view has been stale and whether it is
// between two watches.
func (m *watchMonitor) check() (time.Duration, bool) {
	m.mu.Lock()
	inf := m.informer
	m.mu.Unlock()
	var synced, stored string
	if inf != nil {
		// Read apart from m.mu: the informer takes its own locks.
		synced, stored = inf.LastSyncResourceVersion(), inf.GetIndexer().LastStoreSyncResourceVersion()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	known := inf != nil && inf == m.informer
	if m.between && known && m.stream > m.endedStream && caughtUp(synced, stored) && (!m.relisting || synced != m.relistFrom) {
		// The next watch is open, and what came before it (a relist) is
		// delivered.
		m.between = false
	}
	if m.brokenSince.IsZero() {
		return 0, m.between
	}
	if known && m.delivered(synced, stored) {
		m.log.Info("Pod watch delivering again", "staleFor", time.Since(m.brokenSince).Round(time.Millisecond).String())
		m.brokenSince, m.throttled, m.settled, m.relisting = time.Time{}, false, false, false
		return 0, m.between
	}
	return time.Since(m.brokenSince), m.between
}

// delivered reports, from what the reflector synced and what its indexer
// holds, whether the view is fresh again since the watch broke: the
// indexer holds every event the reflector synced, and either a relist sent
// since then was synced (the reflector's resourceVersion moved on from what
// it was when the relist was sent: a LIST's or the initial-events-end
// bookmark's), or a resumed watch settled.
func (m *watchMonitor) delivered(synced, stored string) bool {
	if !caughtUp(synced, stored) {
		return false
	}
	if m.relisting {
		return synced != m.relistFrom
	}
	return m.settled
}

// caughtUp reports whether the indexer holds everything the reflector
// synced. An indexer that tells nothing (client-go's AtomicFIFO turned
// off) leaves the reflector's word alone.
func caughtUp(synced, stored string) bool {
	return synced != "" && (stored == "" || atLeast(stored, synced))
}

// atLeast reports whether resourceVersion a is b or newer. Resource
// versions are opaque to clients but, from one API server and one
// resource, ordered integers (client-go's store metrics read them so);
// anything else compares by equality.
func atLeast(a, b string) bool {
	x, errA := strconv.ParseUint(a, 10, 64)
	y, errB := strconv.ParseUint(b, 10, 64)
	if errA != nil || errB != nil {
		return a == b
	}
	return x >= y
}

// observedBody calls end when the stream ends, by error or close.
type observedBody struct {
	io.ReadCloser
	end func()
}

func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.end()
	}
	return n, err
}

func (b *observedBody) Close() error {
	b.end()
	return b.ReadCloser.Close()
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// podWatchStale is the gauge of the running aggregator's watch monitor.
var podWatchStale = struct {
	sync.Mutex
	monitor *watchMonitor
}{}

func init() {
	metrics.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_aggregator_pod_watch_stale_seconds",
		Help: "How long the pod view has been stale: from when the pod watch ended or could not be opened until what was listed or watched since is in the cache; 0 while fresh. No status is written meanwhile.",
	}, func() float64 {
		podWatchStale.Lock()
		defer podWatchStale.Unlock()
		if podWatchStale.monitor == nil {
			return 0
		}
		return podWatchStale.monitor.stale().Seconds()
	}))
}
