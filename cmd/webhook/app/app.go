// Package app wires tally's mutating webhook into a controller-runtime
// manager: the TLS server at mutate.Path, the owner cache behind
// verifyOwner, metrics and health endpoints. cmd/webhook and the test suites
// start the webhook through Run.
package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"tally.dev/tally/internal/apiwait"
	"tally.dev/tally/internal/command"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/pkg/servable"
)

// Options configure the webhook process.
type Options struct {
	// MetricsAddr is the metrics endpoint's address; "0" disables it.
	MetricsAddr string
	// ProbeAddr is the address of /healthz and /readyz; "0" disables them.
	ProbeAddr string
	// MetricsSecure serves metrics over HTTPS to authorized requesters.
	MetricsSecure bool
	// Host and Port are where the webhook serves TLS.
	Host string
	Port int
	// CertDir holds tls.crt and tls.key; they are reloaded when they change.
	CertDir string
	// ShutdownDelay is how long the webhook keeps serving after ctx is done
	// (SIGTERM), not ready and closing each connection after its answer,
	// while the Service's endpoints drop it.
	ShutdownDelay time.Duration
}

// Run serves the webhook until ctx is done, and for opts.ShutdownDelay
// after. /readyz reports ready once the TLS server answers and, with
// verifyOwner, the owner cache has synced, and not ready again while it
// drains.
func Run(ctx context.Context, cfg *config.Config, restCfg *rest.Config, opts Options) error {
	log := ctrl.Log.WithName("webhook")
	if opts.ShutdownDelay < 0 {
		return fmt.Errorf("--shutdown-delay must not be negative, not %s", opts.ShutdownDelay)
	}
	// The manager runs on past ctx's end, for the shutdown delay.
	mgrCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	// With a fixed list of namespaces, the owner cache (verifyOwner)
	// watches the parents of those only: the webhook is called for no pod
	// elsewhere, and the chart grants it no read elsewhere.
	var cacheOpts cache.Options
	for _, ns := range cfg.FixedNamespaces() {
		if cacheOpts.DefaultNamespaces == nil {
			cacheOpts.DefaultNamespaces = map[string]cache.Config{}
		}
		cacheOpts.DefaultNamespaces[ns] = cache.Config{}
	}
	mgr, err := ctrl.NewManager(restCfg, manager.Options{
		Cache:                  cacheOpts,
		Metrics:                command.MetricsOptions(opts.MetricsAddr, opts.MetricsSecure),
		HealthProbeBindAddress: opts.ProbeAddr,
		Logger:                 log,
		// The owner cache (verifyOwner) is fresh within a second of an API
		// outage's end, whatever its length.
		NewCache: apiwait.Until(mgrCtx, apiwait.NewCache),
	})
	if err != nil {
		return fmt.Errorf("creating manager: %w", err)
	}

	if err := command.CheckScopes(mgr.GetRESTMapper(), cfg.Parents); err != nil {
		return err
	}
	var checker mutate.OwnerChecker
	if cfg.VerifyOwner {
		var pending []config.Parent
		for _, p := range cfg.Parents {
			if _, err := mgr.GetCache().GetInformer(ctx, mutate.PartialMetadata(p.GroupVersionKind())); err != nil {
				log.Error(err, "Parent kind not served yet: its pods are not stamped until it is; checking again", "kind", p.GroupKind().String())
				pending = append(pending, p)
			}
		}
		if len(pending) > 0 {
			if err := mgr.Add(watchLater(mgr, pending, log)); err != nil {
				return err
			}
		}
		checker = mutate.NewReaderOwnerChecker(cfg.Parents, mgr.GetCache(), mutate.PartialMetadata, mgr.GetAPIReader())
	}
	disco, err := discovery.NewDiscoveryClientForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("creating discovery client: %w", err)
	}
	gate := servable.NewGate(servable.NewChecker(mgr.GetRESTMapper(), disco), cfg.Parents, log.WithName("totals"))
	if err := mgr.Add(gate); err != nil {
		return err
	}
	mutator := mutate.NewMutator(cfg.Parents, checker)
	mutator.AddTrackingWhen(gate.Serves)
	var draining atomic.Bool
	handler := mutate.NewHandler(mutator, log)
	mux := http.NewServeMux()
	mux.Handle(mutate.Path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if draining.Load() {
			// The API server opens a new connection for its next request,
			// to a replica that stays.
			w.Header().Set("Connection", "close")
		}
		handler.ServeHTTP(w, r)
	}))
	server := &server{addr: hostPort(opts.Host, opts.Port), certDir: opts.CertDir, handler: mux, log: log}
	if err := mgr.Add(server); err != nil {
		return err
	}

	if err := mgr.AddHealthzCheck("admission", func(*http.Request) error { return handler.Healthy() }); err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("webhook-server", server.checkStarted); err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("not-draining", func(*http.Request) error {
		if draining.Load() {
			return errors.New("shutting down")
		}
		return nil
	}); err != nil {
		return err
	}
	// With verifyOwner, the owner cache; otherwise there is none to wait for.
	if err := command.AddReadyWhenCachesSynced(mgr); err != nil {
		return err
	}
	log.Info("Starting webhook", "path", mutate.Path, "port", opts.Port, "certDir", opts.CertDir, "verifyOwner", cfg.VerifyOwner,
		"parents", len(cfg.Parents), "shutdownDelay", opts.ShutdownDelay.String())
	go func() {
		select {
		case <-ctx.Done():
		case <-mgrCtx.Done():
			return
		}
		draining.Store(true)
		log.Info("Shutting down: serving while the endpoints drop this replica", "for", opts.ShutdownDelay.String())
		select {
		case <-time.After(opts.ShutdownDelay):
		case <-mgrCtx.Done():
		}
		stop()
	}()
	return mgr.Start(mgrCtx)
}

// watchLater starts the owner cache of each pending parent kind once the API
// server serves it, checking again with backoff: a kind whose CRD arrives
// after the webhook (one GitOps sync) needs no restart.
func watchLater(mgr manager.Manager, pending []config.Parent, log logr.Logger) manager.Runnable {
	return manager.RunnableFunc(func(ctx context.Context) error {
		for wait := 2 * time.Second; len(pending) > 0; wait = min(2*wait, time.Minute) {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(wait):
			}
			still := pending[:0]
			for _, p := range pending {
				if _, err := mgr.GetCache().GetInformer(ctx, mutate.PartialMetadata(p.GroupVersionKind())); err != nil {
					still = append(still, p)
					continue
				}
				log.Info("Parent kind is served now: verifying its owners from the cache", "kind", p.GroupKind().String())
			}
			pending = still
		}
		return nil
	})
}
