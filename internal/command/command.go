// Package command holds the flags and start-up steps shared by tally's two
// binaries: the config file, the API server connection, the metrics and
// health endpoints, and structured logging.
package command

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/internal/version"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/replicas"
)

// Common are the flags both binaries take.
type Common struct {
	// ConfigFile is the path given with --config.
	ConfigFile string
	// MetricsAddr is the metrics endpoint's address; "0" disables it.
	MetricsAddr string
	// ProbeAddr is the address of /healthz and /readyz.
	ProbeAddr string
	// MetricsSecure serves metrics over HTTPS, to requesters that
	// authenticate with a token the API server accepts and are allowed to
	// get the non-resource URL /metrics.
	MetricsSecure bool
	// CheckConfig is --check-config: check the config file as helm
	// install and upgrade do, and exit.
	CheckConfig bool

	zap zap.Options
}

// Bind registers the common flags on fs. --kubeconfig is registered on the
// default flag set by controller-runtime itself.
func (c *Common) Bind(fs *flag.FlagSet, defaultMetricsAddr string) {
	fs.StringVar(&c.ConfigFile, "config", "", "Path to the tally configuration file (required).")
	fs.StringVar(&c.MetricsAddr, "metrics-bind-address", defaultMetricsAddr, "Address of the Prometheus metrics endpoint; 0 disables it.")
	fs.StringVar(&c.ProbeAddr, "health-probe-bind-address", ":8081", "Address of the /healthz and /readyz endpoints; 0 disables them.")
	fs.BoolVar(&c.CheckConfig, "check-config", false, "Check the --config file as helm install and upgrade do (every custom count included; with an API server to ask, that the parent kinds it serves are namespaced), print the result and exit, non-zero when it is not valid.")
	fs.BoolVar(&c.MetricsSecure, "metrics-secure", false, "Serve metrics over HTTPS to requesters authorized (TokenReview and SubjectAccessReview) to get /metrics.")
	c.zap = zap.Options{Development: false}
	c.zap.BindFlags(fs)
}

// Setup installs the structured logger, then loads and validates the config
// file and the API server connection (--kubeconfig, else in-cluster).
func (c *Common) Setup() (*config.Config, *rest.Config, error) {
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&c.zap)))
	if c.ConfigFile == "" {
		return nil, nil, errors.New("--config is required")
	}
	cfg, err := config.Load(c.ConfigFile)
	if err != nil {
		return nil, nil, err
	}
	restCfg, err := ctrl.GetConfig()
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to the API server: %w", err)
	}
	return cfg, restCfg, nil
}

// Check checks the config file with config.Check, which refuses what the
// binaries leave out (a custom count that cannot be kept) as well as what
// they refuse, and writes the result to out. With an API server to ask
// (--kubeconfig, or in a pod with a token), it refuses a parent kind the
// API server serves as cluster-scoped too, as the binaries do at start;
// without one, it says that it did not check that.
func (c *Common) Check(out io.Writer) error {
	if c.ConfigFile == "" {
		return errors.New("--config is required")
	}
	data, err := os.ReadFile(c.ConfigFile)
	if err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	cfg, err := config.Check(data)
	if err != nil {
		return fmt.Errorf("config %s: %w", c.ConfigFile, err)
	}
	kinds := make([]string, len(cfg.Parents))
	for i, p := range cfg.Parents {
		kinds[i] = p.GroupKind().String()
	}
	scope := "the parent kinds the API server serves are namespaced"
	if restCfg, err := ctrl.GetConfig(); err != nil {
		scope = fmt.Sprintf("whether the parent kinds are namespaced was not checked: no API server to ask (%v)", err)
	} else if err := checkServedScopes(restCfg, cfg.Parents); err != nil {
		return fmt.Errorf("config %s: %w", c.ConfigFile, err)
	}
	_, err = fmt.Fprintf(out, "config %s is valid: parent kinds %s; %s\n", c.ConfigFile, strings.Join(kinds, ", "), scope)
	return err
}

// checkServedScopes is CheckScopes through the API server's discovery, which
// must answer, within discoveryAttempts tries: a kind it does not serve
// (yet) is the only one skipped.
func checkServedScopes(restCfg *rest.Config, parents []config.Parent) error {
	httpClient, err := rest.HTTPClientFor(restCfg)
	if err != nil {
		return err
	}
	var mapper meta.RESTMapper
	for attempt := 1; ; attempt++ {
		if mapper, err = apiutil.NewDynamicRESTMapper(restCfg, httpClient); err == nil {
			for i, p := range parents {
				if _, mapErr := mapper.RESTMapping(p.GroupKind(), p.Version); mapErr != nil && !meta.IsNoMatchError(mapErr) {
					err = fmt.Errorf("parents[%d] (%s): %w", i, p.GroupVersionKind(), mapErr)
					break
				}
			}
		}
		if err == nil {
			return CheckScopes(mapper, parents)
		}
		if attempt == discoveryAttempts {
			return fmt.Errorf("reading the API server's discovery, %d times: %w", attempt, err)
		}
		time.Sleep(discoveryRetry)
	}
}

// discoveryAttempts and discoveryRetry bound checkServedScopes' tries.
const (
	discoveryAttempts = 3
	discoveryRetry    = 2 * time.Second
)

// MetricsOptions returns the metrics server options for the bind address
// addr, served securely when secure is set.
func MetricsOptions(addr string, secure bool) metricsserver.Options {
	opts := metricsserver.Options{BindAddress: addr}
	if secure {
		opts.SecureServing = true
		opts.FilterProvider = filters.WithAuthenticationAndAuthorization
	}
	return opts
}

// Main parses the command line, runs run and exits non-zero with its error.
func Main(name string, run func() error) {
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "Usage: %s [flags]\n\nFlags:\n", name)
		flag.PrintDefaults()
	}
	printVersion := flag.Bool("version", false, "Print the version and exit.")
	flag.Parse()
	if *printVersion {
		fmt.Println(name, version.String())
		return
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "%s: unexpected arguments %q\n", name, flag.Args())
		os.Exit(2)
	}
	if err := setMemoryLimit(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(1)
	}
}

// MemoryLimitEnv names the variable through which the chart hands a binary
// its container's memory limit, in bytes (a resourceFieldRef).
const MemoryLimitEnv = "TALLY_MEMORY_LIMIT"

// MemoryLimitShare is the share of the container's memory limit that the Go
// runtime's soft limit (GOMEMLIMIT) is set to: the collector works harder
// as the heap nears it, and what the runtime does not count (goroutine
// stacks, memory not yet returned, the binary) has the rest before the
// container is killed.
const MemoryLimitShare = 0.9

// setMemoryLimit sets the runtime's soft memory limit to MemoryLimitShare
// of $TALLY_MEMORY_LIMIT. GOMEMLIMIT, when set, is the runtime's own and
// wins; without either, there is no soft limit.
func setMemoryLimit() error {
	limit, ok, err := memoryLimit(os.Getenv("GOMEMLIMIT"), os.Getenv(MemoryLimitEnv))
	if ok {
		debug.SetMemoryLimit(limit)
	}
	return err
}

// memoryLimit returns the soft limit for a container limit of container
// bytes, and false when there is none to set: GOMEMLIMIT (gomemlimit) is
// set, or container is empty.
func memoryLimit(gomemlimit, container string) (int64, bool, error) {
	if gomemlimit != "" || container == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseInt(container, 10, 64)
	if err != nil || n <= 0 {
		return 0, false, fmt.Errorf("$%s=%q: expected the container's memory limit, a positive number of bytes", MemoryLimitEnv, container)
	}
	return int64(float64(n) * MemoryLimitShare), true, nil
}

// AddReadyWhenCachesSynced makes mgr's /readyz report not ready until the
// manager's caches have synced. It does so on every replica, whether or not
// it holds the leader lease: a standby whose caches are warm is ready to
// take over, and a rollout must not wait on a lease the old pod holds.
func AddReadyWhenCachesSynced(mgr manager.Manager) error {
	check, err := CachesSynced(mgr)
	if err != nil {
		return err
	}
	return mgr.AddReadyzCheck("caches", check)
}

// CachesSynced returns a readiness check that fails until mgr's caches, and
// those the waits in also wait for, have synced, on every replica.
func CachesSynced(mgr manager.Manager, also ...func(context.Context) bool) (func(*http.Request) error, error) {
	var synced atomic.Bool
	if err := mgr.Add(replicas.Every(func(ctx context.Context) error {
		for _, wait := range also {
			if !wait(ctx) {
				return nil
			}
		}
		// (A cache reports synced once the manager stops: apiwait.Until.)
		if mgr.GetCache().WaitForCacheSync(ctx) && ctx.Err() == nil {
			synced.Store(true)
			mgr.GetLogger().Info("Caches synced")
		}
		return nil
	})); err != nil {
		return nil, err
	}
	return func(*http.Request) error {
		if !synced.Load() {
			return errors.New("caches not synced")
		}
		return nil
	}, nil
}

// CheckScopes refuses configured parent kinds that the API server serves as
// cluster-scoped: tally counts a parent's pods in the parent's namespace.
// Kinds not served yet are checked when they are.
func CheckScopes(mapper meta.RESTMapper, parents []config.Parent) error {
	for i, p := range parents {
		mapping, err := mapper.RESTMapping(p.GroupKind(), p.Version)
		if err == nil && mapping.Scope.Name() == meta.RESTScopeNameRoot {
			return fmt.Errorf("parents[%d] (%s): the kind is cluster-scoped; tally counts a parent's pods in its namespace, so a parent kind must be namespaced", i, p.GroupVersionKind())
		}
	}
	return nil
}
