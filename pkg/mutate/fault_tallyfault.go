//go:build tallyfault

package mutate

import (
	"context"
	"os"
	"time"
)

// In builds with the tallyfault tag, a review waits while the file named by
// TALLY_FAULT_WEDGE exists (or until its request ends), and Healthy's bound
// is TALLY_FAULT_WEDGED_AFTER: the hostile suite wedges the admission path
// and checks that /healthz notices.
func init() {
	if d, err := time.ParseDuration(os.Getenv("TALLY_FAULT_WEDGED_AFTER")); err == nil {
		wedgedAfter = d
	}
	path := os.Getenv("TALLY_FAULT_WEDGE")
	if path == "" {
		return
	}
	fault = func(ctx context.Context) {
		for {
			if _, err := os.Stat(path); err != nil {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
}
