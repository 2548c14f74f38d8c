package aggregate

import (
	"slices"
	"sync"
)

// maxStale bounds the versions remembered per parent as older than its last
// write: past it, the oldest is forgotten, and a cache showing it costs one
// 409 Conflict, as without the memory.
const maxStale = 8

// written remembers, for each parent this replica wrote, the
// resourceVersion its last status apply produced and the versions it knows
// to be older: the one the parent cache showed when the parent was read, and
// the ones its earlier applies started from. While the cache shows one of
// those, it is behind this replica's own write (its watch is broken, or
// lags after an outage), and the parent is read from the API server
// instead: an apply from the cached version would only meet a conflict.
// resourceVersions are compared for equality only, as the API conventions
// ask.
type written struct {
	mu      sync.Mutex
	parents map[parentKey]writes
}

type writes struct {
	last  string
	stale []string
}

func newWritten() *written {
	return &written{parents: map[parentKey]writes{}}
}

// wrote records that an apply took parent from version from to version to,
// the cache having shown version cached when the reconcile read it (empty:
// not known).
func (w *written) wrote(parent parentKey, cached, from, to string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.parents[parent]
	if e.last != "" {
		e.stale = appendStale(e.stale, e.last)
	}
	e.stale = appendStale(appendStale(e.stale, cached), from)
	e.last = to
	w.parents[parent] = e
}

func appendStale(stale []string, rv string) []string {
	if rv == "" || slices.Contains(stale, rv) {
		return stale
	}
	if len(stale) == maxStale {
		stale = slices.Delete(stale, 0, 1)
	}
	return append(stale, rv)
}

// behind reports whether the cache, showing parent at version rv, is
// behind this replica's last write of it. Once the cache shows any other
// version (the last write, or a newer one from another writer), the
// parent's writes are forgotten.
func (w *written) behind(parent parentKey, rv string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	e, ok := w.parents[parent]
	if !ok {
		return false
	}
	if slices.Contains(e.stale, rv) {
		return true
	}
	delete(w.parents, parent)
	return false
}

// forget drops a parent that is gone.
func (w *written) forget(parent parentKey) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.parents, parent)
}
