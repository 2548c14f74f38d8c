// Command operator runs the WorkerPool example operator in a cluster (or
// against --kubeconfig): it keeps spec.replicas worker pods per pool, asks
// surplus ones to complete and stops them, and leaves every count to tally.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate"
)

func main() {
	image := flag.String("worker-image", "", "the worker pods' image")
	var env envFlag
	flag.Var(&env, "worker-env", "NAME=VALUE added to every worker's environment (repeatable)")
	probe := flag.String("health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	if *image == "" {
		fmt.Fprintln(os.Stderr, "operator: --worker-image is required")
		os.Exit(2)
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))

	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), manager.Options{
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: *probe,
		// The operator needs only the pods tally stamped.
		Cache: cache.Options{ByObject: map[client.Object]cache.ByObject{&corev1.Pod{}: {Label: aggregate.PodSelector()}}},
	})
	if err == nil {
		err = (&operator.Reconciler{Client: mgr.GetClient(), Image: *image, WorkerEnv: env, StopMarked: true}).SetupWithManager(mgr)
	}
	if err == nil {
		err = mgr.AddReadyzCheck("ping", healthz.Ping)
	}
	if err == nil {
		err = mgr.Start(ctrl.SetupSignalHandler())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "operator:", err)
		os.Exit(1)
	}
}

// envFlag collects NAME=VALUE flags.
type envFlag []corev1.EnvVar

func (e *envFlag) String() string { return fmt.Sprint(*e) }

func (e *envFlag) Set(v string) error {
	name, value, ok := strings.Cut(v, "=")
	if !ok || name == "" {
		return fmt.Errorf("%q is not NAME=VALUE", v)
	}
	*e = append(*e, corev1.EnvVar{Name: name, Value: value})
	return nil
}
