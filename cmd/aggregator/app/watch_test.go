package app

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
)

// fakeInformer is a pod informer whose reflector and indexer have synced
// what the test says.
type fakeInformer struct {
	mu             sync.Mutex
	synced, stored string
}

func (f *fakeInformer) set(synced, stored string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.synced, f.stored = synced, stored
}

func (f *fakeInformer) LastSyncResourceVersion() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.synced
}

func (f *fakeInformer) GetIndexer() toolscache.Indexer { return fakeIndexer{f} }

type fakeIndexer struct{ f *fakeInformer }

func (i fakeIndexer) LastStoreSyncResourceVersion() string {
	i.f.mu.Lock()
	defer i.f.mu.Unlock()
	return i.f.stored
}

// The rest of toolscache.Indexer is not called.
func (fakeIndexer) Add(any) error                              { panic("not called") }
func (fakeIndexer) Update(any) error                           { panic("not called") }
func (fakeIndexer) Delete(any) error                           { panic("not called") }
func (fakeIndexer) List() []any                                { panic("not called") }
func (fakeIndexer) ListKeys() []string                         { panic("not called") }
func (fakeIndexer) Get(any) (any, bool, error)                 { panic("not called") }
func (fakeIndexer) GetByKey(string) (any, bool, error)         { panic("not called") }
func (fakeIndexer) Replace([]any, string) error                { panic("not called") }
func (fakeIndexer) Resync() error                              { panic("not called") }
func (fakeIndexer) Index(string, any) ([]any, error)           { panic("not called") }
func (fakeIndexer) IndexKeys(string, string) ([]string, error) { panic("not called") }
func (fakeIndexer) ListIndexFuncValues(string) []string        { panic("not called") }
func (fakeIndexer) ByIndex(string, string) ([]any, error)      { panic("not called") }
func (fakeIndexer) GetIndexers() toolscache.Indexers           { panic("not called") }
func (fakeIndexer) AddIndexers(toolscache.Indexers) error      { panic("not called") }
func (fakeIndexer) Bookmark(string)                            { panic("not called") }
func (fakeIndexer) Transaction(...toolscache.Transaction) *toolscache.TransactionError {
	panic("not called")
}

// TestFreshMeansDelivered: after the pod watch broke, the view is fresh
// again only once what the API server sent since is in the cache: a relist
// (a LIST, or a watch-list stream) once the reflector synced its result and
// the indexer holds it; a resumed watch once it stayed open and the
// indexer holds every event the reflector synced. A LIST's headers, or a
// stream that stays open, are not enough.
func TestFreshMeansDelivered(t *testing.T) {
	// step: what the informer has synced and stored, and whether the view
	// is fresh then.
	type step struct {
		synced, stored string
		fresh          bool
	}
	tests := []struct {
		name  string
		query string
		steps []step
	}{
		{name: "LIST", query: "", steps: []step{
			{"10", "10", false}, // answered, read to the end, not synced
			{"20", "10", false}, // synced, not delivered
			{"20", "20", true},
		}},
		{name: "watch-list", query: "&watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan", steps: []step{
			{"10", "10", false}, // the stream open for longer than watchSettle
			{"20", "10", false}, // the initial-events-end bookmark synced
			{"20", "20", true},
		}},
		{name: "resumed watch", query: "&watch=true&resourceVersion=10", steps: []step{
			{"15", "10", false}, // open, an event synced, not delivered
			{"15", "15", true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			watch, inf, get := monitoredAPI(t, nil)
			require.True(t, watch.fresh())
			epoch := watch.viewEpoch()
			watch.broken("cut by the test")
			watch.broken("cut again")
			require.False(t, watch.fresh())
			assert.Equal(t, epoch+1, watch.viewEpoch(), "one break, one new epoch")

			resp := get(tt.query)
			defer resp.Body.Close()
			if resp.Request.URL.Query().Get("watch") != "true" {
				_, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
			} else {
				time.Sleep(watchSettle + 200*time.Millisecond)
			}
			for _, s := range tt.steps {
				inf.set(s.synced, s.stored)
				assert.Equal(t, s.fresh, watch.fresh(), "synced %s, stored %s", s.synced, s.stored)
			}
			assert.Equal(t, epoch+1, watch.viewEpoch(), "fresh again in the epoch of the break")
		})
	}
}

// monitoredAPI serves pod lists and watches (a watch stays open until its
// request ends, or until end, when set, is closed) to a watch monitor that
// reads inf, synced and stored at "10"; get sends a pod list or watch
// request with query appended, through the monitor.
func monitoredAPI(t *testing.T, end <-chan struct{}) (watch *watchMonitor, inf *fakeInformer, get func(query string) *http.Response) {
	t.Helper()
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{}`))
		if r.URL.Query().Get("watch") == "true" {
			w.(http.Flusher).Flush()
			select {
			case <-end:
			case <-r.Context().Done():
			}
		}
	}))
	t.Cleanup(api.Close)
	cfg := &rest.Config{Host: api.URL}
	inf = &fakeInformer{synced: "10", stored: "10"}
	watch = newWatchMonitor(logr.Discard())
	watch.wrap(cfg)
	watch.attach(inf)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	return watch, inf, func(query string) *http.Response {
		resp, err := client.Get(api.URL + podWatchPath + "?labelSelector=" + url.QueryEscape(podSelector) + query)
		require.NoError(t, err)
		return resp
	}
}

func TestAtLeast(t *testing.T) {
	assert.True(t, atLeast("20", "9"))
	assert.False(t, atLeast("9", "20"))
	assert.True(t, atLeast("x", "x"))
	assert.False(t, atLeast("x", "y"))
}

// TestNothingWrittenBetweenWatches: from the moment a pod watch ends until
// the next one is open and the indexer holds what the reflector synced, the
// view is not fresh, though not yet counted as broken.
func TestNothingWrittenBetweenWatches(t *testing.T) {
	end := make(chan struct{})
	watch, inf, get := monitoredAPI(t, end)
	const resumed = "&watch=true&resourceVersion=10"

	first := get(resumed)
	require.True(t, watch.fresh())
	epoch := watch.viewEpoch()
	close(end) // the server ends its watches
	_, _ = io.ReadAll(first.Body)
	first.Body.Close()
	assert.False(t, watch.fresh(), "fresh with no watch open")
	assert.Equal(t, epoch+1, watch.viewEpoch(), "a count from before the gap is not written after it")
	assert.Zero(t, watch.stale(), "a watch that ended is not broken before it stays closed")

	inf.set("12", "10")
	// The next watch is answered (the server ends it at once, end being
	// closed, but the client has not read that far).
	second := get(resumed)
	defer second.Body.Close()
	assert.False(t, watch.fresh(), "fresh before the indexer holds what the reflector synced")
	inf.set("12", "12")
	assert.True(t, watch.fresh())
}

// TestARelistAfterTheWatchEndedCounts: the pod watch ends, the reflector
// sends a watch-list relist at once, and its headers take longer than the
// 2 s after which a watch that ended and was not reopened counts as
// broken: the relist still makes the view fresh once it is delivered
// (before, the break forgot it, and a watch-list stream, which never
// settles by time, left the view stale until it ended minutes later).
func TestARelistAfterTheWatchEndedCounts(t *testing.T) {
	end := make(chan struct{})
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("sendInitialEvents") == "true" {
			time.Sleep(3 * watchSettle) // slow headers
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-end:
		case <-r.Context().Done():
		}
	}))
	defer api.Close()
	cfg := &rest.Config{Host: api.URL}
	inf := &fakeInformer{synced: "10", stored: "10"}
	watch := newWatchMonitor(logr.Discard())
	watch.wrap(cfg)
	watch.attach(inf)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	get := func(query string) *http.Response {
		resp, err := client.Get(api.URL + podWatchPath + "?labelSelector=" + url.QueryEscape(podSelector) + query)
		require.NoError(t, err)
		return resp
	}

	first := get("&watch=true&resourceVersion=10")
	time.Sleep(watchSettle + 200*time.Millisecond)
	require.True(t, watch.fresh())
	close(end)
	_, _ = io.ReadAll(first.Body)
	first.Body.Close()
	end = make(chan struct{})
	defer close(end)

	relist := get("&watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan")
	defer relist.Body.Close()
	require.NotZero(t, watch.stale(), "the watch closed for 2 s counts as broken")
	inf.set("20", "20") // the initial-events-end bookmark synced and delivered
	assert.True(t, watch.fresh(), "the relist sent after the watch ended was forgotten")
}
