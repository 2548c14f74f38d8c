// Command tally-demo runs tally on a local control plane and drives the
// scale-down scenario of the problem statement (see `make demo`).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/term"
	"k8s.io/client-go/tools/clientcmd"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/process"
)

func main() {
	duration := 60 * time.Second
	if v := os.Getenv("DEMO_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "tally-demo: DEMO_DURATION=%q: %v\n", v, err)
			os.Exit(2)
		}
		duration = d
	}
	opts := demo.Options{Out: os.Stdout, Redraw: term.IsTerminal(int(os.Stdout.Fd()))}
	flag.DurationVar(&opts.Duration, "duration", duration, "How long the scenario drives changes (also DEMO_DURATION).")
	flag.Uint64Var(&opts.Seed, "seed", uint64(time.Now().UnixNano()), "Seed of the scenario's random choices.")
	flag.StringVar(&opts.Dir, "dir", ".demo", "Directory for the kubeconfig, certificates and logs.")
	flag.StringVar(&opts.BinDir, "bin", "bin", "Directory holding the webhook and aggregator binaries.")
	flag.StringVar(&opts.ConfigFile, "config", "examples/workerpool/config.yaml", "tally configuration file.")
	clusterDir := flag.String("cluster", "", "State directory of a one-node cluster (make cluster-up): install the chart and the example operator there and run the scenario on real pods (make demo DEMO_CLUSTER=real).")
	flag.Parse()
	ctx, interrupted := process.Interruptible()
	err := run(ctx, opts, *clusterDir)
	if sig := interrupted(); sig != nil {
		// Interrupting the demo is normal use: what it started is stopped
		// by now (run's deferred calls), and the exit status is the
		// shell's convention for a command ended by sig.
		fmt.Fprintf(os.Stderr, "tally-demo: %s: the scenario was interrupted before its verdict; everything the demo started has been stopped\n", sig)
		os.Exit(128 + int(sig.(syscall.Signal)))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tally-demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, opts demo.Options, clusterDir string) (err error) {
	fmt.Printf("demo: seed %d, scenario of %s\n", opts.Seed, opts.Duration)
	if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
		return err
	}
	logFile, err := os.Create(filepath.Join(opts.Dir, "demo.log"))
	if err != nil {
		return err
	}
	defer logFile.Close()
	ctrl.SetLogger(zap.New(zap.WriteTo(logFile)))
	if clusterDir != "" {
		if opts.Cluster, err = installOnCluster(ctx, clusterDir, opts.Dir); err != nil {
			return err
		}
		defer func() {
			fmt.Println("demo: helm uninstall, and the operator removed")
			if uninstallErr := opts.Cluster.Uninstall(context.Background()); uninstallErr != nil && err == nil {
				err = uninstallErr
			}
		}()
	}
	d, err := demo.Start(ctx, opts)
	if err != nil {
		return err
	}
	defer func() {
		if opts.Cluster == nil {
			fmt.Println("demo: stopping the operator, the aggregator, the webhook and the control plane")
		} else {
			fmt.Printf("demo: deleting namespace %s\n", demo.Namespace)
		}
		if stopErr := d.Stop(); stopErr != nil && err == nil {
			err = stopErr
		}
	}()
	return d.Run(ctx)
}

// installOnCluster installs tally's chart and the example operator on the
// one-node cluster whose state is in clusterDir.
func installOnCluster(ctx context.Context, clusterDir, dir string) (*demo.Cluster, error) {
	kubeconfig := filepath.Join(clusterDir, "admin.kubeconfig")
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		return nil, err
	}
	values, err := demo.WriteClusterValues(dir, nil)
	if err != nil {
		return nil, err
	}
	cluster := &demo.Cluster{Kubeconfig: kubeconfig, Client: c, Values: values,
		OperatorImage: demo.OperatorImage, WorkerImage: demo.WorkerImage,
		WorkerEnv: []string{"WORKER_CRASH_PERCENT=10"}}
	fmt.Println("demo: helm install tally (certificates.mode=helm) and the example operator on the cluster")
	start := time.Now()
	if err := cluster.Install(ctx); err != nil {
		return nil, err
	}
	fmt.Printf("demo: tally and the operator ready in %v\n", time.Since(start).Round(100*time.Millisecond))
	return cluster, nil
}
