package chart

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

var env *framework.Env

func TestMain(m *testing.M) {
	os.Exit(framework.Main(m, controlplane.Options{CRDPaths: []string{framework.CertManagerCRDs()}}, &env))
}

// TestServerSideDryRun sends every rendered object to the API server as a
// dry-run create: each one, Issuer and Certificate included, is validated by
// a real API server.
func TestServerSideDryRun(t *testing.T) {
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
	require.NoError(t, client.IgnoreAlreadyExists(env.Client.Create(ctx, ns)))
	for _, values := range [][]string{nil, {"helm-certs.yaml"}, {"two-parents.yaml"}, {sampleValues}} {
		t.Run(fmt.Sprint(values), func(t *testing.T) {
			objs := objects(t, render(t, values...))
			require.NotEmpty(t, objs)
			for _, obj := range objs {
				err := env.Client.Create(ctx, obj, client.DryRunAll)
				assert.NoError(t, err, "%s %s", obj.GetKind(), obj.GetName())
			}
		})
	}
}

// TestRenderedWebhookRegistration registers the rendered
// MutatingWebhookConfiguration, pointed at a webhook served by the test: an
// unrelated pod and a pod its operator stamped are admitted without the
// webhook being called, a tracked pod is stamped, and no pod of the
// release namespace reaches the webhook.
func TestRenderedWebhookRegistration(t *testing.T) {
	ctx := context.Background()
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	require.True(t, find(t, objects(t, render(t)), "MutatingWebhookConfiguration", "tally", &mwc))

	ca, err := devcert.NewCA("chart test CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	require.NoError(t, err)
	var calls atomic.Int32
	handler := mutate.NewHandler(mutate.NewMutator([]config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}}, nil), logr.Discard())
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		handler.ServeHTTP(w, r)
	}))
	cert, err := tls.X509KeyPair(pair.CertPEM, pair.KeyPEM)
	require.NoError(t, err)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	srv.StartTLS()
	defer srv.Close()

	mwc.Annotations = nil
	mwc.Webhooks[0].ClientConfig = admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To(srv.URL + mutate.Path), CABundle: ca.CertPEM,
	}
	require.NoError(t, env.Client.Create(ctx, &mwc))
	defer func() { _ = env.Client.Delete(ctx, &mwc) }()

	ns, err := env.Namespace(ctx, "apps")
	require.NoError(t, err)
	// The registration is live once a tracked pod reaches the webhook.
	require.Eventually(t, func() bool {
		pod := builder.Pod(ns, "probe-"+fmt.Sprint(time.Now().UnixNano())).ControlledBy(operator.GVK, "pool", "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").Build()
		return env.Client.Create(ctx, pod) == nil && pod.Labels[keys.ParentUID] != ""
	}, 10*time.Second, 100*time.Millisecond)

	before := calls.Load()
	plain := builder.Pod(ns, "unrelated").Label("app", "web").Build()
	require.NoError(t, env.Client.Create(ctx, plain))
	assert.Equal(t, before, calls.Load(), "the webhook was called for an unrelated pod")
	assert.Equal(t, map[string]string{"app": "web"}, plain.Labels)

	tracked := builder.Pod(ns, "tracked").ControlledBy(operator.GVK, "pool", "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").Build()
	require.NoError(t, env.Client.Create(ctx, tracked))
	assert.Greater(t, calls.Load(), before)
	assert.Equal(t, "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a", tracked.Labels[keys.ParentUID])
	assert.Equal(t, "WorkerPool.example.tally.dev/pool", tracked.Annotations[keys.Parent])

	before = calls.Load()
	stamped := builder.Pod(ns, "stamped").ControlledBy(operator.GVK, "pool", "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").Build()
	identity.Stamp(stamped)
	require.NoError(t, env.Client.Create(ctx, stamped))
	assert.Equal(t, before, calls.Load(), "the webhook was called for a pod its operator stamped")

	// No pod of the release namespace reaches the webhook: tally's own
	// pods start while it is down, even with a tally.dev/ annotation on
	// their template (which the match conditions would otherwise send).
	sys := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
	require.NoError(t, client.IgnoreAlreadyExists(env.Client.Create(ctx, sys)))
	before = calls.Load()
	own := builder.Pod(namespace, "tally-webhook-0").ControlledBy(schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "ReplicaSet"}, "tally-webhook-7d9f8", "3f0c2a8e-0000-4000-8000-000000000001").
		Annotation("tally.dev/restarted-at", "2026-12-02T13:00:00Z").Build()
	require.NoError(t, env.Client.Create(ctx, own))
	inRelease := builder.Pod(namespace, "tracked").ControlledBy(operator.GVK, "pool", "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a").Build()
	require.NoError(t, env.Client.Create(ctx, inRelease))
	assert.Equal(t, before, calls.Load(), "the webhook was called for a pod of the release namespace")
	assert.Empty(t, inRelease.Labels[keys.ParentUID], "a pod of the release namespace was stamped")
}
