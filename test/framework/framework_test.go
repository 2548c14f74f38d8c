package framework

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
)

// recorder is a testing.TB that records how a test would have ended.
type recorder struct {
	testing.TB
	skipped, failed string
}

// stop ends the call under test as t.Skip and t.Fatal end a test.
type stop struct{}

func (r *recorder) Helper() {}
func (r *recorder) Skip(args ...any) {
	r.skipped = fmt.Sprint(args...)
	panic(stop{})
}
func (r *recorder) Fatal(args ...any) {
	r.failed = fmt.Sprint(args...)
	panic(stop{})
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
	panic(stop{})
}

func TestTool(t *testing.T) {
	present := filepath.Join(t.TempDir(), "promtool")
	if err := os.WriteFile(present, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, value, ci       string
		want, skipped, failed string
	}{
		{name: "set", value: present, want: present},
		{name: "not set", skipped: "SKIP: $TALLY_TEST_TOOL is not set: run `make test-release`, which builds the tool and sets it"},
		{name: "not set in CI", ci: "true", failed: "$TALLY_TEST_TOOL is not set: run `make test-release`, which builds the tool and sets it"},
		{name: "set to nothing there", value: present + ".missing", failed: "$TALLY_TEST_TOOL: stat " + present + ".missing: no such file or directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("TALLY_TEST_TOOL", tt.value)
			t.Setenv("CI", tt.ci)
			r := &recorder{TB: t}
			var got string
			func() {
				defer func() {
					if p := recover(); p != nil && p != (stop{}) {
						panic(p)
					}
				}()
				got = Tool(r, "TALLY_TEST_TOOL", "test-release")
			}()
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.skipped, r.skipped)
			assert.Equal(t, tt.failed, r.failed)
		})
	}
}

func TestLong(t *testing.T) {
	for _, short := range []bool{false, true} {
		r := &recorder{TB: t}
		func() {
			defer func() {
				if p := recover(); p != nil && p != (stop{}) {
					panic(p)
				}
			}()
			long(r, short)
		}()
		if short {
			assert.Equal(t, LongMessage, r.skipped, "under -short")
		} else {
			assert.Empty(t, r.skipped, "without -short")
		}
	}
}

func TestHaveTools(t *testing.T) {
	for _, e := range testTools {
		t.Setenv(e, "set")
	}
	ok, code := HaveTools()
	assert.True(t, ok)
	assert.Equal(t, 0, code)

	t.Setenv("HELM", "")
	t.Setenv("CI", "")
	ok, code = HaveTools()
	assert.False(t, ok, "without $HELM")
	assert.Equal(t, 0, code, "skipped outside CI")

	t.Setenv("CI", "true")
	ok, code = HaveTools()
	assert.False(t, ok)
	assert.Equal(t, 1, code, "failed in CI")
}
