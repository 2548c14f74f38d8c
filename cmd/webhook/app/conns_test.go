package app

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// limitFixture is a connection limit on the loopback with a clock the
// test moves.
type limitFixture struct {
	t     *testing.T
	ln    net.Listener
	conns *connections
	now   time.Time
}

func newLimitFixture(t *testing.T, max int) *limitFixture {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &limitFixture{t: t, ln: ln, now: time.Unix(0, 0)}
	f.conns = limitConnections(ln, max, time.Minute)
	f.conns.now = func() time.Time { return f.now }
	t.Cleanup(func() { f.conns.Close() })
	return f
}

// connect dials a connection and accepts it: the client's end and the
// server's.
func (f *limitFixture) connect() (client, server net.Conn) {
	f.t.Helper()
	client = f.dial()
	return client, f.accept()
}

func (f *limitFixture) dial() net.Conn {
	f.t.Helper()
	client, err := net.Dial("tcp", f.ln.Addr().String())
	require.NoError(f.t, err)
	f.t.Cleanup(func() { client.Close() })
	return client
}

func (f *limitFixture) accept() net.Conn {
	f.t.Helper()
	server, err := f.conns.Accept()
	require.NoError(f.t, err)
	f.t.Cleanup(func() { server.Close() })
	return server
}

// acceptLater accepts the next connection in the background: the
// connection comes on the channel once the limit lets it in.
func (f *limitFixture) acceptLater() <-chan net.Conn {
	got := make(chan net.Conn, 1)
	go func() {
		if conn, err := f.conns.Accept(); err == nil {
			got <- conn
		}
	}()
	return got
}

// answered has the server answer a request on server: kept alive.
func (f *limitFixture) answered(server net.Conn) {
	f.conns.track(server, http.StateActive)
	f.conns.track(server, http.StateIdle)
}

func closedByServer(t *testing.T, client net.Conn) bool {
	require.NoError(t, client.SetReadDeadline(time.Now().Add(500*time.Millisecond)))
	_, err := client.Read(make([]byte, 1))
	return err == io.EOF
}

// TestConnectionsShedNewOnesFirst: at the limit a newcomer is let in by
// closing the oldest connection never answered, once stale, before a
// kept-alive one idle for longer; a connection being served is never
// closed.
func TestConnectionsShedNewOnesFirst(t *testing.T) {
	f := newLimitFixture(t, 3)
	keptAlive, keptAliveServer := f.connect()
	f.answered(keptAliveServer)
	f.now = f.now.Add(time.Second)
	stalled, _ := f.connect()
	served, servedServer := f.connect()
	f.conns.track(servedServer, http.StateActive) // its request is being served
	f.now = f.now.Add(shedAfter)

	f.connect()
	assert.True(t, closedByServer(t, stalled), "the connection never answered is shed")
	assert.False(t, closedByServer(t, keptAlive), "a kept-alive connection is shed while a new one could be")
	assert.False(t, closedByServer(t, served), "the connection being served stays")
	assert.Equal(t, 3, f.conns.open())
}

// TestKeptAliveConnectionsWithARequestArrivingStay: with no new connection
// to shed, the kept-alive connection idle longest goes, but never one on
// which a byte of its next request arrived, however long it was idle.
func TestKeptAliveConnectionsWithARequestArrivingStay(t *testing.T) {
	f := newLimitFixture(t, 2)
	sending, sendingServer := f.connect()
	f.answered(sendingServer)
	f.now = f.now.Add(time.Second)
	idle, idleServer := f.connect()
	f.answered(idleServer)
	f.now = f.now.Add(2 * shedAfter)
	_, err := sending.Write([]byte("P"))
	require.NoError(t, err)
	_, err = sendingServer.Read(make([]byte, 1)) // as the server's connection reads its next request
	require.NoError(t, err)

	f.connect()
	assert.True(t, closedByServer(t, idle), "the idle kept-alive connection is shed")
	assert.False(t, closedByServer(t, sending), "a connection whose next request is arriving is shed")
}

// TestATrickledRequestHoldsNoSlot: a kept-alive connection that sends the
// first byte of a next request and nothing more is read from for the
// header timeout at most, not for the server's IdleTimeout.
func TestATrickledRequestHoldsNoSlot(t *testing.T) {
	f := newLimitFixture(t, 2)
	f.conns.headerTimeout = 200 * time.Millisecond
	client, server := f.connect()
	f.answered(server)
	_, err := client.Write([]byte("P"))
	require.NoError(t, err)
	begin := time.Now()
	_, err = server.Read(make([]byte, 4)) // as Go's server peeks at a next request
	require.NoError(t, err)
	guard := time.AfterFunc(5*time.Second, func() { server.Close() })
	defer guard.Stop()
	_, err = server.Read(make([]byte, 4)) // the rest never comes
	var timeout net.Error
	require.ErrorAs(t, err, &timeout)
	assert.True(t, timeout.Timeout(), "%v", err)
	assert.Less(t, time.Since(begin), 5*time.Second, "held past the header timeout")
}

// TestNewcomerWaitsWhenNothingCanBeShed: every connection is being served:
// the newcomer's turn comes when one closes.
func TestNewcomerWaitsWhenNothingCanBeShed(t *testing.T) {
	f := newLimitFixture(t, 1)
	_, server := f.connect()
	f.conns.track(server, http.StateActive)
	f.now = f.now.Add(time.Hour)
	f.dial()
	got := f.acceptLater()
	select {
	case <-got:
		t.Fatal("a connection was let in beyond the limit with none that may be shed")
	case <-time.After(100 * time.Millisecond):
	}
	f.conns.track(server, http.StateClosed)
	select {
	case conn := <-got:
		conn.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("no room made by a closed connection")
	}
}

// TestNewConnectionsMakingProgressStay: a new connection whose bytes keep
// arriving (a handshake or headers slowed by a loaded machine) is not the
// one shed; the one that went silent longest is.
func TestNewConnectionsMakingProgressStay(t *testing.T) {
	f := newLimitFixture(t, 2)
	slow, slowServer := f.connect()
	f.now = f.now.Add(time.Second)
	silent, _ := f.connect()
	f.now = f.now.Add(2 * shedAfter)
	_, err := slow.Write([]byte("P"))
	require.NoError(t, err)
	_, err = slowServer.Read(make([]byte, 1))
	require.NoError(t, err)

	f.now = f.now.Add(time.Second)
	f.dial()
	got := f.acceptLater()
	select {
	case conn := <-got:
		t.Cleanup(func() { conn.Close() })
	case <-time.After(5 * time.Second):
		t.Fatal("the silent connection was not shed")
	}
	assert.True(t, closedByServer(t, silent), "the silent connection is shed")
	assert.False(t, closedByServer(t, slow), "a new connection making progress is shed")
}

// TestTrickledHeadersAreCutAtTheHeaderDeadline: through a real http.Server,
// a kept-alive connection that sends four bytes of a next request (after
// which Go's server sets its own, longer, header deadline) and then
// trickles the rest is closed at the header deadline from its first byte.
func TestTrickledHeadersAreCutAtTheHeaderDeadline(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	conns := limitConnections(ln, 4, 500*time.Millisecond)
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }),
		ReadHeaderTimeout: 5 * time.Second,
		ConnState:         conns.track,
	}
	go func() { _ = srv.Serve(conns) }()
	t.Cleanup(func() { _ = srv.Close() })

	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	require.NoError(t, err)
	r := bufio.NewReader(c)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	begin := time.Now()
	_, err = io.WriteString(c, "G")
	require.NoError(t, err)
	time.Sleep(300 * time.Millisecond)
	_, err = io.WriteString(c, "ET / HTTP/1.1\r\n")
	require.NoError(t, err)
	closed := make(chan time.Duration, 1)
	go func() {
		_, _ = r.ReadByte() // until the server closes the connection
		closed <- time.Since(begin)
	}()
	for {
		select {
		case d := <-closed:
			t.Logf("closed %s after the first byte", d.Round(time.Millisecond))
			assert.Less(t, d, 2*time.Second, "held past the header deadline")
			return
		case <-time.After(100 * time.Millisecond):
			if _, err := io.WriteString(c, "X-A: b\r\n"); err != nil {
				return // closed
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the connection was never closed")
		}
	}
}
