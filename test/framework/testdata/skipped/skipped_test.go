// Package skipped is a test package whose tools are not set, for
// TestNoticeShownWithoutVerbose: it skips as every envtest suite does.
package skipped

import (
	"os"
	"testing"

	"tally.dev/tally/test/framework"
)

func TestMain(m *testing.M) {
	if ok, code := framework.HaveTools(); !ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

func TestNothing(t *testing.T) {}
