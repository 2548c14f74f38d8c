package aggregate

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

func TestWrittenBehind(t *testing.T) {
	pool := parentKey{kind: schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}, name: types.NamespacedName{Namespace: "ns", Name: "pool"}}
	other := parentKey{kind: pool.kind, name: types.NamespacedName{Namespace: "ns", Name: "other"}}
	start := time.Now()
	type write struct{ cached, from, to string }
	type read struct {
		rv     string
		after  time.Duration // since the writes
		behind bool
	}
	tests := []struct {
		name   string
		writes []write
		reads  []read
	}{
		{name: "never written", reads: []read{{"1", 0, false}}},
		{name: "the cache shows the version written from", writes: []write{{"1", "1", "2"}},
			reads: []read{{"1", 0, true}, {"1", time.Hour, true}}},
		{name: "the cache caught up, and the writes are forgotten", writes: []write{{"1", "1", "2"}},
			reads: []read{{"2", 0, false}, {"1", 0, false}}},
		{name: "another version soon after the write: the writes are kept", writes: []write{{"1", "1", "3"}},
			reads: []read{{"2", 0, false}, {"1", 0, true}}},
		{name: "another version long after the write: the writes are forgotten", writes: []write{{"1", "1", "3"}},
			reads: []read{{"4", writtenFor, false}, {"1", writtenFor, false}}},
		{name: "a write from a live read: the cached and the read versions are both older",
			writes: []write{{"1", "5", "6"}}, reads: []read{{"1", 0, true}, {"5", 0, true}, {"6", 0, false}}},
		{name: "a chain of writes: the cache behind at any version before the last",
			writes: []write{{"1", "1", "2"}, {"1", "2", "3"}, {"1", "3", "4"}},
			reads:  []read{{"1", 0, true}, {"2", 0, true}, {"3", 0, true}, {"4", 0, false}}},
		{name: "the version the cache showed not known", writes: []write{{"", "1", "2"}},
			reads: []read{{"1", 0, true}, {"", 0, false}, {"1", 0, true}}},
		{name: "an apply taken without a change tells nothing", writes: []write{{"5", "5", "5"}},
			reads: []read{{"5", 0, false}}},
		{name: "an apply taken without a change after a write keeps the write", writes: []write{{"1", "1", "2"}, {"1", "2", "2"}},
			reads: []read{{"1", 0, true}, {"2", 0, false}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWritten()
			for _, wr := range tt.writes {
				w.wrote(pool, wr.cached, wr.from, wr.to, start)
			}
			for _, r := range tt.reads {
				assert.Equal(t, r.behind, w.behind(pool, r.rv, start.Add(r.after)), "the cache at %q, %s after the writes", r.rv, r.after)
				assert.False(t, w.behind(other, r.rv, start), "another parent")
			}
		})
	}
}

// TestWrittenBounded: at most maxStale versions per parent; one forgotten
// past it does not make the parent's other writes forgotten.
func TestWrittenBounded(t *testing.T) {
	pool := parentKey{name: types.NamespacedName{Namespace: "ns", Name: "pool"}}
	now := time.Now()
	w := newWritten()
	for v := 1; v <= 3*maxStale; v++ {
		w.wrote(pool, "1", fmt.Sprint(v), fmt.Sprint(v+1), now)
	}
	assert.Len(t, w.parents[pool].stale, maxStale)
	assert.True(t, w.behind(pool, "1", now), "the version the cache showed at every write is kept")
	assert.False(t, w.behind(pool, "2", now), "an old version is forgotten past maxStale")
	assert.True(t, w.behind(pool, fmt.Sprint(3*maxStale), now), "and the newer ones are still known")

	// The cache stuck at 100 while another writer writes between this
	// replica's writes: 100 is seen at every write, and never forgotten.
	w = newWritten()
	for v := 200; v < 200+3*maxStale; v += 3 {
		w.wrote(pool, "100", fmt.Sprint(v), fmt.Sprint(v+1), now)
	}
	assert.True(t, w.behind(pool, "100", now), "the stuck cache's version is kept")
	w.forget(pool)
	assert.False(t, w.behind(pool, "100", now), "forgotten")
	assert.Empty(t, w.parents)
}
