package smoke

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

// TestReleaseNamesThePodByUID: a release of the tracking finalizer that
// arrives after its pod is gone and a new pod took the name (an operator
// recreating workers-0) leaves the new pod's finalizer alone and still
// counts as released; the new pod's own release removes it.
func TestReleaseNamesThePodByUID(t *testing.T) {
	ctx := context.Background()
	ns, err := env.Namespace(ctx, "release")
	require.NoError(t, err)
	create := func() *corev1.Pod {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "workers-0", Finalizers: []string{keys.TrackingFinalizer}},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "w", Image: "worker"}}},
		}
		require.NoError(t, env.Client.Create(ctx, pod))
		return pod
	}
	release := func(uid types.UID) error {
		meta := &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "workers-0"}}
		return env.Client.Patch(ctx, meta, client.RawPatch(types.StrategicMergePatchType, aggregate.ReleasePatch(uid)))
	}

	first := create()
	require.NoError(t, env.Client.Delete(ctx, first))
	require.NoError(t, release(first.UID))
	require.Eventually(t, func() bool {
		err := env.Client.Get(ctx, client.ObjectKeyFromObject(first), &corev1.Pod{})
		return client.IgnoreNotFound(err) == nil && err != nil
	}, 10*time.Second, 50*time.Millisecond, "the first pod is not gone once released")

	second := create()
	err = release(first.UID) // late: the first pod's release again
	assert.Error(t, err, "a release naming the first pod's UID changed the second pod")
	assert.True(t, aggregate.Released(err), "the first pod's release counts as done: %v", err)
	var got corev1.Pod
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(second), &got))
	assert.Equal(t, []string{keys.TrackingFinalizer}, got.Finalizers, "the second pod lost its finalizer to the first pod's release")

	require.NoError(t, release(second.UID))
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(second), &got))
	assert.Empty(t, got.Finalizers)

	// Another refusal is not a release.
	assert.False(t, aggregate.Released(client.IgnoreNotFound(env.Client.Patch(ctx, &got, client.RawPatch(types.JSONPatchType, []byte(`[{"op":"test","path":"/metadata/name","value":"x"}]`))))))
}
