package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/cli-runtime/pkg/genericiooptions"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// runUninstall measures what the chart's uninstall hook does once tally is
// stopped: `kubectl tally finalizers remove -A` over total pods carrying the
// tracking finalizer, with the hook's settings, against a baseline of the
// previous ones (client-go's 5 requests a second, one pod at a time) over
// baseline pods.
func runUninstall(ctx context.Context, env *framework.Env, total, baseline int) error {
	admin, err := env.AddUser(envtest.User{Name: "bench-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "tally-bench-uninstall")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := controlplane.WriteKubeconfig(admin, kubeconfig); err != nil {
		return err
	}
	measure := func(name string, n int, args ...string) (float64, error) {
		start := time.Now()
		var creates []func() error
		for i := range n {
			pod := builder.RealisticPod(builder.Pod(ns, fmt.Sprintf("%s-%05d", name, i)))
			pod.GenerateName = ""
			pod.Finalizers = []string{keys.TrackingFinalizer}
			creates = append(creates, func() error { return env.Client.Create(ctx, pod) })
		}
		if err := parallel(16, creates); err != nil {
			return 0, err
		}
		fmt.Printf("%s: created %d pods carrying %s in %s\n", name, n, keys.TrackingFinalizer, time.Since(start).Round(time.Millisecond))
		var out bytes.Buffer
		start = time.Now()
		code := app.Main(append([]string{"--kubeconfig", kubeconfig, "finalizers", "remove", "-A"}, args...),
			genericiooptions.IOStreams{In: os.Stdin, Out: &out, ErrOut: &out})
		took := time.Since(start)
		if code != app.ExitOK {
			return 0, fmt.Errorf("%s: kubectl tally finalizers remove exited %d: %s", name, code, out.String())
		}
		rate := float64(n) / took.Seconds()
		fmt.Printf("%s: %d pods released in %s (%.0f pods/s) with %v\n", name, n, took.Round(time.Millisecond), rate, args)
		return rate, nil
	}
	base, err := measure("baseline", baseline, "--qps", "5", "--burst", "10", "--parallel", "1")
	if err != nil {
		return err
	}
	hook, err := measure("hook", total)
	if err != nil {
		return err
	}
	fmt.Printf("the hook's settings release %.1fx as many pods a second as the baseline\n", hook/base)
	return nil
}
