package aggregate

import "sync"

// recordLocks makes two writers of one parent's finished pods mutually
// exclusive: the reconciler, from the pods' confirmation to the apply of
// the ledger that records them, and Unrecorded, from its read of that
// ledger to the release of the pods it does not hold, counted as lost.
// Without it a pod confirmed as tracked, then released as lost, then
// written into the ledger would be both folded into a total and counted as
// lost. A parent's lock exists only while it is held or waited for.
type recordLocks struct {
	mu   sync.Mutex
	held map[parentKey]*recordLock
}

type recordLock struct {
	sync.Mutex
	// users counts who holds or waits for it, under recordLocks.mu.
	users int
}

// lock takes the lock of parent k and returns what releases it. A nil
// recordLocks locks nothing.
func (l *recordLocks) lock(k parentKey) (unlock func()) {
	if l == nil {
		return func() {}
	}
	l.mu.Lock()
	if l.held == nil {
		l.held = map[parentKey]*recordLock{}
	}
	e := l.held[k]
	if e == nil {
		e = &recordLock{}
		l.held[k] = e
	}
	e.users++
	l.mu.Unlock()
	e.Lock()
	return func() {
		e.Unlock()
		l.mu.Lock()
		if e.users--; e.users == 0 {
			delete(l.held, k)
		}
		l.mu.Unlock()
	}
}
