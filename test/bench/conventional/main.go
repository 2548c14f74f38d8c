// Command conventional is the controller an operator author would write
// without tally, the baseline of `make bench-scale`: a controller-runtime
// manager caching whole pods, a field index by controller owner UID, and a
// reconciler that counts each WorkerPool's pods with the same rules and
// merge-patches the counts into its status when they differ.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
)

const ownerIndex = "metadata.controllerUID"

func main() {
	probe := flag.String("health-probe-bind-address", ":8081", "address of /readyz")
	qps := flag.Float64("kube-api-qps", 50, "requests per second to the API server")
	burst := flag.Int("kube-api-burst", 100, "burst above --kube-api-qps")
	flag.Parse()
	if err := run(*probe, float32(*qps), *burst); err != nil {
		fmt.Fprintln(os.Stderr, "conventional:", err)
		os.Exit(1)
	}
}

func run(probe string, qps float32, burst int) error {
	cfg := ctrl.GetConfigOrDie()
	cfg.QPS, cfg.Burst = qps, burst
	mgr, err := ctrl.NewManager(cfg, manager.Options{Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: probe})
	if err != nil {
		return err
	}
	ctx := ctrl.SetupSignalHandler()
	if err := mgr.GetFieldIndexer().IndexField(ctx, &corev1.Pod{}, ownerIndex, func(o client.Object) []string {
		if ref := metav1.GetControllerOf(o); ref != nil {
			return []string{string(ref.UID)}
		}
		return nil
	}); err != nil {
		return err
	}
	pool := &unstructured.Unstructured{}
	pool.SetGroupVersionKind(operator.GVK)
	err = ctrl.NewControllerManagedBy(mgr).For(pool).
		Watches(&corev1.Pod{}, handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), pool, handler.OnlyControllerOwner())).
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Complete(reconcile.Func(func(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
			return reconcileOne(ctx, mgr.GetClient(), req)
		}))
	if err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("synced", func(r *http.Request) error {
		if !mgr.GetCache().WaitForCacheSync(r.Context()) {
			return fmt.Errorf("caches not synced")
		}
		return nil
	}); err != nil {
		return err
	}
	return mgr.Start(ctx)
}

func reconcileOne(ctx context.Context, c client.Client, req reconcile.Request) (reconcile.Result, error) {
	pool := &unstructured.Unstructured{}
	pool.SetGroupVersionKind(operator.GVK)
	if err := c.Get(ctx, req.NamespacedName, pool); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(req.Namespace), client.MatchingFields{ownerIndex: string(pool.GetUID())}); err != nil {
		return reconcile.Result{}, err
	}
	counts := truth.Counts(pods.Items, req.Namespace, pool.GetUID())
	status := map[string]int64{}
	differs := false
	for _, name := range config.Counts {
		status[string(name)] = counts[name]
		v, found, _ := unstructured.NestedInt64(pool.Object, "status", string(name))
		differs = differs || !found || v != counts[name]
	}
	if !differs {
		return reconcile.Result{}, nil
	}
	patch, err := json.Marshal(map[string]any{"status": status})
	if err != nil {
		return reconcile.Result{}, err
	}
	return reconcile.Result{}, c.Status().Patch(ctx, pool, client.RawPatch("application/merge-patch+json", patch))
}
