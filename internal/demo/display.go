package demo

import (
	"context"
	"fmt"
	"sync"
	"time"

	"tally.dev/tally/pkg/config"
)

// display records a snapshot a quarter of a second into the timeline and
// prints one progress line a second, until the returned func is called.
func (d *Demo) display(ctx context.Context, start time.Time) func() {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		var printed time.Time
		for {
			select {
			case <-ctx.Done():
				if d.opts.Redraw {
					fmt.Fprintln(d.opts.Out)
				}
				return
			case now := <-tick.C:
				s, err := d.Snapshot(ctx)
				if err != nil {
					continue
				}
				d.timeline.sample(now, s)
				if now.Sub(printed) < time.Second {
					continue
				}
				printed = now
				if d.opts.Redraw {
					fmt.Fprintf(d.opts.Out, "\r\033[K%s", s.line(time.Since(start)))
				} else {
					fmt.Fprintln(d.opts.Out, s.line(time.Since(start)))
				}
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
	}
}

// line is the snapshot as one progress line, elapsed into the run.
func (s Snapshot) line(elapsed time.Duration) string {
	mark := "≠"
	if s.Match() {
		mark = "="
	}
	f := func(m map[config.Count]int64) string {
		return fmt.Sprintf("active=%-3d completing=%-3d completed=%-3d unexpected=%-3d",
			m[config.Active], m[config.Completing], m[config.Completed], m[config.Unexpected])
	}
	line := fmt.Sprintf("%5.1fs desired=%-3d tally: %s %s list: %s", elapsed.Seconds(), s.Desired, f(s.Tally), mark, f(s.Truth))
	if s.Totals != nil {
		line += fmt.Sprintf(" | totals: completed=%-3d unexpected=%-3d finished: completed=%-3d unexpected=%-3d",
			s.Totals[config.CompletedTotal], s.Totals[config.UnexpectedTotal], s.Finished[config.CompletedTotal], s.Finished[config.UnexpectedTotal])
	}
	return line
}
