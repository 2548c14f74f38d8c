package demo

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"tally.dev/tally/pkg/config"
)

func TestLine(t *testing.T) {
	counts := func(active, completing int64) map[config.Count]int64 {
		return map[config.Count]int64{config.Active: active, config.Completing: completing, config.Completed: 0, config.Unexpected: 0}
	}
	unknownCounts := map[config.Count]int64{config.Active: -1, config.Completing: -1, config.Completed: -1, config.Unexpected: -1}
	totals := func(completed, unexpected int64) map[config.Count]int64 {
		return map[config.Count]int64{config.CompletedTotal: completed, config.UnexpectedTotal: unexpected}
	}
	tests := []struct {
		name string
		s    Snapshot
		// countsMark and totalsMark are the marks before "list:" and
		// "finished:"; totalsMark is empty when the line has no totals.
		countsMark, totalsMark string
		// contains are parts of the line.
		contains []string
	}{{
		name:       "counts equal, no totals",
		s:          Snapshot{Desired: 6, Tally: counts(6, 0), Truth: counts(6, 0)},
		countsMark: "=",
		contains:   []string{"tally: active=6   completing=0 "},
	}, {
		name:       "counts differ",
		s:          Snapshot{Desired: 2, Tally: counts(2, 3), Truth: counts(2, 4)},
		countsMark: "≠",
	}, {
		name:       "counts not shown yet",
		s:          Snapshot{Desired: 6, Tally: unknownCounts, Truth: counts(6, 0)},
		countsMark: "-",
		contains:   []string{"tally: active=-   completing=-   completed=-   unexpected=- "},
	}, {
		name: "a custom count beside the others, differing",
		s: Snapshot{Desired: 6, Custom: []config.Count{"ready"},
			Tally: withCustom(counts(6, 0), "ready", 4), Truth: withCustom(counts(6, 0), "ready", 5)},
		countsMark: "≠",
		contains:   []string{"unexpected=0   ready=4   ≠ list:", "ready=5"},
	}, {
		name:       "totals not shown before the first pod finishes",
		s:          Snapshot{Desired: 6, Tally: counts(6, 0), Truth: counts(6, 0), Totals: totals(-1, -1), Finished: totals(0, 0)},
		countsMark: "=",
		totalsMark: "-",
		contains:   []string{"totals: completed=-   unexpected=-   - finished: completed=0   unexpected=0"},
	}, {
		name:       "totals equal",
		s:          Snapshot{Desired: 2, Tally: counts(2, 0), Truth: counts(2, 0), Totals: totals(4, 1), Finished: totals(4, 1)},
		countsMark: "=",
		totalsMark: "=",
	}, {
		name:       "totals differ, counts equal",
		s:          Snapshot{Desired: 2, Tally: counts(2, 0), Truth: counts(2, 0), Totals: totals(3, 1), Finished: totals(4, 1)},
		countsMark: "=",
		totalsMark: "≠",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			line := tt.s.line(1500 * time.Millisecond)
			assert.True(t, strings.HasPrefix(line, "  1.5s desired="), line)
			assert.Equal(t, tt.countsMark, markBefore(line, "list:"), line)
			assert.Equal(t, tt.totalsMark, markBefore(line, "finished:"), line)
			for _, c := range tt.contains {
				assert.Contains(t, line, c)
			}
		})
	}
}

func withCustom(m map[config.Count]int64, c config.Count, v int64) map[config.Count]int64 {
	m[c] = v
	return m
}

// markBefore returns the word of line before word, or "" if line has no
// such word.
func markBefore(line, word string) string {
	fields := strings.Fields(line)
	for i := 1; i < len(fields); i++ {
		if fields[i] == word {
			return fields[i-1]
		}
	}
	return ""
}
