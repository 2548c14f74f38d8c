package demo

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
)

// Start starts the control plane, the webhook and aggregator processes, the
// operator and the simulated kubelet, and creates the demo namespace; with
// Options.Installed, only the operator and the kubelet.
func Start(ctx context.Context, opts Options) (_ *Demo, err error) {
	cfg, err := config.Load(opts.ConfigFile)
	if err != nil {
		return nil, err
	}
	d := &Demo{opts: opts, cfg: cfg, logDir: filepath.Join(opts.Dir, "logs"), rng: rand.New(rand.NewPCG(opts.Seed, 1)), kubeletRNG: rand.New(rand.NewPCG(opts.Seed, 2))}
	for _, p := range cfg.Parents {
		if p.GroupKind() != operator.GVK.GroupKind() {
			continue
		}
		d.totals = p.Tracked()
		d.custom, d.unkept = customCounts(p)
		if path, ok := p.Compare[config.Completing]; ok && opts.Cluster == nil {
			d.legacyPath = path
		}
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Stop())
		}
	}()
	if err := os.MkdirAll(d.logDir, 0o755); err != nil {
		return nil, err
	}
	for _, c := range d.unkept {
		d.say("the custom count at %s cannot be kept, so tally leaves it unwritten and serves the rest: %v", strings.Join(c.path, "."), c.err)
	}

	if opts.Cluster != nil {
		d.client = opts.Cluster.Client
		d.say("kubeconfig: %s   (kubectl --kubeconfig %s get workerpools -n %s -w)", opts.Cluster.Kubeconfig, opts.Cluster.Kubeconfig, Namespace)
		d.say("why the pool shows what it shows: %s --kubeconfig %s -n %s explain workerpool/%s",
			filepath.Join(opts.BinDir, "kubectl-tally"), opts.Cluster.Kubeconfig, Namespace, Pool)
		restConfig, err := clientcmd.BuildConfigFromFlags("", opts.Cluster.Kubeconfig)
		if err != nil {
			return nil, err
		}
		d.restConfig = restConfig
		if err := d.watchFinished(ctx, restConfig); err != nil {
			return nil, err
		}
		return d, d.client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}})
	}
	if opts.Installed != nil {
		d.client, d.aggregatorMetrics, d.restConfig = opts.Installed.Env.Client, opts.Installed.AggregatorMetrics, opts.Installed.Env.Config
		if err := d.watchFinished(ctx, opts.Installed.Env.Config); err != nil {
			return nil, err
		}
		return d, d.startWorkloads(ctx, opts.Installed.Env)
	}
	d.say("starting kube-apiserver and etcd")
	if d.env, err = controlplane.Start(controlplane.Options{}); err != nil {
		return nil, err
	}
	d.client, d.restConfig = d.env.Client, d.env.Config
	if err := d.writeKubeconfig(); err != nil {
		return nil, err
	}
	d.say("kubeconfig: %s   (kubectl --kubeconfig %s get workerpools -n %s -w)", d.kubeconfig, d.kubeconfig, Namespace)
	d.say("why the pool shows what it shows: %s --kubeconfig %s --config %s -n %s explain workerpool/%s",
		filepath.Join(opts.BinDir, "kubectl-tally"), d.kubeconfig, opts.ConfigFile, Namespace, Pool)

	ca, port, err := d.startWebhook(ctx)
	if err != nil {
		return nil, err
	}
	if err := d.registerWebhook(ctx, ca, port); err != nil {
		return nil, err
	}
	// The chart's admission policies, as installed: the aggregator's pod
	// writes fenced, tally's keys guarded on pods/status and pods/binding.
	if err := helm.InstallPolicies(ctx, d.client); err != nil {
		return nil, err
	}
	if err := d.StartAggregator(ctx); err != nil {
		return nil, err
	}
	if err := d.watchFinished(ctx, d.env.Config); err != nil {
		return nil, err
	}
	return d, d.startWorkloads(ctx, d.env)
}

// watchFinished starts recording the pods that finish, the truth of the
// totals, until Stop.
func (d *Demo) watchFinished(ctx context.Context, cfg *rest.Config) error {
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	d.stopWatch = cancel
	var err error
	d.finished, err = WatchFinished(wctx, cfg, Namespace)
	return err
}

// startWorkloads starts the example operator and the simulated kubelet on
// env, and creates the demo namespace.
func (d *Demo) startWorkloads(ctx context.Context, env *controlplane.Env) error {
	if err := d.startOperator(env); err != nil {
		return err
	}
	if err := d.client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}); err != nil {
		return err
	}
	if d.legacyPath != "" {
		d.say("a counter kept the old way (read-modify-write from two handlers) writes %s; tally compares it with its own count (shadow mode)", d.legacyPath)
		lctx, cancel := context.WithCancel(context.Background())
		legacy, err := startLegacyCounter(lctx, env.Config, d.client, d.legacyPath, d.opts.Seed)
		if err != nil {
			cancel()
			return err
		}
		d.legacy, d.stopLegacy = legacy, cancel
	}
	kctx, cancel := context.WithCancel(context.Background())
	d.stopKubelet, d.kubeletDone = cancel, make(chan struct{})
	go func() {
		defer close(d.kubeletDone)
		d.kubelet(kctx)
	}()
	return nil
}

func (d *Demo) writeKubeconfig() error {
	user, err := d.env.AddUser(envtest.User{Name: "demo-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("provisioning the demo user: %w", err)
	}
	if d.kubeconfig, err = writeKubeconfig(user, filepath.Join(d.opts.Dir, "kubeconfig")); err != nil {
		return err
	}
	if user, err = d.env.AggregatorIdentity(); err != nil {
		return err
	}
	d.aggregatorKubeconfig, err = writeKubeconfig(user, filepath.Join(d.opts.Dir, "aggregator.kubeconfig"))
	return err
}

// writeKubeconfig writes user's kubeconfig to path and returns its absolute
// path.
func writeKubeconfig(user *envtest.AuthenticatedUser, path string) (string, error) {
	path, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	return path, controlplane.WriteKubeconfig(user, path)
}

func freeAddr() (string, int, error) {
	port, err := process.FreePort()
	return "127.0.0.1:" + strconv.Itoa(port), port, err
}

func (d *Demo) startWebhook(ctx context.Context) (*devcert.CA, int, error) {
	ca, err := devcert.NewCA("tally demo CA", 24*time.Hour)
	if err != nil {
		return nil, 0, err
	}
	pair, err := ca.Issue([]string{"127.0.0.1", "localhost"}, 24*time.Hour)
	if err != nil {
		return nil, 0, err
	}
	certDir := filepath.Join(d.opts.Dir, "certs")
	if err := pair.WriteDir(certDir); err != nil {
		return nil, 0, err
	}
	if err := os.WriteFile(filepath.Join(certDir, "ca.crt"), ca.CertPEM, 0o644); err != nil {
		return nil, 0, err
	}
	_, port, err := freeAddr()
	if err != nil {
		return nil, 0, err
	}
	probe, _, err := freeAddr()
	if err != nil {
		return nil, 0, err
	}
	d.say("starting %s (port %d, certificates in %s)", filepath.Join(d.opts.BinDir, "webhook"), port, certDir)
	d.webhook, err = process.Start("webhook", filepath.Join(d.opts.BinDir, "webhook"), d.logDir,
		"--config", d.opts.ConfigFile, "--kubeconfig", d.kubeconfig, "--cert-dir", certDir,
		"--host", "127.0.0.1", "--port", strconv.Itoa(port), "--metrics-bind-address", "0", "--health-probe-bind-address", probe)
	if err != nil {
		return nil, 0, err
	}
	return ca, port, d.webhook.WaitReady(ctx, "http://"+probe+"/readyz")
}

// registerWebhook registers the webhook as the chart does, with the same
// match conditions, pointing at the local process.
func (d *Demo) registerWebhook(ctx context.Context, ca *devcert.CA, port int) error {
	wh := mutate.Webhook(d.cfg, admissionregistrationv1.WebhookClientConfig{
		URL:      ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path)),
		CABundle: ca.CertPEM,
	}, helm.AggregatorUser)
	return d.client.Create(ctx, &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "tally"},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{wh},
	})
}

// StartAggregator starts the aggregator process and waits until it is ready.
func (d *Demo) StartAggregator(ctx context.Context) error {
	probe, _, err := freeAddr()
	if err != nil {
		return err
	}
	if d.aggregatorMetrics, _, err = freeAddr(); err != nil {
		return err
	}
	d.say("starting %s", filepath.Join(d.opts.BinDir, "aggregator"))
	d.aggregator, err = process.Start("aggregator", filepath.Join(d.opts.BinDir, "aggregator"), d.logDir,
		"--config", d.opts.ConfigFile, "--kubeconfig", d.aggregatorKubeconfig,
		"--metrics-bind-address", d.aggregatorMetrics, "--health-probe-bind-address", probe)
	if err != nil {
		return err
	}
	return d.aggregator.WaitReady(ctx, "http://"+probe+"/readyz")
}

// StopAggregator stops the aggregator process.
func (d *Demo) StopAggregator() error {
	err := d.aggregator.Stop()
	d.aggregator = nil
	return err
}

func (d *Demo) startOperator(env *controlplane.Env) error {
	logFile, err := os.Create(filepath.Join(d.logDir, "operator.log"))
	if err != nil {
		return err
	}
	log := zap.New(zap.WriteTo(logFile))
	mgr, err := ctrl.NewManager(env.Config, manager.Options{
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 log,
		// One process may run the demo more than once (its tests do): each
		// run's operator is its own, with no metrics to collide.
		Controller: ctrlconfig.Controller{SkipNameValidation: ptr.To(true)},
		// The operator needs only the pods tally stamped, and runs the demo's
		// namespace only: another operator (examples/kopf) can run pools
		// elsewhere on the same control plane.
		Cache: cache.Options{
			DefaultNamespaces: map[string]cache.Config{Namespace: {}},
			ByObject:          map[client.Object]cache.ByObject{&corev1.Pod{}: {Label: aggregate.PodSelector()}},
		},
	})
	if err != nil {
		return err
	}
	if err := (&operator.Reconciler{Client: mgr.GetClient(), Image: "registry.example/worker:1"}).SetupWithManager(mgr); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctrl.LoggerInto(context.Background(), log))
	d.stopOperator, d.operatorDone = cancel, make(chan error, 1)
	go func() {
		d.operatorDone <- mgr.Start(ctx)
		logFile.Close()
	}()
	return nil
}

// Stop stops everything Start started (on a cluster, deletes the demo's
// namespace). It is safe to call on a partly started demo.
func (d *Demo) Stop() error {
	var errs []error
	if d.stopWatch != nil {
		d.stopWatch()
	}
	if d.stopLegacy != nil {
		d.stopLegacy()
		errs = append(errs, d.legacy.drained(10*time.Second))
	}
	if d.stopKubelet != nil {
		d.stopKubelet()
		<-d.kubeletDone
	}
	if d.stopOperator != nil {
		d.stopOperator()
		errs = append(errs, <-d.operatorDone)
	}
	errs = append(errs, d.aggregator.Stop(), d.webhook.Stop())
	if d.env != nil {
		errs = append(errs, d.env.Stop())
	}
	if d.opts.Cluster != nil {
		// The cluster outlives the demo: the pool and its pods go.
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}
		errs = append(errs, client.IgnoreNotFound(d.client.Delete(context.Background(), ns)))
	}
	return errors.Join(errs...)
}
