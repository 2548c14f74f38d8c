package completeness

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	aggregatorapp "tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// TestFirstSight: pods changed while tally could not see them are judged
// when it first does, by the same rules as the pods it watched all along.
// While out of view, a pod of the parent fails and is then marked (a late
// intent), two are created marked with forged -at/-by stamps (one with an
// invalid reason), and an ownerless pod is created the same way. Once in
// view: the late intent is removed and its pod counts as unexpected, and no
// path admits an intent on it later; the running pod's intent is admitted
// as first seen now by no one observed; the invalid one is removed; and the
// ownerless pod's intent can be removed, as tally does not track it.
func TestFirstSight(t *testing.T) {
	rcOnly := []config.Parent{{Version: "v1", Kind: "ReplicationController"}}
	tests := []struct {
		name string
		// hide makes ns's pods unseen by tally; reveal ends it.
		hide, reveal func(t *testing.T, ns string, w *webhook)
	}{{
		name: "a namespace labelled into scope",
		hide: func(t *testing.T, ns string, w *webhook) {
			w.start(t)
			w.register(t, ns, admissionregistrationv1.Fail)
			label(t, ns, false)
		},
		reveal: func(t *testing.T, ns string, w *webhook) { label(t, ns, true) },
	}, {
		name: "a kind added to parents after its pods finished",
		hide: func(t *testing.T, ns string, w *webhook) {
			w.parents = rcOnly
			w.start(t)
			w.register(t, ns, admissionregistrationv1.Fail)
		},
		reveal: func(t *testing.T, ns string, w *webhook) {
			w.stop()
			w.parents = nil
			w.start(t)
		},
	}, {
		name: "an outage under failurePolicy Ignore",
		hide: func(t *testing.T, ns string, w *webhook) {
			w.register(t, ns, admissionregistrationv1.Ignore)
		},
		reveal: func(t *testing.T, ns string, w *webhook) { w.start(t) },
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t)
			w := newWebhook(t)
			tc.hide(t, ns, w)
			uid := createPool(t, ns, "pool")
			member := func(name string) *builder.PodBuilder {
				return builder.Pod(ns, name).ControlledBy(operator.GVK, "pool", uid)
			}
			forge := func(b *builder.PodBuilder, reason string) *corev1.Pod {
				return b.Annotation(keys.CompletionIntent, reason).
					Annotation(keys.CompletionIntentAt, "2001-01-01T00:00:00Z").Annotation(keys.CompletionIntentBy, "mallory").Build()
			}
			createAll(t, env.Client, []*corev1.Pod{
				member("late").Phase(corev1.PodFailed).Build(),
				forge(member("forged"), "drain"),
				forge(member("invalid"), "Not A Token"),
				forge(builder.Pod(ns, "ownerless"), "drain"),
			})
			mark(t, ns, "late", `"scale-down"`)

			tc.reveal(t, ns, w)
			scope := &metav1.LabelSelector{MatchLabels: map[string]string{framework.NamespaceLabel: ns}}
			runAggregator(t, &config.Config{Parents: workerPools, NamespaceSelector: scope}, aggregatorapp.Options{
				MetricsAddr: "0", ProbeAddr: "0", MaxConcurrentReconciles: 4, BackfillInterval: time.Second, QPS: 50, Burst: 100,
			})
			stamps(t, ns)
			converges(t, ns, "pool", uid, 30*time.Second)
			assert.Equal(t, map[config.Count]int64{config.Completing: 1, config.Completed: 0, config.Active: 1, config.Unexpected: 1},
				shown(t, ns, "pool"), "the late intent and the invalid one are not admitted")

			late, forged, invalid := get(t, ns, "late"), get(t, ns, "forged"), get(t, ns, "invalid")
			assert.NotContains(t, late.Annotations, keys.CompletionIntent, "a late intent first seen is removed")
			assert.NotContains(t, late.Annotations, keys.CompletionIntentAt)
			assert.NotContains(t, invalid.Annotations, keys.CompletionIntent, "an invalid reason first seen is removed")
			assert.NotContains(t, invalid.Annotations, keys.CompletionIntentBy)
			assert.Equal(t, "drain", forged.Annotations[keys.CompletionIntent])
			assert.Equal(t, mutate.UnobservedRequester, forged.Annotations[keys.CompletionIntentBy], "the client's -by is overwritten")
			at, err := time.Parse(time.RFC3339, forged.Annotations[keys.CompletionIntentAt])
			require.NoError(t, err)
			assert.WithinDuration(t, time.Now(), at, time.Minute, "the client's -at is overwritten with the time tally first saw it")

			// No path admits an intent on the late pod now.
			err = env.Client.Patch(ctx, late, client.RawPatch(types.MergePatchType,
				[]byte(`{"metadata":{"annotations":{"tally.dev/completion-intent":"drain"}}}`)))
			require.True(t, apierrors.IsForbidden(err), "marking the finished pod again: %v", err)
			assert.Contains(t, err.Error(), "cannot be set on a pod that has finished")

			// An ownerless pod is not tracked: no request about it is refused.
			mark(t, ns, "ownerless", "null")
			ownerless := get(t, ns, "ownerless")
			assert.NotContains(t, ownerless.Annotations, keys.CompletionIntent)
		})
	}
}

// label puts namespace ns in the test's webhook's scope, or out of it.
func label(t *testing.T, ns string, in bool) {
	t.Helper()
	nsObj := &corev1.Namespace{}
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Name: ns}, nsObj))
	if in {
		nsObj.Labels[framework.NamespaceLabel] = ns
	} else {
		delete(nsObj.Labels, framework.NamespaceLabel)
	}
	require.NoError(t, env.Client.Update(context.Background(), nsObj))
	time.Sleep(time.Second) // the API server's namespace informer follows
}

// mark sets the intent of pod ns/name to reason, a JSON value (null removes
// it), with a merge patch.
func mark(t *testing.T, ns, name, reason string) {
	t.Helper()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	require.NoError(t, env.Client.Patch(context.Background(), pod, client.RawPatch(types.MergePatchType,
		[]byte(`{"metadata":{"annotations":{"tally.dev/completion-intent":`+reason+`}}}`))), "marking %s with %s", name, reason)
}

func get(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{}
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, pod))
	return pod
}
