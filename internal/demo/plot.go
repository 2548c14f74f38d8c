package demo

import (
	"context"
	"errors"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"tally.dev/tally/pkg/config"
)

// PlotFile is the plot of a run, in Options.Dir.
const PlotFile = "demo.png"

// countColors are the colors of the counts in the plot; tally's values are
// solid lines, the fresh List's dashed lines of the same color.
var countColors = map[config.Count]color.Color{
	config.Active:          color.RGBA{R: 31, G: 119, B: 180, A: 255},
	config.Completing:      color.RGBA{R: 255, G: 127, B: 14, A: 255},
	config.Completed:       color.RGBA{R: 44, G: 160, B: 44, A: 255},
	config.Unexpected:      color.RGBA{R: 214, G: 39, B: 40, A: 255},
	config.CompletedTotal:  color.RGBA{R: 44, G: 160, B: 44, A: 255},
	config.UnexpectedTotal: color.RGBA{R: 214, G: 39, B: 40, A: 255},
}

// customColors are the colors of the custom counts, in their order.
var customColors = []color.Color{
	color.RGBA{R: 148, G: 103, B: 189, A: 255},
	color.RGBA{R: 140, G: 86, B: 75, A: 255},
	color.RGBA{R: 23, G: 190, B: 207, A: 255},
}

// colorOf returns the color of count c among the counts of s.
func colorOf(s Snapshot, c config.Count) color.Color {
	if col, ok := countColors[c]; ok {
		return col
	}
	i := max(0, slices.Index(s.Custom, c))
	return customColors[i%len(customColors)]
}

var dashed = []vg.Length{vg.Points(5), vg.Points(3)}

// wholeTicks labels an axis with whole numbers, 1, 2 or 5 times a power of
// ten apart, at most about eight of them.
type wholeTicks struct{}

// Ticks implements plot.Ticker.
func (wholeTicks) Ticks(lo, hi float64) []plot.Tick {
	step := 1.0
	for mult := 0; (hi-lo)/step > 8; mult++ {
		step *= [...]float64{2, 2.5, 2}[mult%3]
	}
	var ticks []plot.Tick
	for v := math.Ceil(lo/step) * step; v <= hi; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'f', -1, 64)})
	}
	return ticks
}

// writePlot writes the run's plot next to its logs and says where, with the
// outcome err in its title; a plot that cannot be drawn is reported, not
// fatal.
func (d *Demo) writePlot(err error) {
	title := "PASS: tally's counts equal a fresh List at quiescence"
	if d.totals {
		title += ", its totals the pods seen finishing"
	}
	switch {
	case errors.Is(err, errMismatch):
		title = "FAIL: tally's counts differ from the truth"
	case errors.Is(err, context.Canceled):
		title = "interrupted before its verdict"
	case err != nil:
		title = "no verdict: " + err.Error()
	}
	path := filepath.Join(d.opts.Dir, PlotFile)
	if perr := d.plot(path, title); perr != nil {
		d.say("could not draw the plot of this run: %v", perr)
		return
	}
	d.say("plot of this run: %s", path)
}

// plot draws the timeline into a PNG at path: the desired replicas, tally's
// counts and the fresh List's, with the scenario's steps and disruptions
// marked; below, when the pool keeps totals, tally's totals beside the pods
// seen finishing.
func (d *Demo) plot(path, title string) error {
	samples, events := d.timeline.read()
	if len(samples) == 0 {
		return errors.New("no snapshot was taken")
	}
	counts, err := d.countsPlot(samples, events)
	if err != nil {
		return err
	}
	counts.Title.Text = "tally demo: " + title + "\ncounts over time: tally's (solid) and a fresh List's (dashed)"
	rows := [][]*plot.Plot{{counts}}
	height := 6 * vg.Inch
	if d.totals {
		totals, err := totalsPlot(samples)
		if err != nil {
			return err
		}
		totals.X.Min, totals.X.Max = counts.X.Min, counts.X.Max
		rows = append(rows, []*plot.Plot{totals})
		height = 9 * vg.Inch
	}
	img := vgimg.New(12*vg.Inch, height)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(rows), Cols: 1, PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(6), PadY: vg.Points(18)}
	canvases := plot.Align(rows, tiles, dc)
	for i, row := range rows {
		row[0].Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (d *Demo) countsPlot(samples []sample, events []event) (*plot.Plot, error) {
	p := plot.New()
	p.X.Label.Text = "seconds into the run"
	p.Y.Label.Text = "pods"
	p.X.Tick.Marker, p.Y.Tick.Marker = wholeTicks{}, wholeTicks{}
	p.Legend.Top, p.Legend.Left = true, false
	p.Legend.YOffs = -vg.Points(40)
	p.Add(plotter.NewGrid())

	top := 0.0
	desired := make(plotter.XYs, 0, len(samples))
	for _, s := range samples {
		desired = append(desired, plotter.XY{X: s.at.Seconds(), Y: float64(s.Desired)})
		top = max(top, float64(s.Desired))
		for _, c := range s.counts() {
			top = max(top, float64(s.Tally[c]), float64(s.Truth[c]))
		}
	}
	line, err := plotter.NewLine(desired)
	if err != nil {
		return nil, err
	}
	line.StepStyle = plotter.PostStep
	line.Width = vg.Points(2.5)
	line.Color = color.Gray{Y: 60}
	p.Add(line)
	p.Legend.Add("desired replicas", line)

	for _, c := range samples[len(samples)-1].counts() {
		for _, fromList := range []bool{false, true} {
			l, err := countLine(samples, c, fromList)
			if err != nil {
				return nil, err
			}
			if l == nil {
				continue
			}
			p.Add(l)
			if !fromList {
				p.Legend.Add(string(c), l)
			}
		}
	}

	// The scenario's steps as vertical lines, its disruptions as marks
	// above the counts.
	markY := top + 2
	var deletions, crashes plotter.XYs
	var steps int
	for _, e := range events {
		switch e.kind {
		case scaled, ended:
			// Labels of steps close together alternate in height.
			labelY := markY + 1 + float64(steps%2)*1.2
			steps++
			v, err := plotter.NewLine(plotter.XYs{{X: e.at.Seconds(), Y: 0}, {X: e.at.Seconds(), Y: labelY}})
			if err != nil {
				return nil, err
			}
			v.Color, v.Dashes = color.Gray{Y: 150}, []vg.Length{vg.Points(1), vg.Points(3)}
			p.Add(v)
			labels, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: e.at.Seconds(), Y: labelY}}, Labels: []string{" " + e.what}})
			if err != nil {
				return nil, err
			}
			p.Add(labels)
		case deleted:
			deletions = append(deletions, plotter.XY{X: e.at.Seconds(), Y: markY})
		case crashed:
			crashes = append(crashes, plotter.XY{X: e.at.Seconds(), Y: markY})
		}
	}
	for _, m := range []struct {
		xys   plotter.XYs
		name  string
		glyph draw.GlyphDrawer
	}{
		{deletions, "pod deleted without intent", draw.TriangleGlyph{}},
		{crashes, "pod crashed", draw.CrossGlyph{}},
	} {
		if len(m.xys) == 0 {
			continue
		}
		sc, err := plotter.NewScatter(m.xys)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle = draw.GlyphStyle{Color: countColors[config.Unexpected], Radius: vg.Points(4), Shape: m.glyph}
		p.Add(sc)
		p.Legend.Add(m.name, sc)
	}
	// Room on the right for the legend.
	p.Y.Min, p.Y.Max = 0, markY+4
	p.X.Min, p.X.Max = 0, samples[len(samples)-1].at.Seconds()*1.25
	return p, nil
}

// countLine returns count c as tally showed it (fromList false) or as the
// fresh List counted it, or nil when no sample has it.
func countLine(samples []sample, c config.Count, fromList bool) (*plotter.Line, error) {
	var xys plotter.XYs
	for _, s := range samples {
		v := s.Tally[c]
		if fromList {
			v = s.Truth[c]
		}
		if v < 0 {
			// Not shown yet: the parent's status has no value.
			continue
		}
		xys = append(xys, plotter.XY{X: s.at.Seconds(), Y: float64(v)})
	}
	if len(xys) == 0 {
		return nil, nil
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		return nil, err
	}
	l.StepStyle = plotter.PostStep
	l.Color = colorOf(samples[len(samples)-1].Snapshot, c)
	l.Width = vg.Points(1.5)
	if fromList {
		l.Dashes = dashed
		l.Width = vg.Points(1)
	}
	return l, nil
}

// totalsPlot draws tally's totals beside the pods the demo saw finish.
func totalsPlot(samples []sample) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "totals: tally's (solid) and the pods seen finishing (dashed)"
	p.X.Label.Text = "seconds into the run"
	p.Y.Label.Text = "pods finished"
	p.X.Tick.Marker, p.Y.Tick.Marker = wholeTicks{}, wholeTicks{}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())
	for _, c := range config.Totals {
		var shown, seen plotter.XYs
		for _, s := range samples {
			if v := s.Totals[c]; v >= 0 {
				shown = append(shown, plotter.XY{X: s.at.Seconds(), Y: float64(v)})
			}
			seen = append(seen, plotter.XY{X: s.at.Seconds(), Y: float64(s.Finished[c])})
		}
		for _, l := range []struct {
			xys  plotter.XYs
			name string
			dash bool
		}{{shown, "tally " + string(c), false}, {seen, "seen finishing, " + string(c), true}} {
			if len(l.xys) == 0 {
				continue
			}
			line, err := plotter.NewLine(l.xys)
			if err != nil {
				return nil, err
			}
			line.StepStyle = plotter.PostStep
			line.Color, line.Width = countColors[c], vg.Points(1.5)
			if l.dash {
				line.Dashes, line.Width = dashed, vg.Points(1)
			}
			p.Add(line)
			p.Legend.Add(l.name, line)
		}
	}
	p.Y.Min = 0
	return p, nil
}
