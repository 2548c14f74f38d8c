package app

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/explain"
)

func TestWriteCustom(t *testing.T) {
	fields := []explain.Field{
		{Count: config.Completing, Path: "status.completing"},
		{Count: "ready", Path: "status.ready", Expression: "true", Matching: []string{"a", "b"}},
		{Count: "restarted", Path: "status.restarted", Expression: "false", Failed: []string{"c: no such key"}, WaitsOnUnstamped: true},
	}
	var out bytes.Buffer
	writeCustom(&out, fields)
	assert.Equal(t, `
Custom count ready (status.ready): true
  matches 2 pod(s): a, b

Custom count restarted (status.restarted): false
  matches no pod
  pods of the parent are not stamped: while they are not, the aggregator does not count them, or keeps
  the value shown once its sweep has read them (it cannot evaluate the expression on their metadata)
  fails on 1 pod(s), which it does not count (guard a field a pod may lack with has()):
    c: no such key
`, out.String(), "a built-in count is not listed")
}
