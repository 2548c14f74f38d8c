// Package smoke checks that the test control plane is real: it serves the
// WorkerPool CRD and records server-side apply field ownership.
package smoke

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, framework.Options{}, &env))
}

func TestStatusApplyRecordsFieldManager(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "smoke")
	require.NoError(t, err)
	pool := builder.WorkerPool(ns, "pool", 3)
	require.NoError(t, env.Client.Create(ctx, pool))

	patch := &unstructured.Unstructured{}
	patch.SetGroupVersionKind(builder.WorkerPoolGVK)
	patch.SetNamespace(ns)
	patch.SetName("pool")
	patch.Object["status"] = map[string]any{"completing": int64(2)}
	require.NoError(t, env.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(patch),
		client.FieldOwner("tally-aggregator"), client.ForceOwnership))

	got := &unstructured.Unstructured{}
	got.SetGroupVersionKind(builder.WorkerPoolGVK)
	require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pool"}, got))
	completing, _, _ := unstructured.NestedInt64(got.Object, "status", "completing")
	assert.Equal(t, int64(2), completing)

	var owner string
	for _, mf := range got.GetManagedFields() {
		if mf.Subresource == "status" && mf.FieldsV1 != nil && mf.FieldsV1.GetRawString() == `{"f:status":{"f:completing":{}}}` {
			owner = mf.Manager
		}
	}
	assert.Equal(t, "tally-aggregator", owner, "managedFields: %+v", got.GetManagedFields())
}
