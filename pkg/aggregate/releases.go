package aggregate

import (
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
)

// releaseExpiry is how long this process remembers a finalizer it removed
// when the pod is neither in a ledger nor seen since: the memory only spares
// reads from the API server, so forgetting early costs one read.
const releaseExpiry = 10 * time.Minute

// releases remembers, per parent, the pods whose finalizer this process
// removed (the API server accepted the patch), until the cache shows it.
// Such a pod can be folded without reading it from the API server, and is
// not recorded again while the cache still shows its finalizer.
type releases struct {
	mu        sync.Mutex
	byParent  map[types.UID]map[types.UID]time.Time
	lastPrune time.Time
}

func newReleases() *releases {
	return &releases{byParent: map[types.UID]map[types.UID]time.Time{}}
}

func (r *releases) add(parent, pod types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.byParent[parent]
	if m == nil {
		m = map[types.UID]time.Time{}
		r.byParent[parent] = m
	}
	m[pod] = time.Now()
}

// of returns the parent's released pods, with when each was released.
func (r *releases) of(parent types.UID) map[types.UID]time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[types.UID]time.Time, len(r.byParent[parent]))
	for uid, at := range r.byParent[parent] {
		out[uid] = at
	}
	return out
}

// settle forgets the parent's released pods that neither ledger holds (the
// one the cached parent shows, read, and the one just written) and that the
// cache shows without the finalizer (or not at all), and, at most once a
// minute, every entry older than releaseExpiry. A parent cache one write
// behind still shows a pod folded just now: it is remembered until the
// cache has caught up, so that it is not read (or listed, once deleted) for
// nothing.
func (r *releases) settle(parent types.UID, pods []*count.Pod, read, written *ledger.Book) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if m := r.byParent[parent]; m != nil {
		cached := make(map[types.UID]*count.Pod, len(pods))
		for _, p := range pods {
			cached[p.UID] = p
		}
		for uid := range m {
			if p, ok := cached[uid]; !read.Has(uid) && !written.Has(uid) && (!ok || !p.Tracking) {
				delete(m, uid)
			}
		}
		if len(m) == 0 {
			delete(r.byParent, parent)
		}
	}
	now := time.Now()
	if now.Sub(r.lastPrune) < time.Minute {
		return
	}
	r.lastPrune = now
	for p, m := range r.byParent {
		for uid, at := range m {
			if now.Sub(at) > releaseExpiry {
				delete(m, uid)
			}
		}
		if len(m) == 0 {
			delete(r.byParent, p)
		}
	}
}
