package aggregate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"

	"tally.dev/tally/pkg/config"
)

// TestBrokenCountsWarnEachParentAtMostHourly: a kind with a custom count
// that cannot be kept warns each parent by an Event naming the count and
// its error, then not again for an hour; a kind without one never does.
func TestBrokenCountsWarnEachParentAtMostHourly(t *testing.T) {
	cfg, err := config.Parse([]byte(`parents: [{group: example.tally.dev, version: v1, kind: BrokenPool, customCounts: [
  {name: ready, path: status.ready, expression: 'pod.status.ready'},
  {name: running, path: status.running, expression: 'pod.status.phase == "Running"'}]}]`))
	require.NoError(t, err)
	b := newBrokenCounts(cfg.Parents[0])
	require.NotNil(t, b)
	assert.Nil(t, newBrokenCounts(config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "FinePool"}))

	long := "parents: [{group: example.tally.dev, version: v1, kind: LongPool, customCounts: ["
	for i := range 8 {
		long += fmt.Sprintf("{name: c%d, path: status.c%d, expression: 'pod.status.nope%d == \"%s\"'},", i, i, i, strings.Repeat("x", 200))
	}
	cfg, err = config.Parse([]byte(long + "]}]"))
	require.NoError(t, err)
	assert.LessOrEqual(t, len(newBrokenCounts(cfg.Parents[0]).message), maxNote, "the API server refuses a longer note, and the Event is lost")

	recorder := events.NewFakeRecorder(10)
	parent := &corev1.Pod{} // any object: the fake recorder does not read it
	start := time.Now()
	steps := []struct {
		uid   types.UID
		after time.Duration
		warns bool
	}{
		{"a", 0, true},
		{"a", time.Minute, false},
		{"b", time.Minute, true},
		{"a", brokenWarnEvery - time.Second, false},
		{"a", brokenWarnEvery, true},
		{"b", brokenWarnEvery + time.Minute, true},
	}
	for i, s := range steps {
		b.warn(recorder, parent, s.uid, start.Add(s.after))
		select {
		case e := <-recorder.Events:
			require.True(t, s.warns, "step %d warned again within the hour: %s", i, e)
			assert.Contains(t, e, `Warning CustomCountInvalid tally leaves unwritten the custom counts of BrokenPool.example.tally.dev it cannot keep `+
				`(the aggregator's log and kubectl tally doctor give each error): "ready" (parents[0].customCounts[0].expression: `+
				`the expression of BrokenPool.example.tally.dev's count "ready" does not compile: ERROR: parents[0].customCounts[0].expression:1:11: undefined field 'ready')`)
			assert.NotContains(t, e, "running")
		default:
			require.False(t, s.warns, "step %d did not warn", i)
		}
	}
}

// TestCustomCountReportsOncePerProcess: the reconcilers of the managers one
// process starts again (after a lost lease, an outage) share one report of
// a kind's broken custom counts, so that a parent is warned at most once an
// hour whatever happens.
func TestCustomCountReportsOncePerProcess(t *testing.T) {
	cfg, err := config.Parse([]byte(`parents: [{group: example.tally.dev, version: v1, kind: SharedPool, customCounts: [
  {name: ready, path: status.ready, expression: 'pod.status.ready'}]}]`))
	require.NoError(t, err)
	reports := NewCustomCountReports(cfg.Parents)
	first := NewReconciler(cfg.Parents[0], Deps{Reports: reports})
	again := NewReconciler(cfg.Parents[0], Deps{Reports: reports})
	require.NotNil(t, first.broken)
	assert.Same(t, first.broken, again.broken)
}
