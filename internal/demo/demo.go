// Package demo runs tally for real on a local control plane: kube-apiserver
// and etcd built from source, the webhook and aggregator binaries as child
// processes, the example WorkerPool operator, and a simulated kubelet. It
// drives the scale-down scenario of the problem statement and compares, at
// quiescence, what tally wrote with counts from a fresh List. `make demo`
// and the end-to-end test both run it.
package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// Namespace and Pool name the WorkerPool the demo drives.
const (
	Namespace = "demo"
	Pool      = "workers"
)

// Options configure a demo run.
type Options struct {
	// Dir receives the kubeconfig, certificates and logs.
	Dir string
	// BinDir holds the webhook and aggregator binaries.
	BinDir string
	// ConfigFile is tally's configuration file.
	ConfigFile string
	// Duration is how long the scenario drives changes.
	Duration time.Duration
	// Seed makes the scenario's random choices repeatable.
	Seed uint64
	// Out receives the progress display and the verdict.
	Out io.Writer
	// Installed, when set, runs the scenario against a control plane where
	// tally is already installed and running (the chart, and binaries the
	// caller started): the demo starts only the operator and the kubelet.
	Installed *Installed
	// Cluster, when set, runs the scenario on a real cluster where
	// Cluster.Install has run: the demo starts nothing, the kubelet runs the
	// pods, and the workers crash by themselves.
	Cluster *Cluster
	// Redraw redraws one progress line (a terminal) instead of printing a
	// line a second.
	Redraw bool
}

// Demo is a running demo system.
type Demo struct {
	opts   Options
	cfg    *config.Config
	env    *framework.Env
	client client.Client
	// restConfig reaches the API server as an administrator, in every mode.
	restConfig *rest.Config
	kubeconfig string
	// aggregatorKubeconfig runs the aggregator as the chart's service
	// account would: the webhook registration exempts it.
	aggregatorKubeconfig string
	logDir               string
	// rng drives the disruptions, kubeletRNG the kubelet's delays.
	rng, kubeletRNG *rand.Rand

	webhook, aggregator *process.Process
	aggregatorMetrics   string
	stopOperator        context.CancelFunc
	operatorDone        chan error
	stopKubelet         context.CancelFunc
	kubeletDone         chan struct{}
	// totals reports that the configuration maps the pool's totals;
	// finished is then the truth they are compared with.
	totals    bool
	finished  *Finished
	stopWatch context.CancelFunc
}

// Kubeconfig returns the path of the kubeconfig that reaches the demo's
// API server.
func (d *Demo) Kubeconfig() string { return d.kubeconfig }

// Installed is a control plane with tally installed, for Options.Installed.
type Installed struct {
	// Env is the control plane; the demo does not stop it.
	Env *framework.Env
	// AggregatorMetrics is the running aggregator's metrics address
	// (host:port, plain HTTP), from which the verdict counts its applies.
	AggregatorMetrics string
}

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
		d.totals = d.totals || (p.GroupKind() == builder.WorkerPoolGVK.GroupKind() && p.Tracked())
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Stop())
		}
	}()
	if err := os.MkdirAll(d.logDir, 0o755); err != nil {
		return nil, err
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
	if d.env, err = framework.Start(framework.Options{}); err != nil {
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
	if err := d.env.InstallPolicies(ctx); err != nil {
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
func (d *Demo) startWorkloads(ctx context.Context, env *framework.Env) error {
	if err := d.startOperator(env); err != nil {
		return err
	}
	if err := d.client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}); err != nil {
		return err
	}
	kctx, cancel := context.WithCancel(context.Background())
	d.stopKubelet, d.kubeletDone = cancel, make(chan struct{})
	go func() {
		defer close(d.kubeletDone)
		d.kubelet(kctx)
	}()
	return nil
}

func (d *Demo) say(format string, args ...any) {
	fmt.Fprintf(d.opts.Out, "demo: "+format+"\n", args...)
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
	return path, framework.WriteKubeconfig(user, path)
}

func freeAddr() (string, int, error) {
	port, err := framework.FreePort()
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
	}, framework.AggregatorUser)
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

func (d *Demo) startOperator(env *framework.Env) error {
	logFile, err := os.Create(filepath.Join(d.logDir, "operator.log"))
	if err != nil {
		return err
	}
	log := zap.New(zap.WriteTo(logFile))
	mgr, err := ctrl.NewManager(env.Config, manager.Options{
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Logger:                 log,
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

// Processes returns the PIDs of the demo's child processes that were
// started, running or not.
func (d *Demo) Processes() []int {
	var pids []int
	for _, p := range []*process.Process{d.webhook, d.aggregator} {
		if p != nil {
			pids = append(pids, p.Pid())
		}
	}
	return pids
}

// SetReplicas sets the pool's spec.replicas.
func (d *Demo) SetReplicas(ctx context.Context, n int64) error {
	patch := fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, n)
	pool := builder.WorkerPool(Namespace, Pool, 0)
	return d.client.Patch(ctx, pool, client.RawPatch(types.MergePatchType, patch))
}

// Snapshot is what tally shows on the pool beside the truth.
type Snapshot struct {
	Desired int64
	Tally   map[config.Count]int64
	Truth   map[config.Count]int64
	// Totals are the totals tally shows, Finished the pods the demo saw
	// finish; both nil when the configuration maps no totals.
	Totals, Finished map[config.Count]int64
	// Settled reports that no pod is starting or completing and the pool
	// runs as many pods as it wants.
	Settled bool
}

// Match reports whether tally's values equal the truth.
func (s Snapshot) Match() bool {
	for _, c := range config.Counts {
		if s.Tally[c] != s.Truth[c] {
			return false
		}
	}
	for _, c := range config.Totals {
		if s.Totals != nil && s.Totals[c] != s.Finished[c] {
			return false
		}
	}
	return true
}

// Snapshot reads the pool and its pods.
func (d *Demo) Snapshot(ctx context.Context) (Snapshot, error) {
	pool := builder.WorkerPool(Namespace, Pool, 0)
	if err := d.client.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
		return Snapshot{}, err
	}
	var pods corev1.PodList
	if err := d.client.List(ctx, &pods, client.InNamespace(Namespace)); err != nil {
		return Snapshot{}, err
	}
	s := Snapshot{Tally: map[config.Count]int64{}, Truth: framework.Truth(pods.Items, pool.GetNamespace(), pool.GetUID())}
	s.Desired, _, _ = unstructured.NestedInt64(pool.Object, "spec", "replicas")
	shown := func(c config.Count) int64 {
		v, found, _ := unstructured.NestedInt64(pool.Object, "status", string(c))
		if !found {
			v = -1
		}
		return v
	}
	for _, c := range config.Counts {
		s.Tally[c] = shown(c)
	}
	if d.totals {
		s.Totals, s.Finished = map[config.Count]int64{}, d.finished.Totals()
		for _, c := range config.Totals {
			s.Totals[c] = shown(c)
		}
	}
	starting := false
	for _, p := range pods.Items {
		starting = starting || p.Status.Phase == "" || p.Status.Phase == corev1.PodPending
	}
	s.Settled = !starting && s.Truth[config.Completing] == 0 && s.Truth[config.Completed] == 0 &&
		s.Truth[config.Unexpected] == 0 && s.Truth[config.Active] == s.Desired
	return s, nil
}

func (s Snapshot) line(elapsed time.Duration) string {
	mark := "≠"
	if s.Match() {
		mark = "="
	}
	f := func(m map[config.Count]int64) string {
		return fmt.Sprintf("active=%-3d completing=%-3d completed=%-3d unexpected=%-3d",
			m[config.Active], m[config.Completing], m[config.Completed], m[config.Unexpected])
	}
	line := fmt.Sprintf("%5.1fs desired=%-3d tally: %s %s list: %s", elapsed.Seconds(), s.Desired, f(s.Tally), mark, f(s.Truth))
	if s.Totals != nil {
		line += fmt.Sprintf(" | totals: completed=%-3d unexpected=%-3d finished: completed=%-3d unexpected=%-3d",
			s.Totals[config.CompletedTotal], s.Totals[config.UnexpectedTotal], s.Finished[config.CompletedTotal], s.Finished[config.UnexpectedTotal])
	}
	return line
}

// Applies returns how many status applies the running aggregator has sent.
func (d *Demo) Applies(ctx context.Context) (float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+d.aggregatorMetrics+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "tally_aggregator_applies_total{") {
			return strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		}
	}
	return 0, sc.Err()
}

// webhookCalls says how many pod admissions the API server sent to tally's
// webhook, by operation, as it counts them
// (apiserver_admission_webhook_request_total).
func (d *Demo) webhookCalls(ctx context.Context) (string, error) {
	cs, err := kubernetes.NewForConfig(d.restConfig)
	if err != nil {
		return "", err
	}
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return "", err
	}
	sent := map[string]float64{}
	for line := range strings.Lines(string(raw)) {
		if !strings.HasPrefix(line, "apiserver_admission_webhook_request_total{") || !strings.Contains(line, `name="pods.tally.dev"`) {
			continue
		}
		i := strings.Index(line, `operation="`)
		if i < 0 {
			continue
		}
		op := line[i+len(`operation="`):]
		op = op[:strings.IndexByte(op, '"')]
		v, err := strconv.ParseFloat(strings.TrimSpace(line[strings.LastIndexByte(line, ' ')+1:]), 64)
		if err != nil {
			return "", fmt.Errorf("parsing %q: %w", line, err)
		}
		sent[op] += v
	}
	return fmt.Sprintf("the API server called the webhook for %.0f pod CREATEs and %.0f UPDATEs", sent["CREATE"], sent["UPDATE"]), nil
}

var errMismatch = errors.New("tally's counts do not equal the truth")

// Run drives the scenario for Options.Duration while printing progress,
// then waits for quiescence and prints the verdict. It returns an error
// when tally's counts differ from the truth at quiescence.
func (d *Demo) Run(ctx context.Context) error {
	start := time.Now()
	stopDisplay := d.display(ctx, start)
	err := d.scenario(ctx)
	if err == nil {
		err = d.Converge(ctx, 60*time.Second)
	}
	stopDisplay()
	if err != nil {
		if errors.Is(err, errMismatch) {
			fmt.Fprintf(d.opts.Out, "verdict: FAIL: %v\n", err)
		}
		return err
	}
	return d.Verdict(ctx)
}

func (d *Demo) scenario(ctx context.Context) error {
	dur := d.opts.Duration
	at := func(frac float64, plus time.Duration) <-chan time.Time {
		return time.After(time.Duration(frac*float64(dur)) + plus)
	}
	d.say("creating WorkerPool %s/%s with 20 replicas", Namespace, Pool)
	if err := d.client.Create(ctx, builder.WorkerPool(Namespace, Pool, 20)); err != nil {
		return err
	}
	steps := []struct {
		at   <-chan time.Time
		what string
		do   func() error
	}{
		{at(0.25, 0), "the timer scales down to 8: the operator marks 12 pods scale-down", func() error { return d.SetReplicas(ctx, 8) }},
		// Marked pods take 0.5 to 3 s to exit: scale up while they do.
		{at(0.25, 1200*time.Millisecond), "scale-up to 12 in the middle of the scale-down", func() error { return d.SetReplicas(ctx, 12) }},
		{at(0.6, 0), "the timer scales down to 6", func() error { return d.SetReplicas(ctx, 6) }},
		{at(0.8, 0), "scale-up to 10", func() error { return d.SetReplicas(ctx, 10) }},
		{at(1, 0), "scenario over: no more disruptions; waiting for quiescence", func() error { return nil }},
	}
	disrupt := time.NewTicker(dur / 12)
	defer disrupt.Stop()
	disruptFrom, disruptTo := time.Now().Add(dur/5), time.Now().Add(dur*3/4)
	for _, step := range steps {
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-step.at:
				d.say("%s", step.what)
				if err := step.do(); err != nil {
					return err
				}
				waiting = false
			case now := <-disrupt.C:
				if now.After(disruptFrom) && now.Before(disruptTo) {
					d.disrupt(ctx)
				}
			}
		}
	}
	return nil
}

// disrupt deletes or fails a random running pod without intent, as a node
// loss or a crash would.
func (d *Demo) disrupt(ctx context.Context) {
	var pods corev1.PodList
	if err := d.client.List(ctx, &pods, client.InNamespace(Namespace)); err != nil {
		return
	}
	var running []corev1.Pod
	for _, p := range pods.Items {
		if _, marked := p.Annotations[keys.CompletionIntent]; !marked && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
			running = append(running, p)
		}
	}
	if len(running) == 0 {
		return
	}
	p := running[d.rng.IntN(len(running))]
	if d.opts.Cluster != nil || d.rng.IntN(2) == 0 {
		d.say("pod %s deleted unexpectedly", p.Name)
		_ = d.client.Delete(ctx, &p)
		return
	}
	d.say("pod %s crashed (phase Failed)", p.Name)
	_ = setPhase(ctx, d.client, &p, corev1.PodFailed)
}

// Converge waits until the pool is settled and tally's values equal the
// truth; it returns errMismatch if they do not within timeout.
func (d *Demo) Converge(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		s, err := d.Snapshot(ctx)
		if err != nil {
			return err
		}
		if s.Settled && s.Match() {
			return nil
		}
		if time.Now().After(deadline) {
			if !s.Settled {
				return fmt.Errorf("%w: the pool did not settle within %s: %s", errMismatch, timeout, s.line(0))
			}
			return fmt.Errorf("%w within %s: %s", errMismatch, timeout, s.line(0))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Verdict prints whether tally's counts equal the truth now, and returns
// an error when they do not.
func (d *Demo) Verdict(ctx context.Context) error {
	s, err := d.Snapshot(ctx)
	if err != nil {
		return err
	}
	if !s.Match() {
		fmt.Fprintf(d.opts.Out, "verdict: FAIL: tally's counts differ from a fresh List, or its totals from the pods seen finishing\n  %s\n", s.line(0))
		return errMismatch
	}
	sent := ""
	if d.opts.Cluster == nil {
		applies, err := d.Applies(ctx)
		if err != nil {
			return fmt.Errorf("reading the aggregator's metrics: %w", err)
		}
		sent = fmt.Sprintf("; the aggregator sent %.0f server-side applies", applies)
	}
	calls, err := d.webhookCalls(ctx)
	if err != nil {
		return fmt.Errorf("reading the API server's metrics: %w", err)
	}
	sent += "; " + calls
	totals := ""
	if s.Totals != nil {
		totals = fmt.Sprintf("; its totals equal the pods seen finishing, deleted ones included (completedTotal=%d unexpectedTotal=%d)",
			s.Totals[config.CompletedTotal], s.Totals[config.UnexpectedTotal])
	}
	fmt.Fprintf(d.opts.Out, "verdict: PASS: tally's counts equal a fresh List (active=%d completing=%d completed=%d unexpected=%d)%s%s. Logs: %s\n",
		s.Tally[config.Active], s.Tally[config.Completing], s.Tally[config.Completed], s.Tally[config.Unexpected], totals, sent, d.logDir)
	return nil
}

// display prints one progress line a second until the returned func is
// called.
func (d *Demo) display(ctx context.Context, start time.Time) func() {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				if d.opts.Redraw {
					fmt.Fprintln(d.opts.Out)
				}
				return
			case <-tick.C:
				s, err := d.Snapshot(ctx)
				if err != nil {
					continue
				}
				if d.opts.Redraw {
					fmt.Fprintf(d.opts.Out, "\r\033[K%s", s.line(time.Since(start)))
				} else {
					fmt.Fprintln(d.opts.Out, s.line(time.Since(start)))
				}
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
	}
}
