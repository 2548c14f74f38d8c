package app

import (
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"tally.dev/tally/pkg/aggregate"
)

// podWatchPath and podSelector are the path and label selector of the
// aggregator's pod informer (one, all namespaces).
const podWatchPath = "/api/v1/pods"

var podSelector = aggregate.PodSelector().String()

// watchSettle is how long a pod watch must stay open before it counts as
// healthy: a watch the API server answers with "too old resource version"
// is a 200 response that ends at once.
const watchSettle = time.Second

// watchMonitor tells how long the pod watch has not been delivering: from
// the moment a pod watch ends or cannot be opened (an API server restart,
// a network cut) until a list succeeds or a new watch stays open. client-go
// retries silently meanwhile (and backs off for up to half a minute after a
// long outage), so without it the counts are stale with nothing to show
// for it. It observes the aggregator's own requests through its transport.
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
}

func newWatchMonitor(log logr.Logger) *watchMonitor {
	return &watchMonitor{log: log}
}

// wrap makes cfg's requests observed by m.
func (m *watchMonitor) wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			if req.URL.Path != podWatchPath || req.URL.Query().Get("labelSelector") != podSelector {
				return rt.RoundTrip(req)
			}
			watching := req.URL.Query().Get("watch") == "true"
			resp, err := rt.RoundTrip(req)
			switch {
			case err != nil && req.Context().Err() == nil:
				m.broken(err.Error())
			case err != nil:
			case resp.StatusCode == http.StatusTooManyRequests:
				m.throttle(resp.Status)
			case resp.StatusCode != http.StatusOK:
				m.broken(resp.Status)
			case !watching:
				m.healthy()
			default:
				resp.Body = m.watchStream(req, resp.Body)
			}
			return resp, err
		})
	})
}

// watchStream marks the watch healthy once it stayed open for watchSettle,
// and broken when it ends (while its request was not cancelled) and no new
// watch is opened soon after: the API server ends every watch after a few
// minutes, and client-go opens the next one at once.
func (m *watchMonitor) watchStream(req *http.Request, body io.ReadCloser) io.ReadCloser {
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
	go func() {
		select {
		case <-ended:
		case <-time.After(watchSettle):
			m.mu.Lock()
			current := stream == m.stream
			m.mu.Unlock()
			if current {
				m.healthy()
			}
		}
	}()
	return &observedBody{ReadCloser: body, end: end}
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
	m.throttled = false
	if !m.brokenSince.IsZero() {
		return
	}
	m.brokenSince = t
	m.log.Info("Pod watch interrupted: counts may be stale until it recovers", "reason", reason)
}

// isThrottled reports whether the view is stale because the API server
// throttles the pod list or watch (its last answer was 429).
func (m *watchMonitor) isThrottled() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.throttled && !m.brokenSince.IsZero()
}

func (m *watchMonitor) healthy() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.throttled = false
	if m.brokenSince.IsZero() {
		return
	}
	m.log.Info("Pod watch delivering again", "staleFor", time.Since(m.brokenSince).Round(time.Millisecond).String())
	m.brokenSince = time.Time{}
}

// fresh reports whether the pod view is not known to be stale: the pod
// watch delivers, or has not been seen broken since it last did.
func (m *watchMonitor) fresh() bool { return m.stale() == 0 }

// stale returns how long the pod watch has not been delivering.
func (m *watchMonitor) stale() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.brokenSince.IsZero() {
		return 0
	}
	return time.Since(m.brokenSince)
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
		Help: "How long the pod watch has not been delivering (it ended or cannot be opened, and no list or new watch succeeded since); 0 while it is healthy. Counts written meanwhile may be stale.",
	}, func() float64 {
		podWatchStale.Lock()
		defer podWatchStale.Unlock()
		if podWatchStale.monitor == nil {
			return 0
		}
		return podWatchStale.monitor.stale().Seconds()
	}))
}
