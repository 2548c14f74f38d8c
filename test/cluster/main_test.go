package cluster

import (
	"os"
	"testing"

	"github.com/go-logr/logr"
	"sigs.k8s.io/controller-runtime/pkg/log"
)

func TestMain(m *testing.M) {
	// controller-runtime's clients log through its global logger, which
	// complains when the second test creates one more than 30 s in; the
	// suites print what they measure themselves.
	log.SetLogger(logr.Discard())
	os.Exit(m.Run())
}
