package aggregate

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

func TestWrittenBehind(t *testing.T) {
	pool := parentKey{kind: schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}, name: types.NamespacedName{Namespace: "ns", Name: "pool"}}
	other := parentKey{kind: pool.kind, name: types.NamespacedName{Namespace: "ns", Name: "other"}}
	type write struct{ cached, from, to string }
	tests := []struct {
		name   string
		writes []write
		// cache is the version the cache shows, in turn; behind what
		// behind answers for each.
		cache  []string
		behind []bool
	}{
		{name: "never written", cache: []string{"1"}, behind: []bool{false}},
		{name: "the cache shows the version written from", writes: []write{{"1", "1", "2"}},
			cache: []string{"1", "1"}, behind: []bool{true, true}},
		{name: "the cache caught up, then is forgotten", writes: []write{{"1", "1", "2"}},
			cache: []string{"2", "1"}, behind: []bool{false, false}},
		{name: "a newer version from another writer", writes: []write{{"1", "1", "2"}},
			cache: []string{"3", "1"}, behind: []bool{false, false}},
		{name: "a write from a live read: the cached and the read versions are both older",
			writes: []write{{"1", "5", "6"}}, cache: []string{"1", "5", "6"}, behind: []bool{true, true, false}},
		{name: "a chain of writes: the cache behind at any version before the last",
			writes: []write{{"1", "1", "2"}, {"1", "2", "3"}, {"1", "3", "4"}},
			cache:  []string{"1", "2", "3", "4"}, behind: []bool{true, true, true, false}},
		{name: "the version the cache showed not known", writes: []write{{"", "1", "2"}},
			cache: []string{"1", ""}, behind: []bool{true, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWritten()
			for _, wr := range tt.writes {
				w.wrote(pool, wr.cached, wr.from, wr.to)
			}
			for i, rv := range tt.cache {
				assert.Equal(t, tt.behind[i], w.behind(pool, rv), "the cache at %q", rv)
				assert.False(t, w.behind(other, rv), "another parent")
			}
		})
	}
}

func TestWrittenBounded(t *testing.T) {
	pool := parentKey{name: types.NamespacedName{Namespace: "ns", Name: "pool"}}
	w := newWritten()
	for v := 1; v <= 3*maxStale; v++ {
		w.wrote(pool, fmt.Sprint(v), fmt.Sprint(v), fmt.Sprint(v+1))
	}
	assert.Len(t, w.parents[pool].stale, maxStale)
	assert.True(t, w.behind(pool, fmt.Sprint(3*maxStale)), "the newest older version is kept")
	assert.False(t, w.behind(pool, "1"), "the oldest is forgotten past maxStale, and with it the parent")
	w.wrote(pool, "1", "1", "2")
	w.forget(pool)
	assert.False(t, w.behind(pool, "1"), "forgotten")
}
