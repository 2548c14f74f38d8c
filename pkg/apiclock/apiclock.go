// Package apiclock tells the time by the API server's clock: the Date
// header of its last answer, plus the time elapsed since on the local
// monotonic clock. Times the API server stamps (a deletionTimestamp, a
// finish the pod reports) are compared with it, never with the local wall
// clock, which may be skewed or stepped (NTP) against the API server's.
package apiclock

import (
	"net/http"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/rest"
)

// Clock is the API server's clock, as its answers show it.
type Clock struct {
	mu sync.Mutex
	// date is the last answer's Date, and at when it was received (with
	// its monotonic reading).
	date, at time.Time
}

// Wrap makes the answers to cfg's requests for the core API group set the
// clock: those the API server answers itself (another group may be served
// by an aggregated API server, on another machine's clock).
func (c *Clock) Wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			if err == nil && strings.HasPrefix(req.URL.Path, "/api/") {
				c.observe(resp.Header.Get("Date"), time.Now())
			}
			return resp, err
		})
	})
}

// observe records an answer's Date header, received at.
func (c *Clock) observe(header string, at time.Time) {
	date, err := http.ParseTime(header)
	if err != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.date, c.at = date, at
}

// Now returns the API server's time: its last answer's Date plus the time
// elapsed since on the monotonic clock. The Date header counts whole
// seconds, so Now may be up to a second (and the answer's latency) behind.
// Before any answer it is the local time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() {
		return time.Now()
	}
	return c.date.Add(time.Since(c.at))
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
