package main

import (
	"cmp"
	"encoding/xml"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// testCase is one test of a pass, as the suite's JUnit report gives it.
type testCase struct {
	Name   string
	Status string // passed, failed, skipped
	// Message is the failure's or the skip's message; Detail the failure's
	// text (its log, the events the suite collected).
	Message, Detail string
	Time            time.Duration
}

// readJUnit reads the tests the suite selected from the JUnit reports in
// dir: the specs it filtered out (skipped with the bare message
// "skipped") and its suite-level nodes are left out.
func readJUnit(dir string) ([]testCase, error) {
	files, err := filepath.Glob(filepath.Join(dir, "junit_*.xml"))
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no junit_*.xml in %s", dir)
	}
	var cases []testCase
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		c, err := parseJUnit(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		cases = append(cases, c...)
	}
	return cases, nil
}

func parseJUnit(data []byte) ([]testCase, error) {
	type message struct {
		Message string `xml:"message,attr"`
		Text    string `xml:",chardata"`
	}
	var report struct {
		Suites []struct {
			Cases []struct {
				Name    string   `xml:"name,attr"`
				Status  string   `xml:"status,attr"`
				Time    float64  `xml:"time,attr"`
				Skipped *message `xml:"skipped"`
				Failure *message `xml:"failure"`
				Error   *message `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(data, &report); err != nil {
		return nil, err
	}
	var cases []testCase
	for _, s := range report.Suites {
		for _, c := range s.Cases {
			name, ok := strings.CutPrefix(c.Name, "[It] ")
			if !ok {
				continue // [SynchronizedBeforeSuite] and the like
			}
			tc := testCase{Name: name, Status: c.Status, Time: time.Duration(c.Time * float64(time.Second))}
			switch {
			case c.Skipped != nil:
				if c.Skipped.Message == "skipped" {
					continue // filtered out
				}
				tc.Message = c.Skipped.Message
			case c.Failure != nil:
				tc.Message, tc.Detail = c.Failure.Message, c.Failure.Text
			case c.Error != nil:
				tc.Message, tc.Detail = c.Error.Message, c.Error.Text
			}
			switch tc.Status {
			case "passed", "skipped":
			default:
				tc.Status = "failed" // failed, panicked, interrupted, timedout
			}
			cases = append(cases, tc)
		}
	}
	return cases, nil
}

// summary counts a pass's tests.
type summary struct{ run, passed, failed, skipped int }

func summarize(cases []testCase) summary {
	var s summary
	for _, c := range cases {
		switch c.Status {
		case "passed":
			s.passed++
		case "failed":
			s.failed++
		case "skipped":
			s.skipped++
			continue
		}
		s.run++
	}
	return s
}

func (s summary) line(wall time.Duration) string {
	return fmt.Sprintf("%d run, %d passed, %d failed, %d skipped in %s", s.run, s.passed, s.failed, s.skipped, wall.Round(time.Second))
}

// missingImage finds, in a failure's message, an image the suite could not
// pull.
var missingImage = regexp.MustCompile(`(?:registry\.k8s\.io|gcr\.io|docker\.io|invalid\.registry\.k8s\.io|tally\.local)/[a-z0-9./_-]+:[A-Za-z0-9._-]+`)

// reason is the image a failed test could not pull, or its message cut to
// its first line.
func reason(c testCase) string {
	text := c.Message + "\n" + c.Detail
	if strings.Contains(text, "ImagePull") || strings.Contains(text, "pull image") {
		if img := missingImage.FindString(text); img != "" {
			return "needs " + img + ", which is not built here"
		}
	}
	line, _, _ := strings.Cut(strings.TrimSpace(cmp.Or(c.Message, c.Detail)), "\n")
	if len(line) > 200 {
		line = line[:200] + "…"
	}
	return line
}

// failsOnlyWithTally names the tests that passed without tally and failed
// with it.
func failsOnlyWithTally(results []passResult) []string {
	status := map[string]map[string]string{}
	for _, r := range results {
		status[r.name] = map[string]string{}
		for _, c := range r.cases {
			status[r.name][c.Name] = c.Status
		}
	}
	var out []string
	for name, s := range status["with"] {
		if s == "failed" && status["without"][name] == "passed" {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// table is the results of the passes side by side, in Markdown, with every
// test that did not pass in some pass by name.
func table(results []passResult, at time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Kubernetes conformance tests on the one-node cluster, %s\n\n", at.UTC().Format("2006-01-02"))
	header, rule := "| |", "|---|"
	for _, r := range results {
		header += fmt.Sprintf(" %s tally |", r.name)
		rule += "---|"
	}
	b.WriteString(header + "\n" + rule + "\n")
	row := func(label string, value func(summary, passResult) string) {
		b.WriteString("| " + label + " |")
		for _, r := range results {
			b.WriteString(" " + value(summarize(r.cases), r) + " |")
		}
		b.WriteString("\n")
	}
	row("tests run", func(s summary, _ passResult) string { return fmt.Sprint(s.run) })
	row("passed", func(s summary, _ passResult) string { return fmt.Sprint(s.passed) })
	row("failed", func(s summary, _ passResult) string { return fmt.Sprint(s.failed) })
	row("skipped", func(s summary, _ passResult) string { return fmt.Sprint(s.skipped) })
	row("wall time", func(_ summary, r passResult) string { return r.wall.Round(time.Second).String() })

	names := map[string]bool{}
	for _, r := range results {
		for _, c := range r.cases {
			if c.Status != "passed" {
				names[c.Name] = true
			}
		}
	}
	if len(names) > 0 {
		b.WriteString("\nTests that did not pass in some pass:\n\n")
		for _, name := range slices.Sorted(maps.Keys(names)) {
			fmt.Fprintf(&b, "- %s\n", name)
			for _, r := range results {
				for _, c := range r.cases {
					if c.Name == name {
						fmt.Fprintf(&b, "  - %s tally: %s", r.name, c.Status)
						if c.Status != "passed" {
							fmt.Fprintf(&b, " (%s)", reason(c))
						}
						b.WriteString("\n")
					}
				}
			}
		}
	}
	b.WriteString("\nNot run in either pass (skipped by name):\n\n")
	for _, n := range notRunnable {
		fmt.Fprintf(&b, "- %s: %s\n", n.name, n.reason)
	}
	for _, r := range results {
		if r.churn != "" {
			fmt.Fprintf(&b, "\nWith tally: %s\n", r.churn)
		}
	}
	return b.String()
}
