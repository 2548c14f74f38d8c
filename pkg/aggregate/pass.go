package aggregate

import (
	"context"
	"sync"

	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate/count"
)

// pass is what one Reconcile carries, in its context, through the
// reconcile of its parent and the one more run on the parent read from the
// API server: the pod view's epoch its counts were taken in, the version
// of the parent the cache showed, the pods whose finalizer it released, and
// whether an apply met a newer parent than it read. Outside a Reconcile
// there is none, and a nil pass tells nothing.
type pass struct {
	epoch uint64
	// ns is the parent's namespace, whose pod view epoch is of.
	ns string

	mu       sync.Mutex
	cached   string
	released map[types.UID]bool
	lagged   bool
}

type passKey struct{}

func withPass(ctx context.Context, epoch uint64, ns string) (context.Context, *pass) {
	p := &pass{epoch: epoch, ns: ns, released: map[types.UID]bool{}}
	return context.WithValue(ctx, passKey{}, p), p
}

func passOf(ctx context.Context) *pass {
	p, _ := ctx.Value(passKey{}).(*pass)
	return p
}

// cachedAt records the parent's version as the cache showed it.
func (p *pass) cachedAt(rv string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cached = rv
}

// cachedVersion returns the parent's version as the cache showed it; empty
// when not read from the cache.
func (p *pass) cachedVersion() string {
	if p == nil {
		return ""
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cached
}

// release records that the pass released pod uid's finalizer.
func (p *pass) release(uid types.UID) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.released[uid] = true
}

// unreleased returns the pods the pass has not released.
func (p *pass) unreleased(pods []*count.Pod) []*count.Pod {
	if p == nil {
		return pods
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*count.Pod
	for _, pod := range pods {
		if !p.released[pod.UID] {
			out = append(out, pod)
		}
	}
	return out
}

// lag records that an apply met a newer parent than the pass read.
func (p *pass) lag() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lagged = true
}

// isLagged reports whether an apply of the pass met a newer parent than it
// read; false for no pass.
func (p *pass) isLagged() bool {
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lagged
}

// takeLagged reports, once, whether an apply met a newer parent.
func (p *pass) takeLagged() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	lagged := p.lagged
	p.lagged = false
	return lagged
}
