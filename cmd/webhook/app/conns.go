package app

import (
	"context"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

var connectionsShed = prometheus.NewCounter(prometheus.CounterOpts{
	Name: "tally_webhook_connections_shed_total",
	Help: "Connections the webhook closed at its connection limit to make room for a new one: the ones that had gone longest with no request in progress.",
})

func init() {
	metrics.Registry.MustRegister(connectionsShed)
}

// shedAfter is how long a connection may go with no request in progress
// before it may be closed to make room for a new one: far longer than the
// API server takes to finish a TLS handshake and send its headers.
const shedAfter = 2 * time.Second

// connections bounds the server's open connections so that clients holding
// connections open, and reopening them as fast as they are closed, cannot
// keep the API server's new connections out for long. A limit that only
// stops accepting (netutil.LimitListener) leaves a new connection queued
// until one of theirs times out (seconds each, for every connection ahead
// of it). Here, at the limit, the connection that has gone longest with no
// request in progress — still in its handshake or headers, or idle after an
// answer — is closed to make room once it has been so for shedAfter;
// connections whose request is being served are never closed. So the
// connections ahead of a new one leave at MaxConnections per shedAfter
// whatever they do, and a connection let in has at least shedAfter to send
// its request. The API server's idle kept-alive connections may be closed
// under such a flood; it opens new ones.
type connections struct {
	net.Listener
	max int
	now func() time.Time

	mu    sync.Mutex
	conns map[net.Conn]*connState
	// freed is signalled when a connection closes.
	freed  chan struct{}
	closed chan struct{}
	once   sync.Once
}

// connState is what the limit knows of one open connection.
type connState struct {
	// since is when the connection was opened, started a request, or was
	// answered, whichever was last.
	since time.Time
	// serving reports that a request's headers were read and its answer is
	// not written yet.
	serving bool
}

func limitConnections(ln net.Listener, max int) *connections {
	return &connections{Listener: ln, max: max, now: time.Now, conns: make(map[net.Conn]*connState),
		freed: make(chan struct{}, 1), closed: make(chan struct{})}
}

// Accept accepts the next connection and, at the limit, sheds the stalest
// one, waiting until one may be shed or has closed.
func (c *connections) Accept() (net.Conn, error) {
	conn, err := c.Listener.Accept()
	if err != nil {
		return nil, err
	}
	for {
		c.mu.Lock()
		if len(c.conns) < c.max {
			c.conns[conn] = &connState{since: c.now()}
			c.mu.Unlock()
			return conn, nil
		}
		victim, wait := c.stalest()
		if victim != nil && wait <= 0 {
			delete(c.conns, victim)
			c.conns[conn] = &connState{since: c.now()}
			c.mu.Unlock()
			connectionsShed.Inc()
			// Closing a TLS connection may wait to send its close alert.
			go victim.Close()
			return conn, nil
		}
		c.mu.Unlock()
		if victim == nil {
			wait = shedAfter // every connection is being served
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

// stalest returns the open connection that has gone longest with no request
// being served, and how long until it may be shed; nil when every one is
// being served. c.mu is held.
func (c *connections) stalest() (net.Conn, time.Duration) {
	var victim net.Conn
	var oldest time.Time
	for conn, s := range c.conns {
		if !s.serving && (victim == nil || s.since.Before(oldest)) {
			victim, oldest = conn, s.since
		}
	}
	return victim, oldest.Add(shedAfter).Sub(c.now())
}

// Close stops accepting, and ends an Accept waiting for room.
func (c *connections) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Listener.Close()
}

// track is the server's ConnState hook: it records each connection's
// progress and forgets closed ones.
func (c *connections) track(conn net.Conn, state http.ConnState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.conns[conn]
	switch {
	case !ok:
	case state == http.StateActive || state == http.StateIdle:
		s.since, s.serving = c.now(), false
	case state == http.StateClosed || state == http.StateHijacked:
		delete(c.conns, conn)
		select {
		case c.freed <- struct{}{}:
		default:
		}
	}
}

type connKey struct{}

// connContext is the server's ConnContext hook: the request's context
// carries its connection, for serving.
func (c *connections) connContext(ctx context.Context, conn net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, conn)
}

// serving wraps the server's handler: a connection whose request is being
// served is not shed.
func (c *connections) serving(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if conn, ok := r.Context().Value(connKey{}).(net.Conn); ok {
			c.mu.Lock()
			if s, ok := c.conns[conn]; ok {
				s.serving = true
			}
			c.mu.Unlock()
		}
		next.ServeHTTP(w, r)
	})
}

// open is the number of connections open.
func (c *connections) open() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.conns)
}
