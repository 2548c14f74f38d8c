package freshness

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
)

// barrierWatchSeconds is how long the barrier's watch asks to stay open.
// The API server sends a watch a bookmark 2 s before its deadline (the
// cacher's nextBookmarkTime), with the newest version its cache has seen:
// a watch of 3 s brings its bookmark within about a second.
const barrierWatchSeconds = 3

// barrierPoll is how often a barrier looks whether its doubt was
// superseded, or whether the cache moved on.
const barrierPoll = 50 * time.Millisecond

var (
	// errExpired: the watch's version is older than the API server keeps.
	errExpired = errors.New("the version is too old for a watch")
	// errSuperseded: a newer doubt came, or the view is fresh already.
	errSuperseded = errors.New("superseded")
)

// Run runs the process's clock and the barriers until ctx is done.
func (m *Monitor) Run(ctx context.Context) {
	go m.clock(ctx)
	var wait backoff
	for {
		gen, ok := m.needsBarrier()
		if !ok {
			select {
			case <-ctx.Done():
				return
			case <-m.wake:
			}
			continue
		}
		err := m.barrier(ctx, gen)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, errSuperseded) || err != nil && m.superseded(gen):
			// (A request given up because a newer doubt came fails too.)
			m.metrics.barriers("superseded").Inc()
		case err != nil:
			m.metrics.barriers("error").Inc()
			d := wait.next()
			m.log.V(1).Info("A view's barrier failed; trying again", "view", m.opts.name(), "error", err.Error(), "in", d.String())
			// A new doubt, or the informer answered again after failing,
			// ends the wait; not one that came before it.
			select {
			case <-m.wake:
			default:
			}
			select {
			case <-ctx.Done():
				return
			case <-m.wake:
			case <-time.After(d):
			}
		default:
			m.metrics.barriers("proved").Inc()
			wait.reset()
		}
	}
}

// needsBarrier returns the generation of doubt a barrier has yet to prove
// the view fresh for.
func (m *Monitor) needsBarrier() (uint64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cleared == m.gen || (m.bar.gen == m.gen && m.bar.proved) {
		return 0, false
	}
	return m.gen, true
}

// barrier proves the view fresh after the doubt of generation gen:
//  1. read consistently the resourceVersion now (a LIST of at most one
//     object: the API server serves it from its cache once the cache holds
//     etcd's current revision, KEP-2340);
//  2. watch from the version the cache holds, with the informer's
//     selector, until an event or bookmark at or past the version read: the
//     events up to it are those the informer has yet to deliver, and the
//     newest of them (or the cache's own version, if none) is the target;
//  3. the view is fresh once the cache holds the target, or the version
//     read (check).
//
// A cache whose version the API server no longer keeps (410) is usually
// relisting: the watch starts again from what the relist delivers, or as it
// was after expiredWait.
func (m *Monitor) barrier(ctx context.Context, gen uint64) error {
	began := m.now()
	// A request hung on a connection that carries nothing is given up once
	// a newer doubt comes.
	ctx, cancel := m.whileCurrent(ctx, gen)
	defer cancel()
	read, err := m.readVersion(ctx)
	if err != nil {
		if m.superseded(gen) {
			return errSuperseded
		}
		return fmt.Errorf("reading the current resourceVersion: %w", err)
	}
	if !m.setRead(gen, read, began) {
		return errSuperseded
	}
	from, err := m.waitHolding(ctx, gen, "", 0)
	if err != nil {
		return err
	}
	target := from
	for !atLeast(from, read) {
		res, err := m.watchFrom(ctx, gen, from, read)
		switch {
		case errors.Is(err, errExpired):
			// Usually the informer relists: go on from what it delivers.
			// Another API server than the informer's may have answered
			// (one just started keeps a shorter history): after a while,
			// the watch is sent again as it was.
			next, err := m.waitHolding(ctx, gen, from, expiredWait)
			if err != nil {
				return err
			}
			if next != from {
				from, target = next, next
			}
			continue
		case err != nil:
			return err
		}
		if res.need != "" && !atLeast(target, res.need) {
			target = res.need
		}
		if res.proved {
			break
		}
		if res.last == "" || res.last == from || !atLeast(res.last, from) {
			// The watch ended with nothing past from, not even a
			// bookmark: the API server's cache has seen nothing past it
			// (one without consistent reads from its cache), or something
			// between ends watches at once. Tried again after a back-off.
			return fmt.Errorf("the watch from resourceVersion %s ended before it reached %s (an API server whose watch cache does not "+
				"request progress from etcd, as before Kubernetes 1.31, without ConsistentListFromCache, or with an etcd older than 3.5.13, reaches it only with the next change)", from, read)
		}
		// The watch ended before it reached the version read: go on from
		// where it was.
		from = res.last
	}
	m.log.V(1).Info("View barrier proved", "view", m.opts.name(), "read", read, "target", target)
	m.prove(gen, target)
	return nil
}

// expiredWait is how long a barrier whose watch was answered 410 Gone
// waits for the informer to relist before it sends the watch again.
const expiredWait = 5 * time.Second

// whileCurrent returns a context that ends with ctx, or once gen is
// superseded.
func (m *Monitor) whileCurrent(ctx context.Context, gen uint64) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		t := time.NewTicker(barrierPoll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if m.superseded(gen) {
					cancel()
					return
				}
			}
		}
	}()
	return ctx, cancel
}

// readVersion reads the resource's current resourceVersion consistently.
func (m *Monitor) readVersion(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	m.metrics.requests.Inc()
	list, err := m.resource().List(ctx, metav1.ListOptions{LabelSelector: m.opts.LabelSelector, Limit: 1})
	if err != nil {
		return "", err
	}
	if list.GetResourceVersion() == "" {
		return "", errors.New("the list has no resourceVersion")
	}
	return list.GetResourceVersion(), nil
}

// watched is what a barrier's watch showed.
type watched struct {
	// need is the newest event's version up to the version read: events
	// come in order of version.
	need string
	// last is the version of the last event or bookmark.
	last string
	// proved is set once an event or bookmark at or past the version read
	// came: every event up to it came before.
	proved bool
}

// watchFrom watches from version from until it shows every event up to
// read, ends, or gen is superseded.
func (m *Monitor) watchFrom(ctx context.Context, gen uint64, from, read string) (watched, error) {
	var res watched
	ctx, cancel := context.WithTimeout(ctx, (barrierWatchSeconds+10)*time.Second)
	defer cancel()
	m.metrics.requests.Inc()
	w, err := m.resource().Watch(ctx, metav1.ListOptions{
		LabelSelector: m.opts.LabelSelector, ResourceVersion: from,
		AllowWatchBookmarks: true, TimeoutSeconds: ptr.To[int64](barrierWatchSeconds),
	})
	if err != nil {
		if expired(err) {
			return res, errExpired
		}
		return res, err
	}
	defer w.Stop()
	opened := time.Now()
	poll := time.NewTicker(barrierPoll)
	defer poll.Stop()
	for {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-poll.C:
			if m.superseded(gen) {
				return res, errSuperseded
			}
		case ev, ok := <-w.ResultChan():
			// An API server whose pod cache lags behind the version read
			// answers the barrier with bookmarks behind it, or with a
			// watch that stays open to its end with nothing: a new
			// informer would wait for the same, so that is no stall. An
			// error (410 among them: the informer relists, and a relist
			// that delivers nothing is a stall), or a watch ended early,
			// is not progress; nor is anything once the view is proved.
			if ok && ev.Type != watch.Error || !ok && time.Since(opened) >= (barrierWatchSeconds-1)*time.Second {
				m.progressed()
			}
			if !ok {
				return res, nil
			}
			if ev.Type == watch.Error {
				err := apierrors.FromObject(ev.Object)
				if expired(err) {
					err = errExpired
				}
				return res, err
			}
			obj, err := meta.Accessor(ev.Object)
			if err != nil {
				return res, err
			}
			rv := obj.GetResourceVersion()
			res.last = rv
			if ev.Type != watch.Bookmark && atLeast(read, rv) {
				// Events come in order of version, one object to a
				// version.
				res.need = rv
			}
			// An event or bookmark at or past the version read: every
			// event up to it came before. (The API server sends a
			// bookmark only past the last version it sent.)
			if atLeast(rv, read) {
				res.proved = true
				return res, nil
			}
		}
	}
}

func expired(err error) bool { return apierrors.IsResourceExpired(err) || apierrors.IsGone(err) }

// setRead records the version read for gen; false if gen is superseded.
func (m *Monitor) setRead(gen uint64, read string, began time.Duration) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gen != gen || m.cleared == gen {
		return false
	}
	if m.bar.gen != gen {
		m.bar = barrierState{gen: gen, began: began}
	}
	m.bar.read = read
	return true
}

// prove records the target the barrier of gen proved.
func (m *Monitor) prove(gen uint64, target string) {
	m.mu.Lock()
	if m.bar.gen == gen {
		m.bar.target, m.bar.proved = target, true
		m.metrics.seconds.Observe((m.now() - m.bar.began).Seconds())
	}
	m.mu.Unlock()
	m.check()
}

// superseded reports whether a newer doubt came after gen, or the view is
// fresh already.
func (m *Monitor) superseded(gen uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.gen != gen || m.cleared == gen
}

// waitHolding waits until the cache holds a version other than not, and
// returns it; or, when limit is not 0, returns not once limit has passed.
func (m *Monitor) waitHolding(ctx context.Context, gen uint64, not string, limit time.Duration) (string, error) {
	deadline := m.now() + limit
	for {
		if limit > 0 && m.now() >= deadline {
			return not, nil
		}
		m.check()
		if m.superseded(gen) {
			return "", errSuperseded
		}
		m.mu.Lock()
		holds := m.delivered
		m.mu.Unlock()
		if holds != "" && holds != not {
			return holds, nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(barrierPoll):
		}
	}
}

// backoff is the wait between failed barriers: from 200 ms, doubling, to
// 5 s, with a jitter of a fifth either way.
type backoff struct{ last time.Duration }

func (b *backoff) next() time.Duration {
	b.last = min(max(2*b.last, 200*time.Millisecond), 5*time.Second)
	return time.Duration(float64(b.last) * (0.8 + 0.4*rand.Float64()))
}

func (b *backoff) reset() { b.last = 0 }
