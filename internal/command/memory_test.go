package command

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestMemoryLimit(t *testing.T) {
	tests := []struct {
		name, gomemlimit, container string
		want                        int64
		set                         bool
		err                         string
	}{
		{name: "90% of the container's limit", container: "268435456", want: 241591910, set: true},
		{name: "GOMEMLIMIT wins", gomemlimit: "100MiB", container: "268435456"},
		{name: "no limit"},
		{name: "not a number", container: "256Mi", err: `$TALLY_MEMORY_LIMIT="256Mi": expected the container's memory limit, a positive number of bytes`},
		{name: "zero", container: "0", err: "a positive number of bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, set, err := memoryLimit(tc.gomemlimit, tc.container)
			if tc.err != "" {
				assert.ErrorContains(t, err, tc.err)
				return
			}
			assert.NoError(t, err)
			assert.Equal(t, tc.set, set)
			assert.Equal(t, tc.want, got)
		})
	}
}
