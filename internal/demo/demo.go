// Package demo runs tally for real on a local control plane: kube-apiserver
// and etcd built from source, the webhook and aggregator binaries as child
// processes, the example WorkerPool operator, and a simulated kubelet. It
// drives the scale-down scenario of the problem statement and compares, at
// quiescence, what tally wrote with counts from a fresh List. `make demo`
// and the end-to-end test both run it.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
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
	env    *controlplane.Env
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
	totals   bool
	finished *Finished
	// custom are the pool's custom counts, evaluated by the demo on a
	// fresh List as tally does on its cache.
	custom []customCount
	// unkept are its custom counts tally cannot keep: their fields stay
	// unwritten.
	unkept    []unkeptCount
	stopWatch context.CancelFunc
	// timeline records the run for its plot.
	timeline *timeline
	// late counts the marks of pods that had just finished (markLate).
	late lateMarks
	// legacyPath is the field the pool's counter kept the old way writes,
	// when the configuration compares the pool's completing count with it
	// (not on a cluster); legacy is that counter, once started.
	legacyPath string
	legacy     *legacyCounter
	stopLegacy context.CancelFunc
}

// Kubeconfig returns the path of the kubeconfig that reaches the demo's
// API server.
func (d *Demo) Kubeconfig() string { return d.kubeconfig }

// AggregatorMetrics returns the running aggregator's metrics address
// (host:port, plain HTTP).
func (d *Demo) AggregatorMetrics() string { return d.aggregatorMetrics }

// LogDir returns the folder of the processes' logs (<name>.log).
func (d *Demo) LogDir() string { return d.logDir }

// Installed is a control plane with tally installed, for Options.Installed.
type Installed struct {
	// Env is the control plane; the demo does not stop it.
	Env *controlplane.Env
	// AggregatorMetrics is the running aggregator's metrics address
	// (host:port, plain HTTP), from which the verdict counts its applies.
	AggregatorMetrics string
}

func (d *Demo) say(format string, args ...any) {
	fmt.Fprintf(d.opts.Out, "demo: "+format+"\n", args...)
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

// Run drives the scenario for Options.Duration while printing progress,
// then waits for quiescence and prints the verdict. It returns an error
// when tally's counts differ from the truth at quiescence.
func (d *Demo) Run(ctx context.Context) (err error) {
	start := time.Now()
	d.timeline = newTimeline(start)
	defer func() { d.writePlot(err) }()
	stopDisplay := d.display(ctx, start)
	err = d.scenario(ctx)
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
