package app

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestConnectionsShedTheStalest: at the limit a new connection is let in by
// closing the connection that went longest with no request being served,
// once it has been so for shedAfter; a connection being served is never
// closed, and the newcomer waits while nothing can be shed.
func TestConnectionsShedTheStalest(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	now := time.Unix(0, 0)
	conns := limitConnections(ln, 2)
	conns.now = func() time.Time { return now }
	t.Cleanup(func() { conns.Close() })

	dial := func() net.Conn {
		t.Helper()
		client, err := net.Dial("tcp", ln.Addr().String())
		require.NoError(t, err)
		t.Cleanup(func() { client.Close() })
		return client
	}
	accept := func() net.Conn {
		t.Helper()
		server, err := conns.Accept()
		require.NoError(t, err)
		t.Cleanup(func() { server.Close() })
		return server
	}
	closed := func(client net.Conn) bool {
		require.NoError(t, client.SetReadDeadline(time.Now().Add(time.Second)))
		_, err := client.Read(make([]byte, 1))
		return err == io.EOF
	}
	serve := func(conn net.Conn) {
		conns.track(conn, http.StateActive)
		r := httptest.NewRequest(http.MethodPost, "/", nil).WithContext(conns.connContext(context.Background(), conn))
		conns.serving(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(httptest.NewRecorder(), r)
	}

	stalled := dial()
	stalledConn := accept()
	now = now.Add(time.Second)
	served := dial()
	serve(accept()) // its request is being served
	now = now.Add(shedAfter)
	dial()
	accept()
	assert.Equal(t, 2, conns.open())
	assert.True(t, closed(stalled), "the stalled connection is shed")
	assert.False(t, closed(served), "the connection being served stays")

	// Nothing can be shed: the newcomer's turn comes when a connection
	// closes.
	dial()
	got := make(chan net.Conn, 1)
	go func() {
		conn, err := conns.Accept()
		if err == nil {
			got <- conn
		}
	}()
	select {
	case <-got:
		t.Fatal("a connection was let in beyond the limit with none stale")
	case <-time.After(100 * time.Millisecond):
	}
	conns.track(stalledConn, http.StateClosed) // already forgotten: no effect
	for c := range conns.conns {
		conns.track(c, http.StateClosed)
		break
	}
	select {
	case conn := <-got:
		conn.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("no room made by a closed connection")
	}
}
