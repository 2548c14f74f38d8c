package apiwait

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
)

// TestHoldWaitsForTheAPIServer: a list the API server refuses, then answers
// with 503, is sent again until it is answered, in one call; a write fails
// at once; a request whose context ends stops waiting.
func TestHoldWaitsForTheAPIServer(t *testing.T) {
	var calls, writes atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			writes.Add(1)
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		if calls.Add(1) < 4 {
			http.Error(w, "starting", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	Hold(cfg, 10*time.Millisecond)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)

	resp, err := client.Get(srv.URL + "/api/v1/pods?watch=true")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, int32(4), calls.Load(), "sent again until answered")

	resp, err = client.Post(srv.URL+"/api/v1/namespaces/ns/pods", "application/json", nil)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "a write is not held")
	assert.Equal(t, int32(1), writes.Load())

	calls.Store(-1000)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/api/v1/pods", nil)
	require.NoError(t, err)
	_, err = client.Do(req)
	assert.ErrorIs(t, err, context.DeadlineExceeded, "a held request ends with its context")
}

func TestRetryAfter(t *testing.T) {
	poll := 500 * time.Millisecond
	for _, tc := range []struct {
		status int
		header string
		want   time.Duration
	}{
		{http.StatusTooManyRequests, "", poll},
		{http.StatusTooManyRequests, "x", poll},
		{http.StatusTooManyRequests, "0", poll},
		{http.StatusTooManyRequests, "-3", poll},
		{http.StatusTooManyRequests, "2", 2 * time.Second},
		{http.StatusTooManyRequests, "3600", MaxRetryAfter},
		// A starting API server's "not initialized yet".
		{http.StatusServiceUnavailable, "5", poll},
	} {
		resp := &http.Response{StatusCode: tc.status, Header: http.Header{}}
		if tc.header != "" {
			resp.Header.Set("Retry-After", tc.header)
		}
		assert.Equal(t, tc.want, retryAfter(resp, poll), "%d with Retry-After %q", tc.status, tc.header)
	}
}

// TestHoldsANotFoundForAWhile: a list answered 404 (a restarted API server
// that has not read its CRDs yet) is sent again until it is answered, for
// up to the bound; past it, the 404 is the answer.
func TestHoldsANotFoundForAWhile(t *testing.T) {
	var calls atomic.Int32
	var served atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) < 4 || !served.Load() {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	hold(cfg, 10*time.Millisecond, 500*time.Millisecond)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)

	served.Store(true)
	resp, err := client.Get(srv.URL + "/apis/example.tally.dev/v1/workerpools")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, int32(4), calls.Load(), "sent again until served")

	served.Store(false)
	start := time.Now()
	resp, err = client.Get(srv.URL + "/apis/example.tally.dev/v1/workerpools")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode, "a resource not served is not served")
	assert.GreaterOrEqual(t, time.Since(start), 500*time.Millisecond, "held for the bound")
}

// TestHoldBacksOffOnServerErrors: a list answered with a 5xx again and
// again is sent again after waits that double, each a random half to all
// of its step; a transport error or a 429 in between starts them anew.
func TestHoldBacksOffOnServerErrors(t *testing.T) {
	const poll = 10 * time.Millisecond
	var mu sync.Mutex
	var at []time.Time
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		at = append(at, time.Now())
		n := len(at)
		mu.Unlock()
		if n <= 6 {
			http.Error(w, "overloaded", http.StatusInternalServerError)
			return
		}
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	cfg := &rest.Config{Host: srv.URL}
	Hold(cfg, poll)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	before := testutil.ToFloat64(held.WithLabelValues("server_error"))
	resp, err := client.Get(srv.URL + "/api/v1/pods")
	require.NoError(t, err)
	resp.Body.Close()
	require.Len(t, at, 7)
	for i := 1; i < len(at); i++ {
		step := min(poll<<(i-1), MaxServerErrorWait)
		assert.GreaterOrEqual(t, at[i].Sub(at[i-1]), step/2, "wait %d", i)
	}
	assert.Equal(t, 6.0, testutil.ToFloat64(held.WithLabelValues("server_error"))-before)
}

func TestServerErrorWait(t *testing.T) {
	for n, step := range []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second, 4 * time.Second} {
		for range 20 {
			wait := serverErrorWait(500*time.Millisecond, n+1)
			assert.GreaterOrEqual(t, wait, step/2)
			assert.LessOrEqual(t, wait, step)
		}
	}
}
