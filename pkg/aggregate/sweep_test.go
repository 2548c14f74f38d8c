package aggregate

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
)

// TestASweepSkipsARefusedNamespace: with a fixed list of namespaces, a
// sweep that may not list the pods of one (its Role missing) sweeps the
// others, keeps what it held of the refused one, and does not count it as
// swept until a sweep can list it: its parents are not written before.
func TestASweepSkipsARefusedNamespace(t *testing.T) {
	parent := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Counts: map[config.Count]string{config.Active: "status.active"}}
	pod := func(ns string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p", UID: types.UID("uid-" + ns),
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "pool", UID: types.UID("pool-" + ns), Controller: ptr.To(true)}}}}
	}
	refusing := false
	reader := fake.NewClientBuilder().
		WithObjects(pod("aa"), pod("bb"), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "aa"}}, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bb"}}).
		// The phases the sweep lists by (none terminal here).
		WithIndex(&corev1.Pod{}, "status.phase", func(o client.Object) []string {
			if p, ok := o.(*corev1.Pod); ok {
				return []string{string(p.Status.Phase)}
			}
			return nil
		}).
		WithInterceptorFuncs(interceptor.Funcs{List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
			var o client.ListOptions
			o.ApplyOptions(opts)
			if refusing && o.Namespace == "bb" {
				return apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", nil)
			}
			return c.List(ctx, list, opts...)
		}}).Build()
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	b := NewBackfill(mutate.NewMutator([]config.Parent{parent}, nil), reader, reader, indexer, func(context.Context) bool { return true }, time.Hour, logr.Discard())
	b.within = []string{"aa", "bb"}
	ctx := context.Background()

	_, err := b.Sweep(ctx)
	require.NoError(t, err)
	assert.True(t, b.Swept("aa"))
	assert.True(t, b.Swept("bb"))
	assert.Len(t, b.Unstamped.in([]string{"bb"}), 1, "the pod of bb held")

	// A new namespace refused from the start is not swept.
	b2 := NewBackfill(mutate.NewMutator([]config.Parent{parent}, nil), reader, reader, indexer, func(context.Context) bool { return true }, time.Hour, logr.Discard())
	b2.within = []string{"aa", "bb"}
	refusing = true
	_, err = b2.Sweep(ctx)
	require.NoError(t, err, "a refused namespace fails no sweep")
	assert.True(t, b2.Swept("aa"))
	assert.False(t, b2.Swept("bb"), "a namespace refused is not swept")
	assert.True(t, b2.refusedLast.Load(), "the next sweep comes sooner")

	// Refused after it was read once: what was held there is kept.
	_, err = b.Sweep(ctx)
	require.NoError(t, err)
	assert.Len(t, b.Unstamped.in([]string{"bb"}), 1, "the pod of bb still held")
	assert.Empty(t, b.Unstamped.in([]string{"aa"}), "the pod of aa, stamped by the first sweep, is no longer unlabelled")

	refusing = false
	_, err = b2.Sweep(ctx)
	require.NoError(t, err)
	assert.True(t, b2.Swept("bb"))
	assert.False(t, b2.refusedLast.Load())
}
