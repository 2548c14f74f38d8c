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

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, controlplane.Options{}, &env))
}

func TestStatusApplyRecordsFieldManager(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "smoke")
	require.NoError(t, err)
	pool := operator.Pool(ns, "pool", 3)
	require.NoError(t, env.Client.Create(ctx, pool))

	patch := &unstructured.Unstructured{}
	patch.SetGroupVersionKind(operator.GVK)
	patch.SetNamespace(ns)
	patch.SetName("pool")
	patch.Object["status"] = map[string]any{"completing": int64(2)}
	require.NoError(t, env.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(patch),
		client.FieldOwner("tally-aggregator"), client.ForceOwnership))

	got := &unstructured.Unstructured{}
	got.SetGroupVersionKind(operator.GVK)
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
