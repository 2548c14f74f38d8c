// Package apiwait keeps tally's informers from backing off while the API
// server is away, and backs off while it answers with errors. client-go's reflector retries a failed list or watch with
// an exponential back-off that reaches 30 s (and, with jitter, up to a
// minute) after a long outage, and neither its shared informers nor
// controller-runtime's cache let a caller shorten it: the view stays stale
// for that long after the API server is back. Here a list or watch that the
// API server does not answer is held and sent again every Poll until it is
// answered, or its request ends (one answered 404 Not Found, for a while:
// a restarted API server serves custom resources a moment after the rest);
// the reflector sees one slow request instead of a string of failures, so
// its back-off never grows, and the view is fresh again within Poll of the
// API server's return.
package apiwait

import (
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// NewCache is a manager's cache (manager.Options.NewCache) whose lists and
// watches are held (Hold): its views are fresh within Poll of the API
// server's return, however long it was away.
func NewCache(restCfg *rest.Config, opts cache.Options) (cache.Cache, error) {
	restCfg = rest.CopyConfig(restCfg)
	Hold(restCfg, Poll)
	client, err := rest.HTTPClientFor(restCfg)
	if err != nil {
		return nil, err
	}
	opts.HTTPClient = client
	return cache.New(restCfg, opts)
}

// Until returns newCache's caches, made to report synced once stop is
// done, synced or not (their callers check their own context too). Give it
// the context a manager runs in: the manager's start waits until each of
// its caches reports synced, with a context of its own that its end does
// not cancel, and (controller-runtime v0.25) goes on waiting after it
// ended, in a loop that spins a core. A cache that never syncs, its list
// refused (403: a Role missing, a permission revoked), kept the manager
// from ever stopping.
func Until(stop context.Context, newCache cache.NewCacheFunc) cache.NewCacheFunc {
	return func(restCfg *rest.Config, opts cache.Options) (cache.Cache, error) {
		c, err := newCache(restCfg, opts)
		if err != nil {
			return nil, err
		}
		return stoppable{Cache: c, stop: stop}, nil
	}
}

// stoppable is a cache whose WaitForCacheSync returns true once stop is
// done.
type stoppable struct {
	cache.Cache
	stop context.Context
}

func (c stoppable) WaitForCacheSync(ctx context.Context) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(c.stop, cancel)()
	return c.Cache.WaitForCacheSync(ctx) || c.stop.Err() != nil
}

// Poll is how often a held list or watch is sent again.
const Poll = 500 * time.Millisecond

// Hold makes cfg's list and watch requests (GETs) wait for the API server:
// one refused or cut (a transport error) is sent again every poll (an API
// server that is away costs nothing to ask); one answered 429 after its
// Retry-After when it says to wait longer (back-pressure, up to
// MaxRetryAfter); one answered with a 5xx (an API server that answers but
// fails, perhaps overloaded) after a wait that doubles from poll up to
// MaxServerErrorWait with each 5xx in a row, with jitter; one answered 404
// Not Found every poll for 10 s, then after a wait that doubles up to 5 s,
// until it has met NotFoundHold of 404s in a row. Every other request fails
// as usual. Each request sent again is counted in
// tally_api_requests_held_total. Give it only to clients whose every GET
// may wait (a cache's): a write, or a leader election's renewal, must fail
// fast.
func Hold(cfg *rest.Config, poll time.Duration) { hold(cfg, poll, NotFoundHold) }

// A list or watch answered 404 is sent again every poll for
// notFoundPollFor, then after a wait that doubles up to maxNotFoundPoll.
const (
	notFoundPollFor = 10 * time.Second
	maxNotFoundPoll = 5 * time.Second
)

// NotFoundHold bounds how long a held list or watch answered 404 Not Found
// in a row is sent again. An API server that has just started accepts
// connections before it has read the CRDs, and answers 404 for every custom
// resource until then: a reflector that took that answer would back off for
// seconds after the API server serves the resource again. A resource that
// is really not served gets its 404 after NotFoundHold.
const NotFoundHold = 30 * time.Second

func hold(cfg *rest.Config, poll, notFoundHold time.Duration) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			if req.Method != http.MethodGet || req.Body != nil && req.Body != http.NoBody {
				return rt.RoundTrip(req)
			}
			// notFoundSince is when the 404s in a row began; notFoundWait
			// how long to wait after the next one.
			var notFoundSince time.Time
			notFoundWait := poll
			// serverErrors counts the 5xx answers in a row.
			var serverErrors int
			for {
				resp, err := rt.RoundTrip(req)
				if req.Context().Err() != nil {
					return resp, err
				}
				notFound := err == nil && resp.StatusCode == http.StatusNotFound
				switch {
				case notFound && notFoundSince.IsZero():
					notFoundSince = time.Now()
				case notFound && time.Since(notFoundSince) >= notFoundHold:
					return resp, err
				case notFound:
				case answered(resp, err):
					return resp, err
				default:
					notFoundSince, notFoundWait = time.Time{}, poll
				}
				wait := poll
				switch {
				case notFound && time.Since(notFoundSince) >= notFoundPollFor:
					// A resource really not served is asked for less and
					// less often.
					wait, notFoundWait = notFoundWait, min(2*notFoundWait, maxNotFoundPoll)
				case err == nil && resp.StatusCode >= 500:
					serverErrors++
					wait = serverErrorWait(poll, serverErrors)
				case resp != nil:
					wait = retryAfter(resp, poll)
				}
				if !notFound && (err != nil || resp.StatusCode < 500) {
					serverErrors = 0
				}
				held.WithLabelValues(heldAnswer(resp, err)).Inc()
				if resp != nil {
					_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
					resp.Body.Close()
				}
				select {
				case <-req.Context().Done():
					return nil, req.Context().Err()
				case <-time.After(wait):
				}
				req = req.Clone(req.Context())
			}
		})
	})
}

// MaxRetryAfter bounds how long a held request honours the API server's
// Retry-After: a view kept stale longer than that by a misconfigured
// server would be worse than the load of one more request.
const MaxRetryAfter = 10 * time.Second

// retryAfter is how long to wait before sending a request the API server
// refused again: a 429's Retry-After (in seconds, as API Priority and
// Fairness sends it), within poll and MaxRetryAfter; poll otherwise. A
// 5xx's is not honoured: an API server that is starting answers "not
// initialized yet" with 503 and Retry-After: 5, and is usually ready well
// before that.
func retryAfter(resp *http.Response, poll time.Duration) time.Duration {
	if resp.StatusCode != http.StatusTooManyRequests {
		return poll
	}
	secs, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || secs <= 0 {
		return poll
	}
	return min(max(time.Duration(secs)*time.Second, poll), MaxRetryAfter)
}

// MaxServerErrorWait bounds the wait before a request answered with a 5xx
// is sent again.
const MaxServerErrorWait = 4 * time.Second

// serverErrorWait is the wait after the n-th 5xx in a row: poll doubled
// n-1 times, up to MaxServerErrorWait, of which a random half to all, so
// that the replicas of an overloaded API server's clients do not come back
// in step.
func serverErrorWait(poll time.Duration, n int) time.Duration {
	wait := poll
	for i := 1; i < n && wait < MaxServerErrorWait; i++ {
		wait *= 2
	}
	wait = min(wait, MaxServerErrorWait)
	return wait/2 + rand.N(wait/2+1)
}

// heldAnswer names the answer that made a request held, for held.
func heldAnswer(resp *http.Response, err error) string {
	switch {
	case err != nil:
		return "unreachable"
	case resp.StatusCode == http.StatusTooManyRequests:
		return "throttled"
	case resp.StatusCode == http.StatusNotFound:
		return "not_found"
	}
	return "server_error"
}

// held counts the lists and watches sent again, by the answer that made
// them wait.
var held = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "tally_api_requests_held_total",
	Help: "Lists and watches of tally's caches sent again because the API server did not answer them, by answer: unreachable (a transport error; sent again every 0.5 s), throttled (429; after its Retry-After), server_error (a 5xx; after a wait doubling from 0.5 s to 4 s with each one in a row, with jitter), not_found (404, while a restarted API server has not read its CRDs yet).",
}, []string{"answer"})

func init() { metrics.Registry.MustRegister(held) }

// answered reports whether the API server answered a request: no transport
// error, and neither 429 nor a 5xx.
func answered(resp *http.Response, err error) bool {
	return err == nil && resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode < 500
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
