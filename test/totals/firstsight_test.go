package totals

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/framework"
)

// TestIntentTallyNeverSawIsUnexpected: a tracked pod marked while its
// namespace is out of the webhook's scope (no -at, -by) that fails before
// tally judged the intent counts in unexpectedTotal, as in its counts: the
// intent first seen on a finished pod is not admitted, whichever read the
// recording confirms it with.
func TestIntentTallyNeverSawIsUnexpected(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	startWebhook(t, ns, withTotals)
	_, pods := createPool(t, ns, "pool", 2)
	startAggregator(t, "a", withTotals, "")
	time.Sleep(3 * time.Second)

	scope := func(in bool) {
		nsObj := &corev1.Namespace{}
		require.NoError(t, env.Client.Get(ctx, client.ObjectKey{Name: ns}, nsObj))
		if in {
			nsObj.Labels[framework.NamespaceLabel] = ns
		} else {
			delete(nsObj.Labels, framework.NamespaceLabel)
		}
		require.NoError(t, env.Client.Update(ctx, nsObj))
		time.Sleep(time.Second) // the API server's namespace informer follows
	}
	scope(false)
	require.NoError(t, mark(ctx, pods[0]))
	scope(true)
	marked := &corev1.Pod{}
	require.NoError(t, env.Client.Get(ctx, client.ObjectKeyFromObject(pods[0]), marked))
	require.NotContains(t, marked.Annotations, keys.CompletionIntentAt, "the mark was not seen by the webhook")
	// Admitted by the webhook, for comparison.
	require.NoError(t, mark(ctx, pods[1]))

	for _, p := range pods {
		require.NoError(t, env.Client.Status().Patch(ctx, p.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(`{"status":{"phase":"Failed"}}`))))
	}
	require.Eventually(t, func() bool {
		c, x, ledger := totals(t, ns, "pool")
		return c+x == 2 && ledger == 0
	}, 30*time.Second, 200*time.Millisecond, "both pods recorded")
	c, x, _ := totals(t, ns, "pool")
	assert.Equal(t, int64(1), c, "completedTotal: the intent the webhook admitted")
	assert.Equal(t, int64(1), x, "unexpectedTotal: the intent tally first saw on a failed pod")
}
