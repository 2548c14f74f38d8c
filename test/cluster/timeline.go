package cluster

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
)

// alert is one alert pending or firing, as the alerts API shows it.
type alert struct {
	Name, Severity, State string
	// Labels are its labels but alertname and severity, written out.
	Labels string
	// ActiveAt is when its condition first held (when it became pending).
	ActiveAt time.Time
}

// key identifies an alert: its name and labels.
func (a alert) key() string { return a.Name + "{" + a.Labels + "}" }

// sample is what the alerts API showed at one moment.
type sample struct {
	At     time.Time
	Alerts []alert
}

// timeline records what the alerts API showed, sample by sample. It is
// safe for concurrent use.
type timeline struct {
	mu      sync.Mutex
	samples []sample
}

// add records the alerts seen at at.
func (t *timeline) add(at time.Time, alerts []alert) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.samples = append(t.samples, sample{At: at, Alerts: slices.Clone(alerts)})
}

// between returns the samples taken from from to to, both included; a zero
// to has no end.
func (t *timeline) between(from, to time.Time) []sample {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []sample
	for _, s := range t.samples {
		if !s.At.Before(from) && (to.IsZero() || !s.At.After(to)) {
			out = append(out, s)
		}
	}
	return out
}

// seen returns, once per alert and state, the alerts shown from from to
// to for which keep is true (every one when keep is nil), in the order
// first seen.
func (t *timeline) seen(from, to time.Time, keep func(alert) bool) []alert {
	var out []alert
	have := map[string]bool{}
	for _, s := range t.between(from, to) {
		for _, a := range s.Alerts {
			if k := a.key() + " " + a.State; !have[k] && (keep == nil || keep(a)) {
				have[k] = true
				out = append(out, a)
			}
		}
	}
	return out
}

// first returns the time of the first sample after after in which an
// alert named name is in state, and that alert.
func (t *timeline) first(name, state string, after time.Time) (time.Time, alert, bool) {
	for _, s := range t.between(after, time.Time{}) {
		for _, a := range s.Alerts {
			if a.Name == name && a.State == state {
				return s.At, a, true
			}
		}
	}
	return time.Time{}, alert{}, false
}

// gone returns the time of the first sample after after that shows no
// alert named name, pending or firing.
func (t *timeline) gone(name string, after time.Time) (time.Time, bool) {
	for _, s := range t.between(after, time.Time{}) {
		if !slices.ContainsFunc(s.Alerts, func(a alert) bool { return a.Name == name }) {
			return s.At, true
		}
	}
	return time.Time{}, false
}

// transition is an alert changing state between two samples ("" is
// neither pending nor firing).
type transition struct {
	At       time.Time
	Alert    string
	Severity string
	From, To string
}

func (tr transition) String() string {
	from, to := tr.From, tr.To
	if from == "" {
		from = "inactive"
	}
	if to == "" {
		to = "inactive"
	}
	return fmt.Sprintf("%s %s (%s): %s -> %s", tr.At.Format("15:04:05"), tr.Alert, tr.Severity, from, to)
}

// transitions returns every change of state the samples show, in order.
func (t *timeline) transitions() []transition {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []transition
	state := map[string]alert{}
	for _, s := range t.samples {
		now := map[string]alert{}
		for _, a := range s.Alerts {
			now[a.key()] = a
		}
		for _, k := range slices.Sorted(maps.Keys(now)) {
			if a := now[k]; state[k].State != a.State {
				out = append(out, transition{At: s.At, Alert: k, Severity: a.Severity, From: state[k].State, To: a.State})
			}
		}
		for _, k := range slices.Sorted(maps.Keys(state)) {
			if _, still := now[k]; !still {
				out = append(out, transition{At: s.At, Alert: k, Severity: state[k].Severity, From: state[k].State})
			}
		}
		state = now
	}
	return out
}

// describe writes alerts as name{labels} state, one per line.
func describe(alerts []alert) string {
	var lines []string
	for _, a := range alerts {
		lines = append(lines, fmt.Sprintf("%s (%s) %s since %s", a.key(), a.Severity, a.State, a.ActiveAt.Format("15:04:05")))
	}
	return strings.Join(lines, "\n  ")
}
