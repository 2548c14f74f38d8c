package aggregate

import (
	"slices"
	"sync"

	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"tally.dev/tally/pkg/aggregate/count"
)

// Unstamped holds the pods a backfill sweep decided to stamp, as it read
// them, by the parent their stamp names, until the pod cache (which sees
// only stamped pods) shows them. The counts include them meanwhile: a
// fresh install into a cluster with many unstamped pods writes complete
// counts as soon as the sweep has read them, while the stamps follow at the
// client's rate.
type Unstamped struct {
	mu       sync.Mutex
	byKey    map[string]*count.Pod
	byParent map[types.UID]map[string]*count.Pod
	// notify, when set, is told of the pods whose entry came or went
	// outside of a reconcile, so that their parent is counted again.
	notify func(*count.Pod)
}

// NewUnstamped returns an empty Unstamped.
func NewUnstamped() *Unstamped {
	return &Unstamped{byKey: map[string]*count.Pod{}, byParent: map[types.UID]map[string]*count.Pod{}}
}

// Notify makes f be told of each pod whose entry came or went outside of a
// reconcile (a sweep's read, a pod gone before its stamp), so that its
// parent is counted again.
func (u *Unstamped) Notify(f func(*count.Pod)) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.notify = f
}

// replace makes pods, by pod key, what a sweep read.
func (u *Unstamped) replace(pods map[string]*count.Pod) {
	byParent := map[types.UID]map[string]*count.Pod{}
	for key, p := range pods {
		m := byParent[p.ParentUID]
		if m == nil {
			m = map[string]*count.Pod{}
			byParent[p.ParentUID] = m
		}
		m[key] = p
	}
	u.mu.Lock()
	old := u.byParent
	u.byKey, u.byParent = pods, byParent
	pendingStamps.Set(float64(len(pods)))
	notify := u.notify
	u.mu.Unlock()
	if notify == nil {
		return
	}
	for _, m := range []map[types.UID]map[string]*count.Pod{old, byParent} {
		for _, byKey := range m {
			for _, p := range byKey {
				notify(p) // one per parent
				break
			}
		}
	}
}

// in returns the pods held in namespaces.
func (u *Unstamped) in(namespaces []string) map[string]*count.Pod {
	u.mu.Lock()
	defer u.mu.Unlock()
	held := map[string]*count.Pod{}
	for key, p := range u.byKey {
		if slices.Contains(namespaces, p.Namespace) {
			held[key] = p
		}
	}
	return held
}

// Forget drops the pod under key: the cache shows it now (the pod
// informer's event handlers call it with every pod they are given), or it
// is gone. A pod gone before the cache showed it has its parent counted
// again.
func (u *Unstamped) Forget(key string, gone bool) {
	u.mu.Lock()
	p := u.drop(key)
	notify := u.notify
	u.mu.Unlock()
	if p != nil && gone && notify != nil {
		notify(p)
	}
}

// drop removes the pod under key; u.mu is held.
func (u *Unstamped) drop(key string) *count.Pod {
	p, ok := u.byKey[key]
	if !ok {
		return nil
	}
	delete(u.byKey, key)
	pendingStamps.Set(float64(len(u.byKey)))
	if m := u.byParent[p.ParentUID]; m != nil {
		delete(m, key)
		if len(m) == 0 {
			delete(u.byParent, p.ParentUID)
		}
	}
	return p
}

// PodsOf returns the pods the cache (pods, the pod index)
// files under parent, and the pods held for parent that those do not
// include: each pod once, whether its stamp reached the cache or not.
//
// The held pods are taken first, forgetting those the cache shows (it
// counts them from then on), and the cache's after: a pod the cache is
// given in between is then in both, and counted from the cache. The other
// order would lose it: not yet in the cache's pods, and forgotten (here or
// by EventHandler) before the held ones are taken.
func (u *Unstamped) PodsOf(pods count.Index, parent types.UID) (cached, held []*count.Pod, err error) {
	held = u.of(parent, pods)
	if cached, err = count.PodsOf(pods, parent); err != nil || len(held) == 0 {
		return cached, nil, err
	}
	keys := make(map[string]bool, len(cached))
	for _, p := range cached {
		keys[p.Namespace+"/"+p.Name] = true
	}
	out := held[:0]
	for _, p := range held {
		if !keys[p.Namespace+"/"+p.Name] {
			out = append(out, p)
		}
	}
	return cached, out, nil
}

// of returns the parent's held pods that the cache does not show, and
// forgets those it shows.
func (u *Unstamped) of(parent types.UID, pods count.Index) []*count.Pod {
	if u == nil {
		return nil
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []*count.Pod
	for key, p := range u.byParent[parent] {
		if _, exists, err := pods.GetByKey(key); err == nil && exists {
			u.drop(key)
			continue
		}
		out = append(out, p)
	}
	return out
}

// Keys returns the keys of the pods held.
func (u *Unstamped) Keys() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make([]string, 0, len(u.byKey))
	for key := range u.byKey {
		out = append(out, key)
	}
	return out
}

// EventHandler returns the pod informer's handler that forgets each pod
// the cache is given (stamped, a pod enters the label-selected cache as an
// addition): from then on the cache counts it, even if it goes again before
// a reconcile looks (PodsOf covers the rest).
func (u *Unstamped) EventHandler() toolscache.ResourceEventHandler {
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if p, ok := obj.(*count.Pod); ok {
				u.Forget(p.Namespace+"/"+p.Name, false)
			}
		},
	}
}
