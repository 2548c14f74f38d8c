package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/internal/command"
	"tally.dev/tally/pkg/freshness"
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

// probes serve /healthz and /readyz for the life of the process, across the
// managers it runs one after the other: /healthz passes while the process
// runs (it waits and retries by itself, a restart would not help), /readyz
// asks the current manager, and fails while none runs.
type probes struct {
	mu    sync.Mutex
	ready func(*http.Request) error
}

// set makes /readyz ask check; nil: not ready, no manager runs.
func (p *probes) set(check func(*http.Request) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ready = check
}

func (p *probes) readyz(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	check := p.ready
	p.mu.Unlock()
	switch {
	case check == nil:
		http.Error(w, "not ready: starting, or waiting to start again (the API server cannot be reached, or the lease was lost)", http.StatusServiceUnavailable)
	default:
		if err := check(r); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}
}

// serve serves the probes on addr until ctx is done; "0" or "" serves none.
func (p *probes) serve(ctx context.Context, addr string) (func(), error) {
	if addr == "0" || addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	mux.HandleFunc("/readyz", p.readyz)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	return func() {
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
		<-done
	}, nil
}

// serveMetrics serves the metrics endpoint on opts.MetricsAddr for the life
// of the process, across the managers it runs one after the other: a
// manager's own endpoint goes with it, and a scrape between two managers
// that finds none resets the alerts about the very stall that stopped the
// first (a pod view stale for minutes, manager after manager). It returns
// once the endpoint listens, or with the error that keeps it from
// listening (its address taken). stop ends the process's run with the
// server's error should it fail later; the returned func stops the server,
// waiting for it at most metricsShutdown.
func serveMetrics(ctx context.Context, restCfg *rest.Config, opts Options, stop context.CancelCauseFunc) (func(), error) {
	httpClient, err := rest.HTTPClientFor(restCfg)
	if err != nil {
		return nil, fmt.Errorf("creating the metrics endpoint's client: %w", err)
	}
	srv, err := metricsserver.NewServer(command.MetricsOptions(opts.MetricsAddr, opts.MetricsSecure), restCfg, httpClient)
	if err != nil {
		return nil, fmt.Errorf("creating the metrics endpoint: %w", err)
	}
	if srv == nil {
		// "0": none.
		return func() {}, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	ended := make(chan error, 1)
	go func() { ended <- srv.Start(ctx) }()
	if err := waitListening(srv, ended); err != nil {
		stopping := ctx.Err() != nil
		cancel()
		if stopping {
			// Told to stop while it started: not a failure.
			return func() {}, nil
		}
		return nil, fmt.Errorf("serving metrics on %s: %w", opts.MetricsAddr, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := <-ended; err != nil {
			stop(fmt.Errorf("serving metrics on %s: %w", opts.MetricsAddr, err))
		}
	}()
	return func() {
		cancel()
		select {
		case <-done:
		case <-time.After(metricsShutdown):
		}
	}, nil
}

// metricsShutdown bounds the wait for the metrics endpoint to end: its
// server gives a scrape under way a minute, longer than a pod's grace.
const metricsShutdown = 5 * time.Second

// waitListening waits, at most 10 s, for srv to listen, and returns the
// error it ended with if it ended first. A server that does not tell its
// address is not waited for.
func waitListening(srv metricsserver.Server, ended <-chan error) error {
	bound, ok := srv.(interface{ GetBindAddr() string })
	if !ok {
		return nil
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for bound.GetBindAddr() == "" {
		select {
		case err := <-ended:
			if err == nil {
				err = errors.New("the server ended before it listened")
			}
			return err
		case <-timeout:
			return errors.New("not listening after 10s")
		case <-tick.C:
		}
	}
	return nil
}

// managerRestarts counts the managers this process stopped and started
// again, by reason.
var managerRestarts = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "tally_aggregator_manager_restarts_total",
	Help: "Managers the aggregator stopped and started again in its process, by reason: stale_view (the pod view stayed stale with nothing delivered for 20 s of time the API server answered; a relist that makes progress is never cut, nor a view the API server throttles), lease_lost, or error (the API server unreachable at start, or another failure; the log says which).",
}, []string{"reason"})

func init() { metrics.Registry.MustRegister(managerRestarts) }

// restartReason names why a manager stopped with err, for managerRestarts.
func restartReason(err error) string {
	switch {
	case errors.Is(err, freshness.ErrStalled):
		return "stale_view"
	case err != nil && strings.Contains(err.Error(), "leader election lost"):
		return "lease_lost"
	}
	return "error"
}
