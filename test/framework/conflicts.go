package framework

import (
	"fmt"
	"sync"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// ConflictLog records every write conflict logged as an error through the
// loggers it hands out. A suite whose point is "no conflicts" fails when
// any was logged.
type ConflictLog struct {
	base      logr.LogSink
	mu        sync.Mutex
	conflicts []string
}

// NewConflictLog records conflicts logged through Logger, which logs to l.
func NewConflictLog(l logr.Logger) *ConflictLog {
	return &ConflictLog{base: l.GetSink()}
}

// Logger returns a logger that logs to the wrapped one and records
// conflicts.
func (c *ConflictLog) Logger() logr.Logger { return logr.New(&conflictSink{log: c, sink: c.base}) }

// Conflicts returns the conflicts logged so far.
func (c *ConflictLog) Conflicts() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.conflicts...)
}

// conflictSink passes everything to sink and records conflicts in log.
type conflictSink struct {
	log  *ConflictLog
	sink logr.LogSink
}

func (s *conflictSink) Init(info logr.RuntimeInfo)            { s.sink.Init(info) }
func (s *conflictSink) Enabled(level int) bool                { return s.sink.Enabled(level) }
func (s *conflictSink) Info(level int, msg string, kv ...any) { s.sink.Info(level, msg, kv...) }

func (s *conflictSink) Error(err error, msg string, kv ...any) {
	if apierrors.IsConflict(err) {
		s.log.mu.Lock()
		s.log.conflicts = append(s.log.conflicts, fmt.Sprintf("%s: %v", msg, err))
		s.log.mu.Unlock()
	}
	s.sink.Error(err, msg, kv...)
}

func (s *conflictSink) WithValues(kv ...any) logr.LogSink {
	return &conflictSink{log: s.log, sink: s.sink.WithValues(kv...)}
}

func (s *conflictSink) WithName(name string) logr.LogSink {
	return &conflictSink{log: s.log, sink: s.sink.WithName(name)}
}
