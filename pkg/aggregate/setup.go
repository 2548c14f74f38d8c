package aggregate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/discovery"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// PodSelector selects the pods the aggregator watches: those carrying the
// keys.ParentUID label.
func PodSelector() labels.Selector {
	req, err := labels.NewRequirement(keys.ParentUID, selection.Exists, nil)
	if err != nil {
		panic(err) // the key is a valid label key
	}
	return labels.NewSelector().Add(*req)
}

// CacheOptions returns the manager cache options the aggregator needs: one
// label-selected pod informer whose objects are reduced to *Pod.
func CacheOptions(parents []config.Parent) cache.Options {
	return cache.Options{
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}: {Label: PodSelector(), Transform: NewReducer(parents).Transform},
		},
	}
}

// Options tune the aggregator's controllers.
type Options struct {
	// MaxConcurrentReconciles is how many parents of one kind are reconciled
	// at once. Work on one parent is always serialised.
	MaxConcurrentReconciles int
}

// Setup adds the pod index and one controller per parent kind to mgr, whose
// cache must have been built with CacheOptions. A kind the API server does
// not serve, or serves without a status subresource, is reported (log and
// tally_aggregator_parent_kind_problems) and skipped; the others are served.
// It returns an error only when no kind can be served.
func Setup(ctx context.Context, mgr manager.Manager, parents []config.Parent, opts Options) error {
	log := ctrl.LoggerFrom(ctx)
	informer, err := mgr.GetCache().GetInformer(ctx, &corev1.Pod{})
	if err != nil {
		return fmt.Errorf("creating the pod informer: %w", err)
	}
	if err := informer.AddIndexers(Indexers); err != nil {
		return fmt.Errorf("indexing pods by parent: %w", err)
	}
	indexed, ok := informer.(interface{ GetIndexer() toolscache.Indexer })
	if !ok {
		return fmt.Errorf("the pod informer (%T) exposes no indexer", informer)
	}
	disco, err := discovery.NewDiscoveryClientForConfig(mgr.GetConfig())
	if err != nil {
		return fmt.Errorf("creating discovery client: %w", err)
	}

	served := 0
	for _, p := range parents {
		if problem, err := checkKind(mgr, disco, p); err != nil {
			kindProblems.WithLabelValues(p.GroupKind().String(), problem).Set(1)
			log.Error(err, "Parent kind cannot be served; serving the other kinds", "kind", p.GroupKind().String(), "problem", problem)
			continue
		}
		r := NewReconciler(p, mgr.GetCache(), mgr.GetClient(), indexed.GetIndexer(), mgr.GetEventRecorder(FieldManager))
		parent := &unstructured.Unstructured{}
		parent.SetGroupVersionKind(p.GroupVersionKind())
		err := ctrl.NewControllerManagedBy(mgr).
			Named(strings.ToLower(p.GroupKind().String())).
			Watches(parent, handler.EnqueueRequestsFromMapFunc(r.self)).
			Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(r.parentOf)).
			WithOptions(controller.Options{
				MaxConcurrentReconciles: opts.MaxConcurrentReconciles,
				// Names are unique per manager (the config rejects a kind
				// given twice); the process-wide check would only refuse a
				// second manager in the same process, as tests start.
				SkipNameValidation: ptr.To(true),
				// A first list of many pods can take longer than the
				// default two minutes; no status is written before it ends.
				CacheSyncTimeout: 10 * time.Minute,
			}).
			Complete(r)
		if err != nil {
			return fmt.Errorf("creating the controller of %s: %w", p.GroupKind(), err)
		}
		served++
	}
	if served == 0 {
		return errors.New("no configured parent kind can be served")
	}
	return nil
}

// checkKind confirms that the API server serves the parent kind with a
// status subresource, and returns the problem's name when it does not.
func checkKind(mgr manager.Manager, disco discovery.DiscoveryInterface, p config.Parent) (string, error) {
	mapping, err := mgr.GetRESTMapper().RESTMapping(p.GroupKind(), p.Version)
	if err != nil {
		return "not-served", fmt.Errorf("the API server does not serve %s: %w", p.GroupVersionKind(), err)
	}
	resource := mapping.Resource.Resource
	if p.Resource != "" && p.Resource != resource {
		return "resource-mismatch", fmt.Errorf("%s is served as resource %q, not %q as configured", p.GroupVersionKind(), resource, p.Resource)
	}
	list, err := disco.ServerResourcesForGroupVersion(p.GroupVersionKind().GroupVersion().String())
	if err != nil {
		return "not-served", fmt.Errorf("discovering %s: %w", p.GroupVersionKind().GroupVersion(), err)
	}
	if !slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource+"/status" }) {
		return "no-status-subresource", fmt.Errorf("%s has no status subresource: enable it in the CRD (subresources: {status: {}})", p.GroupVersionKind())
	}
	return "", nil
}
