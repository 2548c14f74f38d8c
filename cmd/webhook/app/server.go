package app

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"

	"tally.dev/tally/pkg/mutate"
)

// The serving limits. The API server sends an AdmissionReview promptly,
// over a few kept-alive connections, and waits at most 30 s for the answer;
// a client that is slower than these limits is not an API server.
const (
	// readHeaderTimeout bounds the time to send the request's headers.
	readHeaderTimeout = 5 * time.Second
	// readTimeout bounds the time to send a whole request, body included.
	readTimeout = 15 * time.Second
	// writeTimeout bounds the time from the end of the headers to the end
	// of the answer.
	writeTimeout = 20 * time.Second
	// idleTimeout closes a kept-alive connection unused for this long.
	idleTimeout = 90 * time.Second
	// maxHeaderBytes bounds a request's headers; the API server's are a few
	// hundred bytes.
	maxHeaderBytes = 64 << 10
	// maxConnections bounds the open connections: each costs a goroutine
	// and TLS buffers (about 50 KiB) and may hold a small body (see
	// mutate.MaxConnections); beyond it, one with nothing in progress is
	// closed (connections).
	maxConnections = mutate.MaxConnections
)

// server serves the webhook over TLS with the limits above, reloading the
// certificate when its files change. controller-runtime's webhook server
// sets no read or write timeout, so a client that announces a body and never
// sends it holds its connection forever.
type server struct {
	addr    string
	certDir string
	handler http.Handler
	log     logr.Logger
	started atomic.Bool
}

// NeedLeaderElection reports that every replica serves.
func (s *server) NeedLeaderElection() bool { return false }

// Start serves until ctx is done, then finishes the requests in flight.
func (s *server) Start(ctx context.Context) error {
	watcher, err := certwatcher.New(filepath.Join(s.certDir, "tls.crt"), filepath.Join(s.certDir, "tls.key"))
	if err != nil {
		return fmt.Errorf("loading the serving certificate from %s: %w", s.certDir, err)
	}
	go func() {
		if err := watcher.Start(ctx); err != nil {
			s.log.Error(err, "Certificate watcher stopped")
		}
	}()
	serveCertificate(watcher.GetCertificate)
	ln, err := net.Listen("tcp", s.addr)
	if err != nil {
		return err
	}
	// The limit sits below TLS: it sees every byte arrive, and sheds a
	// connection without waiting on a TLS close alert.
	// A kept-alive connection's next request has its headers in by
	// shedAfter from their first byte: within readHeaderTimeout, and short
	// enough that a newcomer kept waiting by connections that trickle one
	// byte is let in within seconds.
	conns := limitConnections(ln, maxConnections, shedAfter)
	tlsLn := tls.NewListener(conns, &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: watcher.GetCertificate,
		// HTTP/2 is not needed by the API server and widens the attack
		// surface (stream resets); serve HTTP/1.1 only.
		NextProtos: []string{"http/1.1"},
	})
	srv := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		// Connection-level errors (TLS handshakes, timeouts) come by the
		// thousand from a misbehaving client: debug level.
		ErrorLog:    stdlog.New(debugWriter{s.log}, "", 0),
		BaseContext: func(net.Listener) context.Context { return ctx },
		ConnState:   conns.track,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTimeout)
		defer cancel()
		if err := srv.Shutdown(shutdown); err != nil {
			s.log.Error(err, "Shutting down the webhook server")
		}
	}()
	s.log.Info("Serving webhook", "address", s.addr)
	s.started.Store(true)
	if err := srv.Serve(tlsLn); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	<-done
	return nil
}

// checkStarted is the readiness check of the server.
func (s *server) checkStarted(*http.Request) error {
	if !s.started.Load() {
		return errors.New("webhook server not started")
	}
	return nil
}

// debugWriter writes the HTTP server's own log lines at debug level.
type debugWriter struct{ log logr.Logger }

func (w debugWriter) Write(p []byte) (int, error) {
	if log := w.log.V(1); log.Enabled() {
		log.Info("HTTP server", "message", strings.TrimSpace(string(p)))
	}
	return len(p), nil
}

func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }
