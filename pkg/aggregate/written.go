package aggregate

import (
	"slices"
	"sync"
	"time"
)

// maxStale bounds the versions remembered per parent as older than its last
// write: past it, the one seen longest ago is forgotten, and a cache showing
// it is read as if nothing were remembered (an apply from it meets a 409 Conflict, and
// the parent is counted again on the parent read from the API server).
const maxStale = 8

// writtenFor is how long after a parent's last write a version the cache
// shows that is neither the last write nor one known to be older (another
// writer's, or one forgotten past maxStale) keeps the parent's writes
// remembered; after it, such a version forgets them.
const writtenFor = 30 * time.Second

// written remembers, for each parent this replica wrote, the
// resourceVersion its last status apply produced and the versions it knows
// to be older: the one the parent cache showed when the parent was read, and
// the ones its earlier applies started from. While the cache shows one of
// those, it is behind this replica's own write (its watch is broken, or
// lags after an outage), and the parent is read from the API server
// instead: an apply from the cached version would only meet a conflict.
// resourceVersions are compared for equality only, as the API conventions
// ask. A parent's writes are forgotten once the cache shows the last one,
// once it shows another version writtenFor after the last write, or when
// the parent is gone: at most one entry per parent.
type written struct {
	mu      sync.Mutex
	parents map[parentKey]writes
}

type writes struct {
	last  string
	at    time.Time
	stale []string
}

func newWritten() *written {
	return &written{parents: map[parentKey]writes{}}
}

// wrote records that an apply at time now took parent from version from to
// version to, the cache having shown version cached when the reconcile read
// it (empty: not known). An apply the API server took without a change
// (to == from) tells nothing.
func (w *written) wrote(parent parentKey, cached, from, to string, now time.Time) {
	if to == "" || to == from {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.parents[parent]
	for _, rv := range []string{e.last, cached, from} {
		if rv == "" || rv == to {
			continue
		}
		// Seen again, it goes last: the version a stuck cache shows is
		// seen at every write, and is forgotten last.
		e.stale = slices.DeleteFunc(e.stale, func(s string) bool { return s == rv })
		if len(e.stale) == maxStale {
			e.stale = slices.Delete(e.stale, 0, 1)
		}
		e.stale = append(e.stale, rv)
	}
	e.last, e.at = to, now
	w.parents[parent] = e
}

// behind reports whether the cache, showing parent at version rv at time
// now, is behind this replica's last write of it.
func (w *written) behind(parent parentKey, rv string, now time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	e, ok := w.parents[parent]
	switch {
	case !ok:
		return false
	case slices.Contains(e.stale, rv):
		return true
	case rv == e.last || now.Sub(e.at) >= writtenFor:
		delete(w.parents, parent)
	}
	return false
}

// forget drops a parent that is gone.
func (w *written) forget(parent parentKey) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.parents, parent)
}
