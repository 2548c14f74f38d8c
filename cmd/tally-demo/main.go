// Command tally-demo runs tally on a local control plane and drives the
// scale-down scenario of the problem statement (see `make demo`).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/term"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"tally.dev/tally/internal/demo"
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
	flag.Parse()
	if err := run(opts); err != nil {
		fmt.Fprintln(os.Stderr, "tally-demo:", err)
		os.Exit(1)
	}
}

func run(opts demo.Options) (err error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
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
	d, err := demo.Start(ctx, opts)
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("demo: stopping the operator, the aggregator, the webhook and the control plane")
		if stopErr := d.Stop(); stopErr != nil && err == nil {
			err = stopErr
		}
	}()
	return d.Run(ctx)
}
