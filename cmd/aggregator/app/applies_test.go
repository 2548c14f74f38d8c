package app

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"tally.dev/tally/pkg/aggregate"
)

// TestStatusAppliesAreSentOnce: an API server that answers status applies
// 429 with Retry-After gets each apply once, and the client sees the 429
// at once (client-go would resend the same, ageing counts for ten
// seconds); other requests keep client-go's retries.
func TestStatusAppliesAreSentOnce(t *testing.T) {
	var applies, updates atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPatch && r.URL.Path == "/apis/example.tally.dev/v1/namespaces/ns/workerpools/pool/status" {
			applies.Add(1)
		} else {
			updates.Add(1)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"TooManyRequests","code":429,"details":{"retryAfterSeconds":1}}`))
	}))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	sendAppliesOnce(cfg)
	c, err := dynamic.NewForConfig(cfg)
	require.NoError(t, err)
	pools := c.Resource(schema.GroupVersionResource{Group: "example.tally.dev", Version: "v1", Resource: "workerpools"}).Namespace("ns")

	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "example.tally.dev/v1", "kind": "WorkerPool",
		"metadata": map[string]any{"name": "pool", "namespace": "ns", "resourceVersion": "7"},
		"status":   map[string]any{"active": int64(3)},
	}}
	start := time.Now()
	_, err = pools.ApplyStatus(context.Background(), "pool", pool, metav1.ApplyOptions{FieldManager: "tally-aggregator", Force: true})
	require.True(t, apierrors.IsTooManyRequests(err), "%v", err)
	assert.Equal(t, int32(1), applies.Load(), "the apply was sent again")
	assert.Less(t, time.Since(start), time.Second, "the apply waited for a retry")
	delay, ok := apierrors.SuggestsClientDelay(err)
	assert.True(t, ok)
	assert.Equal(t, 1, delay, "the API server's delay is still in its answer")

	// A request that is not a status apply is retried as client-go does.
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	_, _ = pools.UpdateStatus(ctx, pool, metav1.UpdateOptions{})
	assert.Greater(t, updates.Load(), int32(1), "client-go's retries were lost for other requests")
}

// TestLateAppliesAreNotSent: a status apply whose send-by time passed
// before it went out (its process paused between the checks and the send,
// a wait in the client's rate limiter) is not sent; other requests are,
// and an apply on time is.
func TestLateAppliesAreNotSent(t *testing.T) {
	var sent atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	sendAppliesOnce(cfg)
	rt, err := rest.TransportFor(cfg)
	require.NoError(t, err)
	late := aggregate.WithSendBy(context.Background(), time.Now().Add(-time.Millisecond))
	request := func(ctx context.Context, method, path, contentType string) *http.Request {
		req, err := http.NewRequestWithContext(ctx, method, srv.URL+path, strings.NewReader("{}"))
		require.NoError(t, err)
		req.Header.Set("Content-Type", contentType)
		return req
	}

	const status = "/apis/example.tally.dev/v1/namespaces/ns/workerpools/pool/status"
	_, err = rt.RoundTrip(request(late, http.MethodPatch, status, "application/apply-patch+yaml"))
	require.ErrorIs(t, err, aggregate.ErrSentLate)
	assert.Equal(t, int32(0), sent.Load(), "a late status apply was sent")

	resp, err := rt.RoundTrip(request(late, http.MethodPatch, "/api/v1/namespaces/ns/pods/p", "application/json-patch+json"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, int32(1), sent.Load(), "another request was held back")

	onTime := aggregate.WithSendBy(context.Background(), time.Now().Add(time.Minute))
	resp, err = rt.RoundTrip(request(onTime, http.MethodPatch, status, "application/apply-patch+yaml"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, int32(2), sent.Load(), "an apply on time was held back")

	// Through client-go, as the reconciler sends it: the error says so.
	c, err := dynamic.NewForConfig(cfg)
	require.NoError(t, err)
	pool := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "example.tally.dev/v1", "kind": "WorkerPool",
		"metadata": map[string]any{"name": "pool", "namespace": "ns"}}}
	_, err = c.Resource(schema.GroupVersionResource{Group: "example.tally.dev", Version: "v1", Resource: "workerpools"}).Namespace("ns").
		ApplyStatus(late, "pool", pool, metav1.ApplyOptions{FieldManager: "tally-aggregator"})
	require.ErrorIs(t, err, aggregate.ErrSentLate)
	assert.Equal(t, int32(2), sent.Load())
}
