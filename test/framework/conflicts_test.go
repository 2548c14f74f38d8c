package framework

import (
	"errors"
	"fmt"
	"testing"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestConflictLogRecordsConflictsOnly(t *testing.T) {
	c := NewConflictLog(funcr.New(func(string, string) {}, funcr.Options{}))
	log := c.Logger().WithName("aggregator").WithValues("kind", "WorkerPool")
	log.Error(errors.New("boom"), "Reconciler error")
	log.Error(fmt.Errorf("applying: %w", apierrors.NewConflict(schema.GroupResource{Resource: "workerpools"}, "pool", errors.New("field managed by x"))), "Reconciler error")
	log.Info("fine")
	conflicts := c.Conflicts()
	assert.Len(t, conflicts, 1)
	assert.Contains(t, conflicts[0], "field managed by x")
}
