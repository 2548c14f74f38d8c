package app

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
)

// TestStaleViewStopsTheManager: a replica whose pod list fails while the
// API server answers stops its manager (a leader gives the lease up),
// even when the API server misses every other check; one whose pod list
// is throttled (429, API Priority and Fairness) keeps it, since every
// replica would be throttled alike.
func TestStaleViewStopsTheManager(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		// missed reports whether the API server leaves check n unanswered.
		missed func(n int64) bool
		stops  bool
	}{
		{name: "throttled", status: http.StatusTooManyRequests, stops: false},
		{name: "failing", status: http.StatusInternalServerError, stops: true},
		{name: "forbidden", status: http.StatusForbidden, stops: true},
		{name: "failing, every other check unanswered", status: http.StatusInternalServerError, stops: true,
			missed: func(n int64) bool { return n%2 == 0 }},
		{name: "failing, the API server away", status: http.StatusInternalServerError, stops: false,
			missed: func(int64) bool { return true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, watch, get := versionAPI(t, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Retry-After", "1")
				http.Error(w, http.StatusText(tc.status), tc.status)
			}, tc.missed)
			resp, err := get(context.Background())
			require.NoError(t, err)
			resp.Body.Close()
			require.False(t, watch.fresh(), "a pod list answered %d leaves the view stale", tc.status)

			ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
			defer cancel()
			err = staleView(cfg, watch, 2*time.Second, time.Minute).Start(ctx)
			if tc.stops {
				assert.True(t, errors.Is(err, errStaleView), "the manager ran on with a stale view: %v", err)
				assert.Equal(t, "stale_view", restartReason(err))
			} else {
				assert.NoError(t, err, "the manager stopped, though no new one could do better")
			}
		})
	}
}

// TestStaleViewWaitsForWhatIsUnderWay: a relist under way (its LIST slow,
// as at scale) counts only once it has taken the allowance, and the moment
// between two watches, while the indexer catches up with what the
// reflector synced, does not count at all: a new manager would do no
// better.
func TestStaleViewWaitsForWhatIsUnderWay(t *testing.T) {
	t.Run("a slow relist", func(t *testing.T) {
		listed := make(chan struct{})
		defer close(listed)
		cfg, watch, get := versionAPI(t, func(_ http.ResponseWriter, r *http.Request) {
			select {
			case <-listed:
			case <-r.Context().Done():
			}
		}, nil)
		watch.broken("cut by the test")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			if resp, err := get(ctx); err == nil {
				resp.Body.Close()
			}
		}()
		require.Eventually(t, func() bool { return watch.relistFor() > 0 }, 2*time.Second, 10*time.Millisecond)

		run, stop := context.WithTimeout(ctx, 4*time.Second)
		defer stop()
		assert.NoError(t, staleView(cfg, watch, time.Second, time.Minute).Start(run), "a relist under way, within its allowance, counted")
		run, stop = context.WithTimeout(ctx, 6*time.Second)
		defer stop()
		assert.ErrorIs(t, staleView(cfg, watch, time.Second, 2*time.Second).Start(run), errStaleView, "a relist under way past its allowance did not count")
	})
	t.Run("between two watches", func(t *testing.T) {
		end := make(chan struct{})
		watch, inf, get := monitoredAPI(t, end)
		first := get("&watch=true&resourceVersion=10")
		close(end)
		_, _ = io.ReadAll(first.Body)
		first.Body.Close()
		inf.set("12", "10") // the reflector synced what the indexer does not hold yet
		second := get("&watch=true&resourceVersion=12")
		defer second.Body.Close()
		require.False(t, watch.fresh())
		require.Zero(t, watch.stale())
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		cfg := &rest.Config{Host: second.Request.URL.Scheme + "://" + second.Request.URL.Host}
		assert.NoError(t, staleView(cfg, watch, time.Second, time.Minute).Start(ctx), "the moment between two watches counted as stale")
		ctx, cancel = context.WithTimeout(context.Background(), 4*time.Second)
		defer cancel()
		assert.ErrorIs(t, staleView(cfg, watch, time.Second, time.Second).Start(ctx), errStaleView, "between two watches for longer than the allowance did not count")
	})
	t.Run("relists retried one after another", func(t *testing.T) {
		cfg, watch, get := versionAPI(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, nil)
		watch.broken("cut by the test")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			// Each relist given up after 300 ms and sent again: no break,
			// one relist under way.
			for ctx.Err() == nil {
				attempt, stop := context.WithTimeout(ctx, 300*time.Millisecond)
				if resp, err := get(attempt); err == nil {
					resp.Body.Close()
				}
				stop()
			}
		}()
		run, stop := context.WithTimeout(ctx, 5*time.Second)
		defer stop()
		assert.ErrorIs(t, staleView(cfg, watch, time.Second, 2*time.Second).Start(run), errStaleView, "relists retried one after another kept the count from starting")
	})
}

// versionAPI serves the API server's version (leaving check n unanswered
// when missed says so) and pod lists with pods; it returns a config whose
// requests the returned watch monitor observes, and get, which sends a pod
// list through it.
func versionAPI(t *testing.T, pods http.HandlerFunc, missed func(n int64) bool) (*rest.Config, *watchMonitor, func(context.Context) (*http.Response, error)) {
	t.Helper()
	var checks atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == podWatchPath {
			pods(w, r)
			return
		}
		if missed != nil && missed(checks.Add(1)) {
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"major":"1","minor":"37","gitVersion":"v1.37.2"}`))
	}))
	t.Cleanup(api.Close)
	cfg := &rest.Config{Host: api.URL}
	watch := newWatchMonitor(logr.Discard())
	watch.wrap(cfg)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	return cfg, watch, func(ctx context.Context) (*http.Response, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, api.URL+podWatchPath+"?labelSelector="+url.QueryEscape(podSelector), nil)
		if err != nil {
			return nil, err
		}
		return client.Do(req)
	}
}

func TestRestartReason(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{errStaleView, "stale_view"},
		{errors.New("leader election lost"), "lease_lost"},
		{errors.New("failed to wait for caches to sync"), "error"},
		{nil, "error"},
	} {
		assert.Equal(t, tc.want, restartReason(tc.err), "%v", tc.err)
	}
}
