package app

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestRestartBackoff(t *testing.T) {
	b := restartBackoff{min: time.Second, max: 4 * time.Second}
	var got []time.Duration
	for _, ran := range []time.Duration{0, time.Second, time.Second, time.Second, time.Minute, time.Second} {
		got = append(got, b.next(ran))
	}
	assert.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second, time.Second, 2 * time.Second}, got,
		"doubling up to max while managers stop soon after they start, from min again after one ran longer than max")
}
