package app

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
)

// TestStaleLeaderYieldsToFailuresNotToThrottling: a leader whose pod list
// fails while the API server answers gives the lease up; one whose pod
// list is throttled (429, API Priority and Fairness) keeps it, since every
// replica would be throttled alike.
func TestStaleLeaderYieldsToFailuresNotToThrottling(t *testing.T) {
	for _, tc := range []struct {
		status int
		yields bool
	}{
		{http.StatusTooManyRequests, false},
		{http.StatusInternalServerError, true},
		{http.StatusForbidden, true},
	} {
		t.Run(http.StatusText(tc.status), func(t *testing.T) {
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == podWatchPath {
					w.Header().Set("Retry-After", "1")
					http.Error(w, http.StatusText(tc.status), tc.status)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				_, _ = w.Write([]byte(`{"major":"1","minor":"37","gitVersion":"v1.37.2"}`))
			}))
			defer api.Close()
			cfg := &rest.Config{Host: api.URL}
			watch := newWatchMonitor(logr.Discard())
			watch.wrap(cfg)
			client, err := rest.HTTPClientFor(cfg)
			require.NoError(t, err)
			list := api.URL + podWatchPath + "?labelSelector=" + url.QueryEscape(podSelector)
			resp, err := client.Get(list)
			require.NoError(t, err)
			resp.Body.Close()
			require.False(t, watch.fresh(), "a pod list answered %d leaves the view stale", tc.status)

			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
			defer cancel()
			err = staleLeader(cfg, watch, time.Second).Start(ctx)
			if tc.yields {
				assert.True(t, errors.Is(err, errStaleLeader), "the leader kept the lease: %v", err)
			} else {
				assert.NoError(t, err, "the leader gave the lease up because the API server throttles")
			}
		})
	}
}
