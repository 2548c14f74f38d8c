package demo

import (
	"context"
	"fmt"
	"strconv"
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

// line is the snapshot as one progress line, elapsed into the run. Between
// tally's counts and the List's it prints "=" or "≠", and likewise between
// tally's totals and the pods seen finishing; a value tally does not show
// yet (see Snapshot) prints as "-", and so does the mark of a side that
// has one: it cannot be compared yet. Match, not this line, decides the
// verdict.
func (s Snapshot) line(elapsed time.Duration) string {
	f := func(m map[config.Count]int64) string {
		line := fmt.Sprintf("active=%-3s completing=%-3s completed=%-3s unexpected=%-3s",
			shownValue(m[config.Active]), shownValue(m[config.Completing]), shownValue(m[config.Completed]), shownValue(m[config.Unexpected]))
		for _, c := range s.Custom {
			line += fmt.Sprintf(" %s=%-3s", c, shownValue(m[c]))
		}
		return line
	}
	line := fmt.Sprintf("%5.1fs desired=%-3d tally: %s %s list: %s",
		elapsed.Seconds(), s.Desired, f(s.Tally), compared(s.Tally, s.Truth, s.counts()), f(s.Truth))
	if s.LegacyOn {
		line += fmt.Sprintf(" | old counter: completing=%-3d", s.Legacy)
	}
	if s.Totals != nil {
		line += fmt.Sprintf(" | totals: completed=%-3s unexpected=%-3s %s finished: completed=%-3s unexpected=%-3s",
			shownValue(s.Totals[config.CompletedTotal]), shownValue(s.Totals[config.UnexpectedTotal]),
			compared(s.Totals, s.Finished, config.Totals),
			shownValue(s.Finished[config.CompletedTotal]), shownValue(s.Finished[config.UnexpectedTotal]))
	}
	return line
}

// shownValue formats a value of a snapshot: "-" when it is not known yet
// (negative: the parent's status has no such field).
func shownValue(v int64) string {
	if v < 0 {
		return "-"
	}
	return strconv.FormatInt(v, 10)
}

// compared is the mark between two sides' values of counts cs: "=" when
// they are equal, "≠" when they differ, "-" while a value of either side
// is not known yet.
func compared(a, b map[config.Count]int64, cs []config.Count) string {
	mark := "="
	for _, c := range cs {
		if a[c] < 0 || b[c] < 0 {
			return "-"
		}
		if a[c] != b[c] {
			mark = "≠"
		}
	}
	return mark
}
