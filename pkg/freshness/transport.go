package freshness

import (
	"io"
	"net/http"
	"sync"

	"k8s.io/client-go/rest"
)

// Wrap makes cfg's requests for the informer's list and watch observed by
// m: each relist, each failure, each 429 and each watch that ends is a
// doubt, and each byte read is progress. client-go retries silently
// meanwhile, so without it a view that stopped following the API server
// would show nothing.
func (m *Monitor) Wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			query := req.URL.Query()
			if req.URL.Path != m.path || query.Get("labelSelector") != m.opts.LabelSelector {
				return rt.RoundTrip(req)
			}
			watching := query.Get("watch") == "true"
			// A relist: a first page of a LIST, or a watch-list stream (its
			// initial events, then the initial-events-end bookmark).
			if (!watching && query.Get("continue") == "") || (watching && query.Get("sendInitialEvents") == "true") {
				m.relisting()
			}
			// Throttled or refused while the last answer says so, not
			// while a request sent again waits for its answer.
			m.setAnswer(0)
			resp, err := rt.RoundTrip(req)
			failed := err != nil || resp.StatusCode != http.StatusOK
			if req.Context().Err() == nil {
				if err == nil {
					m.setAnswer(resp.StatusCode)
				}
				if m.answered(!failed) {
					// A barrier that failed meanwhile need not wait out
					// its back-off.
					m.poke()
				}
			}
			switch {
			case err != nil && req.Context().Err() == nil:
				m.doubt(err.Error(), true)
			case err != nil:
			case resp.StatusCode != http.StatusOK:
				m.doubt(resp.Status, true)
			default:
				body := &observedBody{ReadCloser: resp.Body, read: m.progressed}
				if watching {
					body.end = func() {
						if req.Context().Err() == nil {
							m.doubt("the watch ended", false)
						}
					}
				}
				resp.Body = body
			}
			return resp, err
		})
	})
}

// answered records whether the informer's last request was answered 200,
// and reports whether it was after one that was not.
func (m *Monitor) answered(ok bool) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	again := ok && m.failing
	m.failing = !ok
	return again
}

// setAnswer records the status of the last answer to the informer's list
// or watch (0 while none).
func (m *Monitor) setAnswer(status int) {
	m.mu.Lock()
	m.answer = status
	m.mu.Unlock()
}

// observedBody calls read for each read that returned bytes, and end (when
// set) once when the stream ends, by error or close.
type observedBody struct {
	io.ReadCloser
	read func()
	end  func()
	once sync.Once
}

func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.read()
	}
	if err != nil {
		b.ended()
	}
	return n, err
}

func (b *observedBody) Close() error {
	b.ended()
	return b.ReadCloser.Close()
}

func (b *observedBody) ended() {
	if b.end != nil {
		b.once.Do(b.end)
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
