// Package freshness tells whether an informer's view is fresh, by one
// rule: after any doubt about the view (the informer starting, its list or
// watch failing, throttled or ended, a relist, a pause of the process), the
// view is fresh only once the cache the reconcilers read has delivered a
// resourceVersion read consistently after the doubt. Not on a response's
// headers, not after a stream stayed open for a while, not after a fixed
// time.
//
// The version is read by a barrier (barrier.go): a consistent LIST of one
// object, then a short watch resumed from the cache's own version, whose
// events and bookmark tell which of the informer's events up to that
// version it still has to deliver. A label-selected watch moves its
// resourceVersion only on matching events and on bookmarks, which come
// about once a minute, so the cache alone cannot show that nothing
// matching happened up to the version read; the short watch can, within
// about a second.
//
// A Monitor observes the informer's requests through its transport (Wrap),
// the informer itself (Attach) and the process's clock (Run), and is read
// by the reconcilers (Fresh, Epoch) and by its watchdog (Views.Watchdog).
package freshness

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
)

// Informer is what a Monitor reads of the informer whose view it judges:
// the resourceVersion its reflector last synced (set once a relist's
// result, or a watch event, is in the informer's queue) and its indexer's
// (set once that is delivered to the cache the reconcilers read).
type Informer interface {
	LastSyncResourceVersion() string
	GetIndexer() toolscache.Indexer
}

// Options say which requests are the informer's: a resource watched in
// every namespace or in one, with a label selector.
type Options struct {
	// Resource is the informer's resource, such as v1 pods.
	Resource schema.GroupVersionResource
	// Namespace is the one namespace the informer watches; empty for
	// every namespace. The barrier reads and watches there too.
	Namespace string
	// LabelSelector is its label selector, as sent.
	LabelSelector string
	// Kind, for a parent kind's view, is its kind (such as
	// WorkerPool.example.tally.dev), which its logs and metrics name;
	// empty for the pod view.
	Kind string
}

// name returns what the logs call the view's watch.
func (o Options) name() string {
	name := o.Kind
	if name == "" {
		name = "Pod"
	}
	if o.Namespace != "" {
		name += " in " + o.Namespace
	}
	return name
}

// path returns the path of the resource's list and watch: in every
// namespace, or in Namespace.
func (o Options) path() string {
	prefix := "/apis/" + o.Resource.Group + "/" + o.Resource.Version
	if o.Resource.Group == "" {
		prefix = "/api/" + o.Resource.Version
	}
	if o.Namespace != "" {
		prefix += "/namespaces/" + o.Namespace
	}
	return prefix + "/" + o.Resource.Resource
}

// resource returns the metadata client of the informer's resource, in its
// namespace when it has one.
func (m *Monitor) resource() metadata.ResourceInterface {
	if m.opts.Namespace == "" {
		return m.meta.Resource(m.opts.Resource)
	}
	return m.meta.Resource(m.opts.Resource).Namespace(m.opts.Namespace)
}

// Monitor judges the freshness of one informer's view, across the managers
// a process runs one after the other (Attach).
type Monitor struct {
	log  logr.Logger
	opts Options
	path string
	// meta reads the barrier's version and runs its watch.
	meta metadata.Interface
	// started is the origin of the monotonic offsets below.
	started time.Time
	// lastTick is when the clock last saw the process run, as an offset
	// from started; 0 before it runs.
	lastTick atomic.Int64
	// wake tells the barrier loop that a doubt was raised, or that the
	// informer was answered again after failing.
	wake chan struct{}

	mu       sync.Mutex
	informer Informer
	// gen counts the doubts; the view is fresh while cleared == gen. A
	// count taken in one generation is not written in another (Epoch).
	gen, cleared uint64
	// staleSince is when the view stopped being known fresh (an offset).
	staleSince time.Duration
	// loud is set when the doubts since the view was last fresh include a
	// failure (an error, a 429, a pause), which the log says.
	loud      bool
	loudSince time.Duration
	// answer is the status of the last answer to the informer's list or
	// watch (0 while a request waits for one, or got none); failing is set
	// while it was not 200.
	answer  int
	failing bool
	// bar is what the barrier of generation bar.gen established.
	bar barrierState
	// delivered is the last version the cache was seen to hold, and
	// progress when something last moved: a byte of the informer's list
	// or watch read, or that version changed.
	delivered string
	progress  time.Duration
	// metrics are the view's barrier metrics.
	metrics meters
	// relist is set while a relist is under way: from its request until
	// the informer's versions move from relistFrom (the reflector puts the
	// list in its store, then sets its synced version).
	relist     bool
	relistFrom versions
}

// versions are what an informer says it synced and its indexer holds.
type versions struct{ synced, stored string }

// versionsOf returns inf's versions; none when nil. Read apart from m.mu:
// the informer takes its own locks.
func versionsOf(inf Informer) versions {
	if inf == nil {
		return versions{}
	}
	return versions{inf.LastSyncResourceVersion(), inf.GetIndexer().LastStoreSyncResourceVersion()}
}

// barrierState is what a barrier established for one generation of doubt.
type barrierState struct {
	gen uint64
	// read is the version read consistently after the doubt: a cache that
	// holds it is fresh.
	read string
	// target, once proved, is a version such that the cache holds every
	// event up to read once it holds target (the watch showed none between
	// them).
	target string
	proved bool
	// began is when the barrier's first attempt started (an offset).
	began time.Duration
}

// New returns a Monitor whose barrier reads through cfg (which must not be
// one Wrap observes).
func New(log logr.Logger, cfg *rest.Config, opts Options) (*Monitor, error) {
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &Monitor{
		log: log, opts: opts, path: opts.path(), meta: meta, wake: make(chan struct{}, 1), metrics: metersOf(opts.Kind),
		// A moment before now: a first tick is never at offset 0.
		started: time.Now().Add(-time.Nanosecond),
	}, nil
}

// now returns the monotonic offset of the present.
func (m *Monitor) now() time.Duration { return time.Since(m.started) }

// Attach makes the monitor read inf, the informer of the manager about to
// start: its first list is a doubt like any other.
func (m *Monitor) Attach(inf Informer) {
	m.mu.Lock()
	m.informer, m.relist = inf, false
	m.mu.Unlock()
	m.doubt("the informer starts", false)
}

// doubt records a doubt about the view, for the reason given; loud ones
// (failures) are logged.
func (m *Monitor) doubt(reason string, loud bool) {
	m.mu.Lock()
	now := m.now()
	if m.cleared == m.gen {
		m.staleSince, m.loud = now, false
	}
	m.gen++
	logIt := loud && !m.loud
	if loud && !m.loud {
		m.loud, m.loudSince = true, now
	}
	m.mu.Unlock()
	if logIt {
		m.logWatch("interrupted: counts may be stale until it recovers", "interrupted: its parents are read from the API server until it recovers", "reason", reason)
	}
	m.poke()
}

// logWatch logs what happened to the view's watch: "Pod watch " and pod
// for the pod view, "Parent watch " and parent, with the kind, for a parent
// kind's.
func (m *Monitor) logWatch(pod, parent string, kv ...any) {
	if m.opts.Namespace != "" {
		kv = append([]any{"namespace", m.opts.Namespace}, kv...)
	}
	if m.opts.Kind == "" {
		m.log.Info("Pod watch "+pod, kv...)
		return
	}
	m.log.Info("Parent watch "+parent, append([]any{"kind", m.opts.Kind}, kv...)...)
}

// relisting records that the informer sent a relist: a doubt, and a doubt
// again once the relist is in the informer's store (delivered). The list
// is the API server's state when it began, however long it took to read:
// a version read before it was delivered proves nothing of what changed
// meanwhile.
func (m *Monitor) relisting() {
	m.mu.Lock()
	inf := m.informer
	m.mu.Unlock()
	from := versionsOf(inf)
	m.mu.Lock()
	m.relist, m.relistFrom = true, from
	m.mu.Unlock()
	m.doubt("a relist", false)
}

// relisted raises the second doubt of a relist once either of the
// informer's versions moved from what it was when the relist began: the
// relist is in its store (which the indexer's version shows first, the
// reflector's synced one right after). No watch runs during a relist, so
// nothing else moves them. Read before any decision on the view (Fresh,
// Epoch), so that a count taken from the relist is never written under the
// doubt before it. A relist that brings the very versions the informer had
// raises its second doubt with the next change instead, a barrier more.
func (m *Monitor) relisted() {
	m.mu.Lock()
	inf, pending, from := m.informer, m.relist, m.relistFrom
	m.mu.Unlock()
	if !pending || inf == nil {
		return
	}
	now := versionsOf(inf)
	if now.synced == from.synced && (now.stored == "" || now.stored == from.stored) {
		return
	}
	m.mu.Lock()
	// Unless another relist began meanwhile, whose doubt is its own.
	delivered := m.relist && m.relistFrom == from
	if delivered {
		m.relist = false
	}
	m.mu.Unlock()
	if delivered {
		m.doubt("a relist was delivered", false)
	}
}

// poke wakes the barrier loop.
func (m *Monitor) poke() {
	select {
	case m.wake <- struct{}{}:
	default:
	}
}

// Fresh reports whether the view is known fresh: no doubt since the cache
// last delivered a version read after the doubts before it, and the
// process has not just come back from a pause its clock has not seen yet.
func (m *Monitor) Fresh() bool {
	m.relisted()
	if m.paused() {
		return false
	}
	return m.check()
}

// Epoch returns the generation of doubt: counts taken while it returns one
// value were taken from one unbroken view.
func (m *Monitor) Epoch() uint64 {
	m.relisted()
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.gen
}

// Stale returns how long the view has not been known fresh; 0 while it is.
func (m *Monitor) Stale() time.Duration {
	if m.Fresh() {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.now() - m.staleSince
}

// staleAnswered reports whether the view is not fresh while the last
// answer to the informer's list or watch was one of statuses: 429 (the API
// server throttles it, as it does every replica), or 401 and 403 (refused:
// a permission missing).
func (m *Monitor) staleAnswered(statuses ...int) bool {
	fresh := m.Fresh()
	m.mu.Lock()
	defer m.mu.Unlock()
	return !fresh && slices.Contains(statuses, m.answer)
}

// stalled returns how long the view has not been fresh with nothing
// delivered meanwhile: no byte of the informer's list or watch read, no
// change of what its cache holds, nothing synced waiting to be delivered,
// and no answer to a barrier's watch that has yet to prove the view fresh.
// A relist that makes progress, however long, is not stalled; an informer
// that does not deliver what a barrier proved it must is.
func (m *Monitor) stalled() time.Duration {
	if m.Fresh() {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.now() - max(m.staleSince, m.progress)
}

// check brings the monitor up to date with what the informer has
// delivered, and reports whether the view is fresh.
func (m *Monitor) check() bool {
	m.mu.Lock()
	inf := m.informer
	m.mu.Unlock()
	var synced, stored string
	if inf != nil {
		// Read apart from m.mu: the informer takes its own locks.
		synced, stored = inf.LastSyncResourceVersion(), inf.GetIndexer().LastStoreSyncResourceVersion()
	}
	holds := holding(synced, stored)
	m.mu.Lock()
	now := m.now()
	if holds != m.delivered || (stored != "" && !caughtUp(synced, stored)) {
		// What the cache holds moved, or the informer is delivering what
		// its reflector synced: progress.
		m.delivered, m.progress = holds, now
	}
	if m.cleared == m.gen {
		m.mu.Unlock()
		return true
	}
	b := m.bar
	fresh := inf != nil && inf == m.informer && caughtUp(synced, stored) && b.gen == m.gen &&
		((b.read != "" && atLeast(holds, b.read)) || (b.proved && atLeast(holds, b.target)))
	var staleFor time.Duration
	loud := m.loud
	if fresh {
		m.cleared, m.loud = m.gen, false
		staleFor = now - m.loudSince
	}
	m.mu.Unlock()
	if fresh && loud {
		m.logWatch("delivering again", "delivering again", "staleFor", staleFor.Round(time.Millisecond).String())
	}
	return fresh
}

// progressed records that a byte of the informer's list or watch was read.
func (m *Monitor) progressed() {
	m.mu.Lock()
	m.progress = m.now()
	m.mu.Unlock()
}

// holding returns the version the cache the reconcilers read holds: the
// indexer's, or the reflector's where the indexer tells nothing (client-go's
// AtomicFIFO turned off).
func holding(synced, stored string) string {
	if stored != "" {
		return stored
	}
	return synced
}

// caughtUp reports whether the indexer holds everything the reflector
// synced. An indexer that tells nothing leaves the reflector's word alone.
func caughtUp(synced, stored string) bool {
	return synced != "" && (stored == "" || atLeast(stored, synced))
}

// atLeast reports whether resourceVersion a is b or newer. Versions from
// one API server compare as integers (KEP-5504); anything else compares by
// equality.
func atLeast(a, b string) bool {
	c, err := resourceversion.CompareResourceVersion(a, b)
	if err != nil {
		return a == b
	}
	return c >= 0
}
