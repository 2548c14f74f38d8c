package freshness

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
)

// TestViews: the views of a fixed list of namespaces, one monitor each.
// Each monitor's barrier reads and watches its own namespace and takes
// only its own informer's requests as doubts; the whole is fresh only
// while every one is, and its epoch moves with any one's.
func TestViews(t *testing.T) {
	bookmark := []script{{events: []string{"BOOKMARK 30"}, hold: true}}
	apiA, apiB := &fakeAPI{read: "30", scripts: bookmark}, &fakeAPI{read: "30", scripts: bookmark}
	a, _, cfg := startedIn(t, apiA, "a")
	b, infB, _ := startedIn(t, apiB, "b")
	v := Views{a, b}
	require.Eventually(t, v.Fresh, 3*time.Second, 10*time.Millisecond)
	apiB.mu.Lock()
	assert.Contains(t, apiB.paths, "/api/v1/namespaces/b/pods", "the barrier of b reads in b")
	assert.NotContains(t, apiB.paths, "/api/v1/pods", "and never in every namespace")
	apiB.mu.Unlock()

	// The informer of b watching its namespace ends its watch: a doubt of
	// b's, not of a's.
	epochA, epoch := a.Epoch(), v.Epoch()
	cfg = rest.CopyConfig(cfg)
	v.Wrap(cfg)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	resp, err := client.Get(cfg.Host + "/api/v1/namespaces/b/pods?labelSelector=" + selector + "&watch=true&resourceVersion=10")
	require.NoError(t, err)
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, epochA, a.Epoch())
	assert.Greater(t, v.Epoch(), epoch)

	// b stale, a fresh: the whole is stale until b's cache holds what its
	// barrier waits for.
	require.Eventually(t, v.Fresh, 3*time.Second, 10*time.Millisecond)
	apiB.mu.Lock()
	apiB.read, apiB.scripts = "40", []script{{events: []string{"ADDED 35", "BOOKMARK 40"}, hold: true}}
	apiB.mu.Unlock()
	infB.set("30", "30")
	b.doubt("a pause", true)
	assert.Never(t, v.Fresh, 300*time.Millisecond, 10*time.Millisecond)
	assert.True(t, a.Fresh())
	assert.Positive(t, v.Stale())
	infB.set("35", "35")
	assert.Eventually(t, v.Fresh, 3*time.Second, 10*time.Millisecond)
	assert.Zero(t, v.Stale())
}

// TestViewsWatchdog: of several views, one the API server refuses (403,
// the Role of its namespace missing) is not a stall while another is
// fresh; it is once none is.
func TestViewsWatchdog(t *testing.T) {
	for _, tc := range []struct {
		name       string
		otherFresh bool
	}{{"another view fresh", true}, {"no other view fresh", false}} {
		t.Run(tc.name, func(t *testing.T) {
			apiA := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}}}
			if !tc.otherFresh {
				apiA.scripts = []script{{events: []string{"BOOKMARK 20"}}}
			}
			apiB := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 20"}}},
				informer: func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "forbidden", http.StatusForbidden) }}
			a, infA, cfgA := startedIn(t, apiA, "a")
			b, infB, cfgB := startedIn(t, apiB, "b")
			if !tc.otherFresh {
				infA.set("", "")
			}
			infB.set("", "") // its first sync, refused
			v := Views{a, b}
			if tc.otherFresh {
				require.Eventually(t, a.Fresh, 3*time.Second, 10*time.Millisecond)
			}
			cfgB = rest.CopyConfig(cfgB)
			b.Wrap(cfgB)
			client, err := rest.HTTPClientFor(cfgB)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
			defer cancel()
			go func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, cfgB.Host+"/api/v1/namespaces/b/pods?labelSelector="+selector+"&limit=500", nil)
					if resp, err := client.Do(req); err == nil {
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
			err = v.Watchdog(ctx, cfgA, time.Second)
			if tc.otherFresh {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, ErrStalled)
			}
		})
	}
}
