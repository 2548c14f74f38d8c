package aggregate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/count/counttest"
)

func TestUnstamped(t *testing.T) {
	read := func(name string, parent types.UID) *count.Pod {
		p := counttest.Pod(types.UID(name), corev1.PodRunning, false, false, false)
		p.ParentUID, p.Controller.UID = parent, parent
		return p
	}
	a1, a2, b1 := read("a1", "a"), read("a2", "a"), read("b1", "b")
	cache := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	u := NewUnstamped()
	var notified []types.UID
	u.Notify(func(p *count.Pod) { notified = append(notified, p.ParentUID) })

	held := func(parent types.UID) []*count.Pod {
		_, held, err := u.PodsOf(cache, parent)
		require.NoError(t, err)
		return held
	}
	u.replace(map[string]*count.Pod{"ns/a1": a1, "ns/a2": a2, "ns/b1": b1})
	assert.ElementsMatch(t, []types.UID{"a", "b"}, notified, "every parent read is counted again")
	assert.ElementsMatch(t, counttest.UIDs([]*count.Pod{a1, a2}), counttest.UIDs(held("a")))

	// Stamped: the cache shows it, and counts it from then on.
	stamped := read("a1", "a")
	stamped.Tracking = true
	require.NoError(t, cache.Add(stamped))
	cached, _, err := u.PodsOf(cache, "a")
	require.NoError(t, err)
	assert.Equal(t, counttest.UIDs([]*count.Pod{stamped}), counttest.UIDs(cached))
	assert.ElementsMatch(t, counttest.UIDs([]*count.Pod{a2}), counttest.UIDs(held("a")))
	assert.Len(t, u.Keys(), 2)

	// Given to the cache by its informer, then deleted before a reconcile:
	// forgotten all the same.
	notified = nil
	u.EventHandler().OnAdd(read("b1", "b"), false)
	assert.Empty(t, held("b"))
	assert.Empty(t, notified, "a pod the cache was given is counted from the cache's own event")

	// Gone before its stamp.
	u.Forget("ns/a2", true)
	assert.Empty(t, held("a"))
	assert.Equal(t, []types.UID{"a"}, notified)
	assert.Empty(t, u.Keys())

	// The next sweep's read replaces the last.
	notified = nil
	u.replace(map[string]*count.Pod{"ns/b2": read("b2", "b")})
	assert.Equal(t, []types.UID{"b"}, notified)
	assert.Len(t, held("b"), 1)
	_, none, err := (*Unstamped)(nil).PodsOf(cache, "b")
	require.NoError(t, err)
	assert.Nil(t, none)
}

// lateCache is an indexer whose pods arrive just after the held pods are
// taken: GetByKey does not show them yet, the index does.
type lateCache struct{ toolscache.Indexer }

func (lateCache) GetByKey(string) (any, bool, error) { return nil, false, nil }

// TestUnstampedCountsAPodOnce: a pod the cache is given while a reconcile
// reads is counted once, from the cache.
func TestUnstampedCountsAPodOnce(t *testing.T) {
	p := counttest.Pod("p", corev1.PodRunning, false, false, false)
	p.ParentUID, p.Controller.UID = "a", "a"
	cache := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, count.Indexers)
	require.NoError(t, cache.Add(p))
	u := NewUnstamped()
	u.replace(map[string]*count.Pod{"ns/p": p})
	cached, held, err := u.PodsOf(lateCache{cache}, "a")
	require.NoError(t, err)
	assert.Len(t, cached, 1)
	assert.Empty(t, held)
}
