//go:build race

package framework

// raceEnabled reports whether this binary runs with the race detector.
const raceEnabled = true
