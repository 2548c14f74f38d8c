package intent

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestValidReason(t *testing.T) {
	tests := map[string]bool{
		"scale-down": true, "a": true, "0": true, "evicted-by-timer-2": true, strings.Repeat("a", 63): true,
		"": false, "Scale-Down": false, "-scale": false, "scale-": false, "scale_down": false,
		"scale down": false, strings.Repeat("a", 64): false, "ünicode": false,
	}
	for reason, valid := range tests {
		t.Run(reason, func(t *testing.T) {
			err := ValidReason(reason)
			if valid {
				assert.NoError(t, err)
			} else {
				assert.ErrorContains(t, err, "is not a valid reason")
			}
		})
	}
}
