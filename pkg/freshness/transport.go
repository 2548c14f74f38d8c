package freshness

import (
	"bytes"
	"io"
	"net/http"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
			watchList := watching && query.Get("sendInitialEvents") == "true"
			if (!watching && query.Get("continue") == "") || watchList {
				m.doubt("a relist", false)
			}
			// Throttled while the last answer says so, not while a request
			// sent again waits for its answer.
			m.setThrottled(false)
			resp, err := rt.RoundTrip(req)
			failed := err != nil || resp.StatusCode != http.StatusOK
			if req.Context().Err() == nil {
				m.setThrottled(err == nil && resp.StatusCode == http.StatusTooManyRequests)
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
				switch {
				case watching:
					body.end = func() {
						if req.Context().Err() == nil {
							m.doubt("the watch ended", false)
						}
					}
				default:
					// A relist's list is the API server's state when it
					// began, however long it took to read: a version
					// read before it was delivered proves nothing of
					// what changed meanwhile. Its end is a doubt too.
					body.complete = func() { m.doubt("a relist's list was read", false) }
				}
				if watchList {
					// So is the end of a watch-list's initial events, the
					// same snapshot streamed.
					body.marker, body.complete = []byte(metav1.InitialEventsAnnotationKey), func() {
						m.doubt("a relist's initial events were read", false)
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

func (m *Monitor) setThrottled(on bool) {
	m.mu.Lock()
	m.throttled = on
	m.mu.Unlock()
}

// observedBody calls read for each read that returned bytes, end (when
// set) once when the stream ends, by error or close, and complete (when
// set) once it has been read: to its end, or, with marker, up to the first
// occurrence of marker.
type observedBody struct {
	io.ReadCloser
	read     func()
	end      func()
	complete func()
	marker   []byte
	// tail holds the last len(marker)-1 bytes read, for a marker split
	// between two reads.
	tail []byte
	once sync.Once
}

func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.read()
		if b.marker != nil && b.complete != nil && b.sawMarker(p[:n]) {
			b.complete()
			b.complete = nil
		}
	}
	if err == io.EOF && b.marker == nil && b.complete != nil {
		b.complete()
		b.complete = nil
	}
	if err != nil {
		b.ended()
	}
	return n, err
}

// sawMarker reports whether marker is in p, or began in the reads before
// it.
func (b *observedBody) sawMarker(p []byte) bool {
	if bytes.Contains(p, b.marker) {
		return true
	}
	k := len(b.marker) - 1
	edge := append(b.tail, p[:min(len(p), k)]...)
	if bytes.Contains(edge, b.marker) {
		return true
	}
	if len(p) < k {
		p = edge
	}
	b.tail = append(b.tail[:0], p[max(0, len(p)-k):]...)
	return false
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
