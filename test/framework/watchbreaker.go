package framework

import (
	"cmp"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/rest"
)

// WatchBreaker fails the pod list and watch requests (those of Path, when
// set: another resource's) of the transports it wraps while broken, and
// ends the watches open when it breaks: the pod watch broken while the API
// server answers everything else. With expire, until a relist is
// answered, a watch resumed from a resourceVersion is answered 410 Gone
// (the version is too old, as after a long enough cut), so the reflector
// relists; with
// delay, a relist (a LIST, or a watch-list stream) is answered at once but
// its body comes delay later; with resumeDelay, a watch resumed from a
// resourceVersion is answered at once, its replay resumeDelay later; with
// trickle, relists come slowly (TrickleRelists).
type WatchBreaker struct {
	// Path is the resource's path; the pods' when empty.
	Path        string
	mu          sync.Mutex
	broken      bool
	expire      bool
	delay       time.Duration
	resumeDelay time.Duration
	trickle     bool
	watches     []*endableBody
	// throttled answers the pod list and watch 429 with Retry-After, as API
	// Priority and Fairness does; answered records when one was answered
	// 200 after that.
	throttled bool
	answered  time.Time
}

// Wrap makes cfg's requests go through b.
func (b *WatchBreaker) Wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			if path := cmp.Or(b.Path, "/api/v1/pods"); req.URL.Path != path {
				return rt.RoundTrip(req)
			}
			b.mu.Lock()
			broken, expire, delay, resumeDelay, throttled := b.broken, b.expire, b.delay, b.resumeDelay, b.throttled
			b.mu.Unlock()
			q := req.URL.Query()
			watching := q.Get("watch") == "true"
			// A LIST of at most one pod (a consistent read of the current
			// resourceVersion) is no relist.
			relist := (!watching && q.Get("limit") != "1") || q.Get("sendInitialEvents") == "true"
			switch {
			case broken:
				return nil, errors.New("pod watch broken by the test")
			case throttled:
				return tooMany(req), nil
			case expire && watching && !relist && q.Get("resourceVersion") != "":
				return expired(req), nil
			}
			resp, err := rt.RoundTrip(req)
			if err != nil {
				return resp, err
			}
			b.mu.Lock()
			if b.answered.IsZero() && resp.StatusCode == http.StatusOK {
				b.answered = time.Now()
			}
			if relist && resp.StatusCode == http.StatusOK {
				// The versions it brings are new: resumed watches expire
				// no more.
				b.expire = false
			}
			b.mu.Unlock()
			if relist {
				resp.Body = &trickleBody{ReadCloser: resp.Body, b: b}
			}
			switch {
			case relist && delay > 0:
				resp.Body = newDelayedBody(resp.Body, delay)
			case watching && !relist && resumeDelay > 0:
				resp.Body = newDelayedBody(resp.Body, resumeDelay)
			}
			if watching {
				body := &endableBody{ReadCloser: resp.Body}
				resp.Body = body
				b.mu.Lock()
				b.watches = append(b.watches, body)
				b.mu.Unlock()
			}
			return resp, err
		})
	})
}

// Set breaks the watch, or repairs it.
func (b *WatchBreaker) Set(broken bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.broken = broken
	if broken {
		b.endWatches()
	}
}

// Throttle starts or ends the throttling of the pod list and watch; the
// watches open are ended when it starts.
func (b *WatchBreaker) Throttle(on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.throttled = on
	if on {
		b.endWatches()
	} else {
		b.answered = time.Time{}
	}
}

// FirstAnswer returns when a pod list or watch was first answered 200 since
// the throttling ended; zero before.
func (b *WatchBreaker) FirstAnswer() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.answered
}

// SlowRelists makes the next relists come delay after their headers, and
// resumed watches expire until a relist is answered; a delay of 0 ends
// both.
func (b *WatchBreaker) SlowRelists(delay time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire, b.delay = delay > 0, delay
}

// SlowResumes makes the next watches resumed from a resourceVersion come
// delay after their headers (a loaded API server, a large replay, a
// starved client); a delay of 0 ends it.
func (b *WatchBreaker) SlowResumes(delay time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.resumeDelay = delay
}

// TrickleRelists starts or ends relists that make progress slowly: while
// on, resumed watches expire until a relist is answered, and every read of
// a relist's body waits trickleEvery and gets at most trickleBytes, as a
// relist of a very large list on a loaded API server or a starved client
// does. Once it ends, the rest of the body comes at once.
func (b *WatchBreaker) TrickleRelists(on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire, b.trickle = on, on
}

// trickling reports whether relists trickle.
func (b *WatchBreaker) trickling() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.trickle
}

const (
	trickleEvery = 500 * time.Millisecond
	trickleBytes = 16
)

// trickleBody is a relist's body, read slowly while its breaker trickles.
type trickleBody struct {
	io.ReadCloser
	b *WatchBreaker
}

func (t *trickleBody) Read(p []byte) (int, error) {
	if t.b.trickling() {
		time.Sleep(trickleEvery)
		p = p[:min(len(p), trickleBytes)]
	}
	return t.ReadCloser.Read(p)
}

// EndWatches ends the watches open as the API server ends a watch: the
// stream ends cleanly, and the client resumes each from its last
// resourceVersion.
func (b *WatchBreaker) EndWatches() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, w := range b.watches {
		w.end(true)
	}
	b.watches = nil
}

// expired is the API server's answer to a watch from a resourceVersion it no
// longer has.
func expired(req *http.Request) *http.Response {
	body := `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version (expired by the test)","reason":"Expired","code":410}`
	return &http.Response{
		StatusCode: http.StatusGone, Status: "410 Gone", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:  http.Header{"Content-Type": []string{"application/json"}},
		Body:    io.NopCloser(strings.NewReader(body)),
		Request: req, ContentLength: int64(len(body)),
	}
}

// tooMany is API Priority and Fairness' answer to a request it rejects.
func tooMany(req *http.Request) *http.Response {
	body := `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too many requests (throttled by the test)","reason":"TooManyRequests","details":{"retryAfterSeconds":1},"code":429}`
	return &http.Response{
		StatusCode: http.StatusTooManyRequests, Status: "429 Too Many Requests", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:  http.Header{"Content-Type": []string{"application/json"}, "Retry-After": []string{"1"}},
		Body:    io.NopCloser(strings.NewReader(body)),
		Request: req, ContentLength: int64(len(body)),
	}
}

// delayedBody holds its first read until until, or until it is closed.
type delayedBody struct {
	io.ReadCloser
	until  time.Time
	once   sync.Once
	closed chan struct{}
}

func newDelayedBody(body io.ReadCloser, delay time.Duration) *delayedBody {
	return &delayedBody{ReadCloser: body, until: time.Now().Add(delay), closed: make(chan struct{})}
}

func (d *delayedBody) Read(p []byte) (int, error) {
	select {
	case <-time.After(time.Until(d.until)):
	case <-d.closed:
	}
	return d.ReadCloser.Read(p)
}

func (d *delayedBody) Close() error {
	d.once.Do(func() { close(d.closed) })
	return d.ReadCloser.Close()
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// endWatches ends the watches open, as a broken connection does. Called
// with b.mu held.
func (b *WatchBreaker) endWatches() {
	for _, w := range b.watches {
		w.end(false)
	}
	b.watches = nil
}

// endableBody is a watch's body that the breaker can end: cleanly (the
// client reads the end of the stream) or not (the connection breaks).
type endableBody struct {
	io.ReadCloser
	mu    sync.Mutex
	clean bool
}

func (e *endableBody) end(clean bool) {
	e.mu.Lock()
	e.clean = clean
	e.mu.Unlock()
	e.Close()
}

func (e *endableBody) Read(p []byte) (int, error) {
	n, err := e.ReadCloser.Read(p)
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil && e.clean {
		return n, io.EOF
	}
	return n, err
}
