package freshness

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
)

const selector = "tally.dev/parent-uid"

var pods = schema.GroupVersionResource{Version: "v1", Resource: "pods"}

// fakeInformer is an informer whose reflector and indexer have synced what
// the test says.
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

// fakeAPI answers the barrier's LIST with the version read, and its
// watches with scripts, one per watch in turn (the last one again once
// they run out). Other pod requests (the informer's, through the
// monitored transport) are answered by informer when set.
type fakeAPI struct {
	mu       sync.Mutex
	read     string
	scripts  []script
	froms    []string
	informer http.HandlerFunc
	// away fails the API server's version.
	away bool
	// hangLists makes that many of the barrier's LISTs hang until they are
	// given up.
	hangLists int
	// paths are the paths of the barrier's requests.
	paths []string
}

// script is a watch's answer: a status code, or events ("ADDED 12",
// "BOOKMARK 30", "ERROR 410") and then the end of the stream unless hold.
type script struct {
	status int
	events []string
	hold   bool
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f.mu.Lock()
	informer := f.informer
	f.mu.Unlock()
	if r.URL.Path == "/version" {
		f.mu.Lock()
		away := f.away
		f.mu.Unlock()
		if away {
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"major":"1","minor":"37","gitVersion":"v1.37.2"}`))
		return
	}
	if r.Header.Get("Accept") == "" || !strings.Contains(r.Header.Get("Accept"), "PartialObjectMetadata") {
		if informer != nil {
			informer(w, r)
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	f.mu.Lock()
	f.paths = append(f.paths, r.URL.Path)
	f.mu.Unlock()
	if q.Get("watch") != "true" {
		f.mu.Lock()
		read, hang := f.read, f.hangLists > 0
		f.hangLists--
		f.mu.Unlock()
		if hang {
			<-r.Context().Done()
			return
		}
		fmt.Fprintf(w, `{"kind":"PartialObjectMetadataList","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":%q},"items":[]}`, read)
		return
	}
	f.mu.Lock()
	f.froms = append(f.froms, q.Get("resourceVersion"))
	s := f.scripts[0]
	if len(f.scripts) > 1 {
		f.scripts = f.scripts[1:]
	}
	f.mu.Unlock()
	if s.status != 0 {
		w.WriteHeader(s.status)
		fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","code":%d,"reason":"Expired"}`, s.status)
		return
	}
	for _, e := range s.events {
		var typ, rv string
		fmt.Sscan(e, &typ, &rv)
		if typ == "ERROR" {
			fmt.Fprintf(w, `{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","code":%s,"reason":"Expired","message":"too old resource version"}}`+"\n", rv)
			continue
		}
		fmt.Fprintf(w, `{"type":%q,"object":{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{"name":"p","namespace":"n","resourceVersion":%q}}}`+"\n", typ, rv)
	}
	w.(http.Flusher).Flush()
	if s.hold {
		<-r.Context().Done()
	}
}

func (f *fakeAPI) watchedFrom() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.froms...)
}

// started returns a monitor whose barrier talks to api, running until the
// test ends, attached to an informer that holds version 10.
func started(t *testing.T, api *fakeAPI) (*Monitor, *fakeInformer, *rest.Config) {
	t.Helper()
	return startedIn(t, api, "")
}

// startedIn is started for an informer of namespace ns ("" for every
// namespace).
func startedIn(t *testing.T, api *fakeAPI, ns string) (*Monitor, *fakeInformer, *rest.Config) {
	t.Helper()
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	cfg := &rest.Config{Host: srv.URL}
	m, err := New(logr.Discard(), cfg, Options{Resource: pods, LabelSelector: selector, Namespace: ns})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	inf := &fakeInformer{}
	inf.set("10", "10")
	m.Attach(inf)
	return m, inf, cfg
}

// informersRequests returns a func that sends the informer's pod list or
// watch (with query) through a copy of cfg that m observes, and reads its
// answer, with that client and config.
func informersRequests(t *testing.T, m *Monitor, cfg *rest.Config) (func(query string), *http.Client, *rest.Config) {
	t.Helper()
	cfg = rest.CopyConfig(cfg)
	m.Wrap(cfg)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	return func(query string) {
		resp, err := client.Get(cfg.Host + "/api/v1/pods?labelSelector=" + selector + query)
		require.NoError(t, err)
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
	}, client, cfg
}

// TestBarrier: after a doubt, the view is fresh once the cache holds every
// event up to a version read after it, as the barrier's watch from the
// cache's own version shows them.
func TestBarrier(t *testing.T) {
	tests := []struct {
		name    string
		scripts []script
		// steps: what the cache holds once the barrier sent so many
		// watches, and whether the view is then fresh.
		steps []step
		froms []string
	}{
		{name: "nothing happened: fresh on the bookmark",
			scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}},
			steps:   []step{{1, "10", true}}, froms: []string{"10"}},
		{name: "events up to the version read are waited for",
			scripts: []script{{events: []string{"MODIFIED 12", "DELETED 17", "BOOKMARK 30"}, hold: true}},
			steps:   []step{{1, "10", false}, {1, "12", false}, {1, "17", true}}, froms: []string{"10"}},
		{name: "an event past the version read proves",
			scripts: []script{{events: []string{"ADDED 14", "ADDED 31"}, hold: true}},
			steps:   []step{{1, "13", false}, {1, "14", true}}, froms: []string{"10"}},
		{name: "an event at the version read proves",
			scripts: []script{{events: []string{"ADDED 30"}, hold: true}},
			steps:   []step{{1, "29", false}, {1, "30", true}}, froms: []string{"10"}},
		{name: "the watch goes on from where it ended",
			scripts: []script{{events: []string{"ADDED 12"}}, {events: []string{"ADDED 20"}}, {events: []string{"BOOKMARK 30"}, hold: true}},
			steps:   []step{{3, "12", false}, {3, "20", true}}, froms: []string{"10", "12", "20"}},
		{name: "a bookmark behind the version read proves nothing",
			scripts: []script{{events: []string{"ADDED 12", "BOOKMARK 20"}}, {events: []string{"ADDED 25", "BOOKMARK 30"}, hold: true}},
			steps:   []step{{2, "20", false}, {2, "25", true}}, froms: []string{"10", "20"}},
		{name: "a version too old waits for the relist",
			scripts: []script{{status: http.StatusGone}, {events: []string{"ERROR 410"}}, {events: []string{"BOOKMARK 30"}, hold: true}},
			steps:   []step{{1, "10", false}, {1, "20", false}, {2, "20", false}, {2, "28", true}}, froms: []string{"10", "20", "28"}},
		{name: "the cache at the version read needs no watch",
			scripts: []script{{hold: true}},
			steps:   []step{{0, "30", true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			api := &fakeAPI{read: "30", scripts: tt.scripts}
			m, inf, _ := started(t, api)
			for _, s := range tt.steps {
				require.Eventually(t, func() bool { return len(api.watchedFrom()) >= s.watches }, 3*time.Second, 10*time.Millisecond)
				inf.set(s.holds, s.holds)
				if s.fresh {
					assert.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond, "the cache holds %s", s.holds)
				} else {
					assert.Never(t, m.Fresh, 300*time.Millisecond, 10*time.Millisecond, "the cache holds %s", s.holds)
				}
			}
			if tt.froms != nil {
				assert.Equal(t, tt.froms, api.watchedFrom()[:len(tt.froms)])
			}
		})
	}
}

type step struct {
	watches int
	holds   string
	fresh   bool
}

// TestADoubtSupersedesItsBarrier: a doubt raised while a barrier is under
// way (a pause, a watch that ended) is not cleared by it: the version it
// read came before the doubt.
func TestADoubtSupersedesItsBarrier(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"ADDED 12"}, hold: true}}}
	m, inf, _ := started(t, api)
	require.Eventually(t, func() bool { return len(api.watchedFrom()) == 1 }, 3*time.Second, 10*time.Millisecond)
	epoch := m.Epoch()
	m.doubt("a pause", true)
	assert.Equal(t, epoch+1, m.Epoch())
	api.mu.Lock()
	api.read, api.scripts = "40", []script{{events: []string{"ADDED 35", "BOOKMARK 40"}, hold: true}}
	api.mu.Unlock()
	inf.set("30", "30") // the first barrier's version read
	assert.Never(t, m.Fresh, 500*time.Millisecond, 10*time.Millisecond, "cleared by a version read before the doubt")
	inf.set("35", "35")
	assert.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
}

// TestDeliveredMeansInTheCache: a version the reflector synced counts
// once the indexer holds it too.
func TestDeliveredMeansInTheCache(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"ADDED 12", "BOOKMARK 30"}, hold: true}}}
	m, inf, _ := started(t, api)
	inf.set("12", "10")
	assert.Never(t, m.Fresh, 500*time.Millisecond, 10*time.Millisecond, "fresh before the indexer held what the reflector synced")
	inf.set("12", "12")
	assert.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
}

// TestAPauseIsADoubt: once the process has not run for longer than
// PauseBound, its view is not fresh, from the moment it runs again (before
// its clock ticks), then in a new epoch; the streams stay open.
func TestAPauseIsADoubt(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}}}
	m, _, _ := started(t, api)
	require.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
	epoch := m.Epoch()

	// The process was stopped 3 s ago, right after a tick, and runs again:
	// its clock has not ticked yet.
	m.lastTick.Store(int64(m.now() - 3*time.Second))
	assert.False(t, m.Fresh(), "counted from the view of before the pause")
	m.tick(time.Now())
	assert.Equal(t, epoch+1, m.Epoch(), "a count taken before the pause could still be written")
	assert.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond, "a barrier after the pause")
	m.tick(time.Now().Add(clockTick))
	assert.Equal(t, epoch+1, m.Epoch(), "a tick on time")
}

// TestTheInformersRequestsAreDoubts: through the monitored transport, a
// relist, a failure, a 429 and a watch that ends are doubts; each byte
// read is progress.
func TestTheInformersRequestsAreDoubts(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}}}
	var status atomic.Int64
	api.informer = func(w http.ResponseWriter, _ *http.Request) {
		if s := int(status.Load()); s != 0 {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "no", s)
			return
		}
		_, _ = w.Write([]byte(`{"type":"BOOKMARK"}`))
	}
	m, _, cfg := started(t, api)
	get, client, cfg := informersRequests(t, m, cfg)
	for _, tc := range []struct {
		name      string
		query     string
		status    int
		throttled bool
	}{
		{name: "relist", query: "&limit=500"},
		{name: "watch-list", query: "&watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"},
		{name: "a watch that ends", query: "&watch=true&resourceVersion=10"},
		{name: "failing", query: "&watch=true&resourceVersion=10", status: http.StatusInternalServerError},
		{name: "throttled", query: "&watch=true&resourceVersion=10", status: http.StatusTooManyRequests, throttled: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
			epoch := m.Epoch()
			status.Store(int64(tc.status))
			get(tc.query)
			assert.Greater(t, m.Epoch(), epoch)
			// The flag itself: a barrier may have made the view fresh
			// again already.
			m.mu.Lock()
			throttled := m.answer == http.StatusTooManyRequests
			m.mu.Unlock()
			assert.Equal(t, tc.throttled, throttled)
			status.Store(0)
		})
	}
	require.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
	epoch := m.Epoch()
	resp, err := client.Get(cfg.Host + "/api/v1/namespaces?labelSelector=" + selector + "&watch=true")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, epoch, m.Epoch(), "another resource's watch")
}

// TestWatchdog: a view stale with nothing delivered for the given time of
// the API server answering gives up the informer, a first sync included;
// a relist that makes progress, however long, does not, nor does a view
// throttled (429), nor one whose API server does not answer.
func TestWatchdog(t *testing.T) {
	for _, tc := range []struct {
		name string
		// list answers the informer's LIST.
		list  func(w http.ResponseWriter, r *http.Request)
		away  bool
		stops bool
		// synced is what the informer holds, its first sync under way
		// when empty.
		synced string
		// after is the watchdog's bound; 1 s when 0.
		after time.Duration
		// scripts answer the barrier's watches; bookmarks behind the
		// version read when nil.
		scripts []script
	}{
		{name: "nothing delivered", stops: true, list: func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }},
		{name: "failing", stops: true, list: func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "no", http.StatusInternalServerError)
		}},
		{name: "a relist that makes progress", list: func(w http.ResponseWriter, r *http.Request) {
			for r.Context().Err() == nil {
				_, _ = w.Write([]byte(" "))
				w.(http.Flusher).Flush()
				time.Sleep(200 * time.Millisecond)
			}
		}},
		{name: "throttled", list: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "slow down", http.StatusTooManyRequests)
		}},
		// A view of every namespace refused: a new manager, or another
		// replica, may be served (Views.Watchdog excuses it only beside a
		// fresh view).
		{name: "refused", stops: true, list: func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "forbidden", http.StatusForbidden)
		}},
		{name: "the API server away", away: true, list: func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }},
		{name: "throttled once, then nothing", stops: true, list: throttledOnce()},
		// The barrier's watches answered 410 (as a watch cache answers a
		// version too old): the informer relists, and a relist that
		// delivers nothing is a stall all the same.
		{name: "a relist that delivers nothing, the barrier answered 410", synced: "20", stops: true, after: 2 * time.Second,
			scripts: []script{{events: []string{"ERROR 410"}}},
			list:    func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }},
		// Each barrier's answer is progress; they come after a back-off
		// that grows to 5 s, a quarter of StallAfter.
		{name: "its pod cache behind the version read", synced: "20", after: 3 * time.Second,
			list: func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The barrier's watches end with a bookmark behind the version
			// read, as from an API server whose pod cache lags behind it.
			scripts := tc.scripts
			if scripts == nil {
				scripts = []script{{events: []string{"BOOKMARK 20"}}}
			}
			api := &fakeAPI{read: "30", scripts: scripts, informer: tc.list, away: tc.away}
			m, inf, cfg := started(t, api)
			inf.set(tc.synced, tc.synced)
			cfg = rest.CopyConfig(cfg)
			m.Wrap(cfg)
			client, err := rest.HTTPClientFor(cfg)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
			defer cancel()
			go func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, cfg.Host+"/api/v1/pods?labelSelector="+selector+"&limit=500", nil)
					if resp, err := client.Do(req); err == nil {
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
			err = m.watchdog(ctx, cfg, cmp.Or(tc.after, time.Second), nil)
			if tc.stops {
				assert.ErrorIs(t, err, ErrStalled)
			} else {
				assert.NoError(t, err)
			}
		})
	}
}

// TestAHungBarrierIsGivenUpOnADoubt: a barrier whose LIST hangs (a
// connection that carries nothing) is given up as soon as a newer doubt
// comes, not after the LIST's own timeout.
func TestAHungBarrierIsGivenUpOnADoubt(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}}, hangLists: 1}
	m, _, _ := started(t, api)
	assert.Never(t, m.Fresh, 500*time.Millisecond, 10*time.Millisecond, "fresh while the barrier's LIST hangs")
	m.doubt("the watch ended", false)
	assert.Eventually(t, m.Fresh, 2*time.Second, 10*time.Millisecond, "the hung barrier held the view stale")
}

// TestABarrierWatchThatEndsAtOnceBacksOff: a barrier's watch that ends at
// once with nothing (something between that ends watches, an API server
// whose cache has seen nothing past the cache's version) is sent again
// after a back-off, not in a loop.
func TestABarrierWatchThatEndsAtOnceBacksOff(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{}}}
	m, _, _ := started(t, api)
	time.Sleep(2 * time.Second)
	assert.False(t, m.Fresh())
	assert.Less(t, len(api.watchedFrom()), 15, "watches sent in 2 s")
}

// throttledOnce answers a first list 429, and leaves the others
// unanswered.
func throttledOnce() func(http.ResponseWriter, *http.Request) {
	var n atomic.Int64
	return func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return
		}
		<-r.Context().Done()
	}
}

// TestARelistsDeliveryIsADoubt: a relist is a doubt when it is sent, and
// again once the informer has it in its store (its synced version moved),
// however long it took: its list is the API server's state when it began,
// so a version read before it proves nothing. The pages of a list are one
// relist, and what the informer delivers after it no doubt.
func TestARelistsDeliveryIsADoubt(t *testing.T) {
	api := &fakeAPI{read: "30", scripts: []script{{events: []string{"BOOKMARK 30"}, hold: true}}}
	api.informer = func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`{"kind":"PodList","items":[]}`))
	}
	m, inf, cfg := started(t, api)
	get, _, _ := informersRequests(t, m, cfg)
	version := 40
	for _, tc := range []struct{ name, first, next string }{
		{"a list, in pages", "&limit=500", "&limit=500&continue=more"},
		{"a watch-list", "&watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
			before := m.Epoch()
			get(tc.first)
			if tc.next != "" {
				get(tc.next)
			}
			// While the relist is under way, a barrier proves the old
			// cache fresh.
			require.Eventually(t, m.Fresh, 3*time.Second, 10*time.Millisecond)
			sent := m.Epoch()
			if tc.next != "" {
				assert.Equal(t, before+1, sent, "the relist's request: one doubt, its pages none")
			}
			// The reflector puts the list in its store, then sets its
			// synced version: the doubt comes with the first, and the
			// view's users (Fresh, Epoch) raise it.
			old := inf.LastSyncResourceVersion()
			version++
			inf.set(old, fmt.Sprint(version))
			m.Fresh()
			m.mu.Lock()
			gen := m.gen
			m.mu.Unlock()
			assert.Greater(t, gen, sent, "the relist in the store raised no doubt")
			inf.set(fmt.Sprint(version), fmt.Sprint(version))
			assert.Equal(t, gen, m.Epoch(), "the relist's synced version: the same relist")
			version++
			inf.set(fmt.Sprint(version), fmt.Sprint(version))
			assert.Equal(t, gen, m.Epoch(), "an event the informer delivered after the relist")
		})
	}
}
