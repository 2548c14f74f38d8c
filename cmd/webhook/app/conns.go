package app

import (
	"crypto/tls"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

var connectionsShed = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "tally_webhook_connections_shed_total",
	Help: "Connections the webhook closed at its connection limit to make room for a new one, by what they were: new (never answered a request; in its TLS handshake or first headers) or idle (kept alive after an answer, nothing of a next request arrived).",
}, []string{"state"})

func init() {
	metrics.Registry.MustRegister(connectionsShed)
	for _, state := range []string{"new", "idle"} {
		connectionsShed.WithLabelValues(state)
	}
}

// shedAfter is how long a connection may go with nothing in progress
// before it may be closed to make room for a new one: far longer than the
// API server takes to finish a TLS handshake and send its headers.
const shedAfter = 2 * time.Second

// connections bounds the server's open connections so that clients holding
// connections open, and reopening them as fast as they are closed, cannot
// keep the API server out. A limit that only stops accepting
// (netutil.LimitListener) leaves a new connection queued until one of
// theirs times out (seconds each, for every connection ahead of it). Here,
// at the limit, one connection is closed to make room, once it has gone
// shedAfter with nothing in progress:
//
//   - first a new one, that has never been answered (in its TLS handshake
//     or its first request's headers) and has received nothing for
//     shedAfter, the longest silent first: a flood's connections are new
//     and silent, and the API server sends its first headers within
//     milliseconds of connecting;
//   - only when none is open, an idle one, kept alive after an answer,
//     on which nothing of a next request has arrived: the API server's
//     connections are long-lived and kept alive, and it does not retry a
//     review whose connection is closed under it.
//
// A connection on which a request's headers were read is never closed
// (Go's StateActive: being served), nor a kept-alive one on which a byte of
// its next request arrived (connections sees every byte read, below TLS).
// Such a connection must send the rest of its headers within headerTimeout
// of that first byte (the server gives shedAfter, within its read-header
// timeout): Go's server waits for the first bytes of a next request under
// its IdleTimeout, and starts ReadHeaderTimeout only once they are there,
// so one byte would hold the connection for IdleTimeout; connections puts
// a read deadline of headerTimeout on it when that byte arrives (the server
// sets its own once it reads the headers). So the
// requests in flight never outnumber the connections the limit admits; the
// silent connections ahead of a newcomer leave at max per shedAfter, and
// those that trickle bytes within the server's header and body timeouts;
// and the API server's kept-alive connections are closed only when no new
// connection can be.
type connections struct {
	net.Listener
	max int
	// headerTimeout bounds how long a kept-alive connection may take from
	// the first byte of its next request to the end of its headers.
	headerTimeout time.Duration
	now           func() time.Time

	mu    sync.Mutex
	conns map[*trackedConn]*connState
	// freed is signalled when a connection closes.
	freed  chan struct{}
	closed chan struct{}
	once   sync.Once
}

// connState is what the limit knows of one open connection.
type connState struct {
	// since is when the connection was last answered or, before its first
	// answer, when it was opened or last received a byte.
	since time.Time
	// answered reports that a request of the connection was answered: the
	// connection is kept alive.
	answered bool
	// serving reports that a request's headers were read and its answer is
	// not written yet.
	serving bool
	// arriving reports that a byte arrived since the connection was last
	// answered: its next request is on its way.
	arriving bool
}

// sheddable reports whether the connection may be closed once stale.
func (s *connState) sheddable() bool { return !s.serving && !s.arriving }

func limitConnections(ln net.Listener, max int, headerTimeout time.Duration) *connections {
	return &connections{Listener: ln, max: max, headerTimeout: headerTimeout, now: time.Now, conns: make(map[*trackedConn]*connState),
		freed: make(chan struct{}, 1), closed: make(chan struct{})}
}

// trackedConn tells the limit when bytes arrive, and holds a kept-alive
// connection's next request to its header deadline.
type trackedConn struct {
	net.Conn
	limit *connections

	mu sync.Mutex
	// headersBy, when set, is when a next request's headers must be in:
	// no read deadline the server sets goes past it (once it has four
	// bytes, Go's server sets its own, of its ReadHeaderTimeout from then).
	headersBy time.Time
}

func (t *trackedConn) Read(p []byte) (int, error) {
	n, err := t.Conn.Read(p)
	if n > 0 && t.limit.arrived(t) {
		// The first byte of a next request: the rest of its headers
		// within headerTimeout (real time: the deadline is the kernel's).
		t.mu.Lock()
		t.headersBy = time.Now().Add(t.limit.headerTimeout)
		_ = t.Conn.SetReadDeadline(t.headersBy)
		t.mu.Unlock()
	}
	return n, err
}

// SetReadDeadline sets the read deadline, no later than a next request's
// header deadline.
func (t *trackedConn) SetReadDeadline(d time.Time) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.Conn.SetReadDeadline(t.capped(d))
}

// SetDeadline sets both deadlines, the read one no later than a next
// request's header deadline.
func (t *trackedConn) SetDeadline(d time.Time) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.Conn.SetWriteDeadline(d); err != nil {
		return err
	}
	return t.Conn.SetReadDeadline(t.capped(d))
}

// capped returns d, or the header deadline when one is set and d is later
// (or none). t.mu is held.
func (t *trackedConn) capped(d time.Time) time.Time {
	if !t.headersBy.IsZero() && (d.IsZero() || d.After(t.headersBy)) {
		return t.headersBy
	}
	return d
}

// headersRead lifts the header deadline: the request's headers are in.
func (t *trackedConn) headersRead() {
	t.mu.Lock()
	t.headersBy = time.Time{}
	t.mu.Unlock()
}

// Accept accepts the next connection and, at the limit, sheds one (see
// connections), waiting until one may be shed or has closed.
func (c *connections) Accept() (net.Conn, error) {
	raw, err := c.Listener.Accept()
	if err != nil {
		return nil, err
	}
	conn := &trackedConn{Conn: raw, limit: c}
	for {
		c.mu.Lock()
		if len(c.conns) < c.max {
			c.conns[conn] = &connState{since: c.now()}
			c.mu.Unlock()
			return conn, nil
		}
		victim, state, wait := c.victim()
		if victim != nil && wait <= 0 {
			delete(c.conns, victim)
			c.conns[conn] = &connState{since: c.now()}
			c.mu.Unlock()
			connectionsShed.WithLabelValues(state).Inc()
			// Below TLS: no close alert to wait on.
			victim.Close()
			return conn, nil
		}
		c.mu.Unlock()
		if victim == nil {
			wait = shedAfter // nothing can be shed now
		}
		select {
		case <-c.freed:
		case <-time.After(wait):
		case <-c.closed:
			conn.Close()
			return nil, net.ErrClosed
		}
	}
}

// victim returns the connection to shed next — the oldest new one, or
// when none is open, the idle one unanswered longest — what it is ("new"
// or "idle"), and how long until it may be shed; nil when none may be.
// c.mu is held.
func (c *connections) victim() (*trackedConn, string, time.Duration) {
	var victim *trackedConn
	var oldest *connState
	for conn, s := range c.conns {
		if !s.sheddable() {
			continue
		}
		if victim == nil || (!s.answered && oldest.answered) || (s.answered == oldest.answered && s.since.Before(oldest.since)) {
			victim, oldest = conn, s
		}
	}
	if victim == nil {
		return nil, "", 0
	}
	state := "new"
	if oldest.answered {
		state = "idle"
	}
	return victim, state, oldest.since.Add(shedAfter).Sub(c.now())
}

// arrived records that bytes arrived on conn: a kept-alive connection's
// next request is on its way; a new one is making progress (its handshake,
// its first headers), and its clock starts again. It reports whether they
// are the first bytes of a kept-alive connection's next request.
func (c *connections) arrived(conn *trackedConn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.conns[conn]
	switch {
	case !ok || s.serving:
	case s.answered:
		first := !s.arriving
		s.arriving = true
		return first
	default:
		s.since = c.now()
	}
	return false
}

// Close stops accepting, and ends an Accept waiting for room.
func (c *connections) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Listener.Close()
}

// track is the server's ConnState hook: it records each connection's
// progress and forgets closed ones.
func (c *connections) track(conn net.Conn, state http.ConnState) {
	if t, ok := conn.(*tls.Conn); ok {
		conn = t.NetConn()
	}
	tracked, ok := conn.(*trackedConn)
	if !ok {
		return
	}
	if state == http.StateActive {
		tracked.headersRead()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.conns[tracked]
	switch {
	case !ok:
	case state == http.StateActive:
		s.serving = true
	case state == http.StateIdle:
		*s = connState{since: c.now(), answered: true}
	case state == http.StateClosed || state == http.StateHijacked:
		delete(c.conns, tracked)
		select {
		case c.freed <- struct{}{}:
		default:
		}
	}
}

// open is the number of connections open.
func (c *connections) open() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.conns)
}
