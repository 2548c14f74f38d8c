package framework

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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

// notices makes Notice and HaveTools write to the returned buffer for the
// rest of the test, and forget the lines written before.
func notices(t *testing.T) *strings.Builder {
	var b strings.Builder
	stderr, goStderr = &b, func() *os.File { return nil }
	noticed.Clear()
	t.Cleanup(func() {
		stderr, goStderr = os.Stderr, goTestStderr
		noticed.Clear()
	})
	return &b
}

func TestTool(t *testing.T) {
	present := filepath.Join(t.TempDir(), "promtool")
	if err := os.WriteFile(present, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, value, ci               string
		want, skipped, failed, notice string
	}{
		{name: "set", value: present, want: present},
		{
			name:    "not set",
			skipped: "SKIP: $TALLY_TEST_TOOL is not set: run `make test-release`, which builds the tool and sets it",
			notice:  "tally.dev/tally/test/framework: SKIP: $TALLY_TEST_TOOL is not set: run `make test-release`, which builds the tool and sets it\n",
		},
		{name: "not set in CI", ci: "true", failed: "$TALLY_TEST_TOOL is not set: run `make test-release`, which builds the tool and sets it"},
		{name: "set to nothing there", value: present + ".missing", failed: "$TALLY_TEST_TOOL: stat " + present + ".missing: no such file or directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("TALLY_TEST_TOOL", tt.value)
			t.Setenv("CI", tt.ci)
			said := notices(t)
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
			assert.Equal(t, tt.notice, said.String())
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
	const notSet = "tally.dev/tally/test/framework: SKIP: $HELM not set: run `make test`, which builds the tools and sets them\n"
	tests := []struct {
		name, helm, ci string
		ok             bool
		code           int
		said           string
	}{
		{name: "every tool set", helm: "set", ok: true},
		{name: "without $HELM: skipped", said: notSet + "testing: warning: no tests to run\n"},
		{name: "without $HELM in CI: failed", ci: "true", code: 1, said: notSet},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, e := range testTools {
				t.Setenv(e, "set")
			}
			t.Setenv("HELM", tt.helm)
			t.Setenv("CI", tt.ci)
			said := notices(t)
			ok, code := HaveTools()
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.code, code)
			assert.Equal(t, tt.said, said.String())
		})
	}
}

// TestSkippedPackageSaysSo runs go test, without -v, on a package whose
// tools are not set: outside CI its "ok" line says it ran no test, and the
// line naming what it lacks shows, which go test would otherwise keep to
// itself; in CI the package fails.
func TestSkippedPackageSaysSo(t *testing.T) {
	if _, err := os.Stat("/proc/self/exe"); err != nil {
		t.Skip("the go command's stderr is found through /proc")
	}
	const pkg = "tally.dev/tally/test/framework/testdata/skipped"
	notice := pkg + ": SKIP: $KUBEBUILDER_ASSETS, $HELM, $CERT_MANAGER_CRDS not set: run `make test`, which builds the tools and sets them\n"
	tests := []struct {
		name, ci string
		want     []string
	}{
		{name: "outside CI", want: []string{notice, "ok  \t" + pkg + "\t", "[no tests to run]\n"}},
		{name: "in CI", ci: "true", want: []string{notice, "FAIL\t" + pkg + "\t"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command("go", "test", "-count=1", "-vet=off", "./testdata/skipped")
			cmd.Env = append(os.Environ(), "KUBEBUILDER_ASSETS=", "HELM=", "CERT_MANAGER_CRDS=", "CI="+tt.ci)
			out, err := cmd.CombinedOutput()
			if tt.ci == "true" {
				assert.Error(t, err, "%s", out)
			} else {
				assert.NoError(t, err, "%s", out)
			}
			for _, w := range tt.want {
				assert.Contains(t, string(out), w)
			}
		})
	}
}
