package demo

import (
	"image/png"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"tally.dev/tally/pkg/config"
)

// syntheticTimeline is a scale-down from 6 to 2 replicas with one crash.
func syntheticTimeline(totals bool) *timeline {
	t := newTimeline(time.Unix(0, 0))
	counts := func(active, completing int64) map[config.Count]int64 {
		return map[config.Count]int64{config.Active: active, config.Completing: completing}
	}
	for i := range 40 {
		s := Snapshot{Desired: 6, Tally: counts(6, 0), Truth: counts(6, 0)}
		if i >= 10 {
			s.Desired, s.Tally, s.Truth = 2, counts(2, 4-int64(min(4, (i-10)/3))), counts(2, 4-int64(min(4, (i-9)/3)))
		}
		if i < 2 {
			s.Tally = map[config.Count]int64{config.Active: -1, config.Completing: -1}
		}
		if totals {
			done := int64(min(4, max(0, (i-9)/3)))
			s.Totals = map[config.Count]int64{config.CompletedTotal: max(0, done-1), config.UnexpectedTotal: 0}
			s.Finished = map[config.Count]int64{config.CompletedTotal: done}
		}
		t.samples = append(t.samples, sample{at: time.Duration(i) * 250 * time.Millisecond, Snapshot: s})
	}
	t.events = []event{
		{at: 0, kind: scaled, what: "6 replicas"},
		{at: 2500 * time.Millisecond, kind: scaled, what: "2 replicas"},
		{at: 3 * time.Second, kind: crashed, what: "workers-abc"},
		{at: 4 * time.Second, kind: deleted, what: "workers-def"},
		{at: 8 * time.Second, kind: ended, what: "scenario over"},
	}
	return t
}

func TestPlot(t *testing.T) {
	tests := []struct {
		name   string
		totals bool
		height int
	}{
		{"counts only", false, 6 * 96},
		{"counts and totals", true, 9 * 96},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &Demo{totals: tt.totals, timeline: syntheticTimeline(tt.totals)}
			path := filepath.Join(t.TempDir(), PlotFile)
			require.NoError(t, d.plot(path, "PASS"))
			f, err := os.Open(path)
			require.NoError(t, err)
			defer f.Close()
			img, err := png.Decode(f)
			require.NoError(t, err)
			assert.Equal(t, 12*96, img.Bounds().Dx())
			assert.Equal(t, tt.height, img.Bounds().Dy())
		})
	}
}

func TestPlotWithoutSamples(t *testing.T) {
	d := &Demo{timeline: newTimeline(time.Now())}
	assert.ErrorContains(t, d.plot(filepath.Join(t.TempDir(), PlotFile), "PASS"), "no snapshot")
}

func TestWholeTicks(t *testing.T) {
	tests := []struct {
		lo, hi float64
		want   []float64
	}{
		{0, 6, []float64{0, 1, 2, 3, 4, 5, 6}},
		{0, 26, []float64{0, 5, 10, 15, 20, 25}},
		{0, 75, []float64{0, 10, 20, 30, 40, 50, 60, 70}},
		{0, 0.5, []float64{0}},
	}
	for _, tt := range tests {
		var got []float64
		for _, tick := range (wholeTicks{}).Ticks(tt.lo, tt.hi) {
			got = append(got, tick.Value)
		}
		assert.Equal(t, tt.want, got, "%v..%v", tt.lo, tt.hi)
	}
}
