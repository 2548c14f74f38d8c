package app

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"
)

// restartBackoff is the wait before the aggregator starts a new manager: it
// doubles from min to max while managers stop soon after they start, and
// starts again from min after one ran for longer than max.
type restartBackoff struct {
	min, max, last time.Duration
}

// next returns the wait after a manager that ran for ran.
func (b *restartBackoff) next(ran time.Duration) time.Duration {
	switch {
	case b.last == 0 || ran > b.max:
		b.last = b.min
	default:
		b.last = min(2*b.last, b.max)
	}
	return b.last
}

// waitNotReady waits d, or until ctx is done, serving on probeAddr (unless
// "0") a /healthz that passes and a /readyz that fails: the process is alive
// and waiting, not ready, and the kubelet must not restart it.
func waitNotReady(ctx context.Context, probeAddr string, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	if probeAddr == "0" || probeAddr == "" {
		select {
		case <-ctx.Done():
		case <-timer.C:
		}
		return nil
	}
	ln, err := net.Listen("tcp", probeAddr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "waiting to start again: the API server cannot be reached, or the lease was lost", http.StatusServiceUnavailable)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case <-ctx.Done():
	case <-timer.C:
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdown)
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
