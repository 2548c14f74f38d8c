package docs

import (
	"bytes"
	"go/scanner"
	"go/token"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"

	"tally.dev/tally/internal/command"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/mutate"
)

// benchmarks is the one document that holds measured figures.
const benchmarks = "docs/benchmarks.md"

// TestFiguresLiveInBenchmarks: a measured figure is given, dated, in
// docs/benchmarks.md, and only there; another document links to it.
//
// What it reads. Every document docFiles returns but docs/benchmarks.md and
// CHANGELOG.md (what changed, release by release), line by line, fenced code
// blocks left out: sample output may show anything. In each line it finds
// every figure with a unit: a duration (2.1 s, 624 ms, 8.8 µs, 23 min,
// 2 minutes, a 10-minute window, 10s), a size (80.1 MiB, 445 B, 256Mi), a
// ratio (1.04x), a percentage (4%) or a rate (50/s, 16,578 admissions/s,
// 3 requests a second); a range (0.5–2 s) is two figures, and a figure of
// zero is left alone.
//
// A figure passes when
//
//   - it is written as code in an inline code span, its number against its
//     unit (`10m`, `256Mi`, `--validity 24h`): a flag's or a value's own
//     syntax. A spaced figure in a code span (`21 s`) is read as prose;
//   - it is in the text of a link to docs/benchmarks.md ([21 s](benchmarks.md#a))
//     and the section the link names (the whole file without an anchor) gives
//     the same figure, to the precision the link writes it with: a figure
//     restated elsewhere agrees with its source;
//   - or its value is one the code sets, and no word before it says it was
//     measured or estimated (about, around, roughly, nearly, ~, p50, p99,
//     max, peak, median, average, or the + of a time relative to an event).
//     The values the code sets are read from the sources themselves, their
//     comments left out: the Go of cmd/, pkg/, internal/, certs/ and examples/
//     (15 * time.Second, time.Minute, 64 << 10, a duration or quantity
//     string, a constant named for its unit, trickleBytes = 16), and the
//     chart's values and templates (5s, 10m, 256Mi, heldPodSeconds: 300,
//     webhookCallFailureRatio: 0.05 as 5%, qps: 100 as a rate). The documents
//     about tally's own tests and tools (contributorDocs) may also give what
//     those set: the Go of test/ and hack/, the Makefile, .ci/ and .github/.
//     Values the scan cannot find, set outside tally or derived from several
//     of its constants, are in settings, each with where it is defined,
//     checked against that code.
//
// Any other figure fails, with the file, the line and the figure.
//
// What it cannot tell. It reads no meaning: a measured figure whose value
// happens to be one the code sets somewhere (a run that took 30 s, when some
// timeout is 30 s) passes, and so does a setting given with another
// constant's value; it checks that the value exists in the code, not that
// the sentence is about it. Figures spelled in words (two minutes, a
// millisecond), counts with no unit (0 of 2,462 pods refused), dates, and
// figures in fenced blocks or written as code are not judged. A value the
// code computes at run time (a back-off's doubling) passes only when its
// parts are constants the scan finds or an entry of settings names it.
func TestFiguresLiveInBenchmarks(t *testing.T) {
	charts := []string{filepath.Join("charts", "tally", "values.yaml"), filepath.Join("charts", "tally", "templates")}
	product := codeValues(t, []string{"cmd", "pkg", "internal", "certs", "examples"}, charts, false)
	contributor := codeValues(t, []string{"cmd", "pkg", "internal", "certs", "examples", "test", "hack"},
		append(charts, "Makefile", ".ci", ".github"), true)
	require.True(t, product.has(dimTime, 15), "no 15 * time.Second read from the Go sources: their reading is broken")
	require.True(t, product.has(dimSize, 64<<10), "no 64 << 10 read from the Go sources: their reading is broken")
	require.True(t, product.has(dimTime, 600), "no 10m read from the chart: its reading is broken")
	for _, s := range settings {
		f := parseFigures(s.figure)
		require.Len(t, f, 1, "the setting %q is not one figure", s.figure)
		if s.value != 0 {
			assert.True(t, f[0].near(s.value), "the setting %q is no longer the code's value, %v (%s)", s.figure, s.value, s.why)
		}
		if s.file != "" {
			checkDefinition(t, s.figure, s.module, s.file, s.contains)
		}
		if !s.tests {
			product.add(f[0].dim, f[0].value)
		}
		contributor.add(f[0].dim, f[0].value)
	}

	failures := 0
	for _, file := range docFiles(t) {
		if file == benchmarks || file == "CHANGELOG.md" {
			continue
		}
		values := product
		if contributorDocs[file] {
			values = contributor
		}
		reported := map[[2]int]bool{} // a range fails once
		for _, f := range documentFigures(t, file) {
			why := ""
			switch {
			case f.link != "":
				if !benchmarksGive(t, f.link, f) {
					why = "the text of a link to " + f.link + ", which does not give it"
				}
			case f.measured:
				why = "measured or estimated, by the word before it"
			case !values.has(f.dim, f.value):
				why = "a value no code sets"
			}
			if why == "" || reported[[2]int{f.line, f.at[0]}] {
				continue
			}
			reported[[2]int{f.line, f.at[0]}] = true
			failures++
			t.Errorf("%s:%d: %s: %s; measured figures live, dated, in docs/benchmarks.md, and other documents link there", file, f.line, f.text, why)
		}
	}
	if failures > 0 {
		t.Logf("%d figures outside docs/benchmarks.md", failures)
	}
}

// contributorDocs are the documents about tally's own tests and tools: they
// may give the values those set.
var contributorDocs = map[string]bool{
	"docs/development.md": true, "docs/conformance.md": true, "docs/releasing.md": true, "docs/real-cluster.md": true,
}

// settings are the values the documents give that the scan of the code
// cannot find: derived from several constants, or set outside tally (by
// Kubernetes, client-go) or by one of its tests. Each is checked against
// the code: its value computed from the constants that define it, or the
// file that defines it (in a module tally builds with, when module is set)
// containing its definition. Each value is allowed wherever a document
// gives it, not only where it means this setting.
var settings = []struct {
	figure   string
	value    float64 // computed from the constants: seconds, bytes, percent or per second
	module   string  // the module file is in, found with go list -m from the repository or hack/envtest
	file     string
	contains string
	tests    bool // set by tally's tests: allowed in contributorDocs only
	why      string
}{
	{figure: "80.1 MiB", value: float64(mutate.BodyBudget), why: "mutate.BodyBudget: what the bodies in flight may hold"},
	{figure: "6.25 MiB", value: float64(mutate.MaxBodyBytes), why: "mutate.MaxBodyBytes: the largest body, an object and an old object"},
	{figure: "64.5 KiB", value: float64(mutate.SmallBody + bytes.MinRead), file: "pkg/mutate/budget.go", contains: "smallBuffer = SmallBody + bytes.MinRead",
		why: "the buffer a small body is read into and reused"},
	{figure: "128.5 KiB", value: float64(mutate.SmallBody + bytes.MinRead + mutate.DecodeAllowance), file: "pkg/mutate/budget.go", contains: "smallShare  = MaxConnections * (smallBuffer + DecodeAllowance)",
		why: "what a small body reserves: its buffer and mutate.DecodeAllowance"},
	{figure: "32.1 MiB", value: float64(mutate.MaxConnections * (mutate.SmallBody + bytes.MinRead + mutate.DecodeAllowance)), file: "pkg/mutate/budget.go", contains: "smallShare  = MaxConnections * (smallBuffer + DecodeAllowance)",
		why: "the small class's share: one small body for each connection"},
	{figure: "16 MiB", value: 16 * mutate.MediumBody, file: "pkg/mutate/budget.go", contains: "mediumShare = 16 * MediumBody", why: "the medium class's share"},
	{figure: "112.1 MiB", value: float64(mutate.BodyBudget + mutate.MaxConnections*128<<10), file: "test/hostile/bodies_test.go", contains: "memoryBound = mutate.BodyBudget + mutate.MaxConnections*128<<10",
		why: "the webhook's memory above idle that test/hostile holds it to: the budget and 128 KiB a connection"},
	{figure: "128 KiB", value: 128 << 10, file: "test/hostile/bodies_test.go", contains: "mutate.MaxConnections*128<<10", why: "a connection's share of that bound"},
	{figure: "90%", value: command.MemoryLimitShare * 100, why: "command.MemoryLimitShare: GOMEMLIMIT's share of the container's memory limit"},
	{figure: "5/s", value: float64(rest.DefaultQPS), why: "client-go's default rate, rest.DefaultQPS"},
	{figure: "0.8 s", module: "k8s.io/client-go", file: "tools/cache/reflector.go", contains: "defaultBackoffInit = 800 * time.Millisecond",
		why: "the first back-off of client-go's reflector before a relist"},
	{figure: "50 s", module: "k8s.io/kubernetes", file: "pkg/controller/nodelifecycle/config/v1alpha1/defaults.go", contains: "NodeMonitorGracePeriod = metav1.Duration{Duration: 50 * time.Second}",
		why: "kube-controller-manager's --node-monitor-grace-period"},
	{figure: "16 s", file: "test/robustness/robustness_test.go", contains: "Up to 16 s: past the lease", tests: true,
		why: "the longest pause test/robustness draws: twice its longest fault"},
}

// checkDefinition checks that file, of module when it is set, contains
// what defines a setting.
func checkDefinition(t *testing.T, figure, module, file, contains string) {
	t.Helper()
	path := repo.Path(file)
	if module != "" {
		dir := ""
		for _, from := range []string{repo.Root(), repo.Path("hack", "envtest")} {
			c := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", module)
			c.Dir = from
			if out, err := c.Output(); err == nil && strings.TrimSpace(string(out)) != "" {
				dir = strings.TrimSpace(string(out))
				break
			}
		}
		if dir == "" {
			t.Logf("the setting %q: module %s is not downloaded here, its definition not checked", figure, module)
			return
		}
		path = filepath.Join(dir, file)
	}
	data, err := os.ReadFile(path)
	if assert.NoError(t, err, "the setting %q names %s", figure, file) {
		assert.Contains(t, string(data), contains, "the setting %q: %s does not define it any more", figure, file)
	}
}

// dimension is what a figure measures.
type dimension int

const (
	dimTime    dimension = iota // seconds
	dimSize                     // bytes
	dimRatio                    // times
	dimPercent                  // percent
	dimRate                     // per second
)

// units are the units a figure may have, longest first, by how the documents
// write them: their dimension and factor.
var units = []struct {
	name   string
	dim    dimension
	factor float64
	word   bool // spelled out: after a space or a hyphen
}{
	{"seconds", dimTime, 1, true}, {"second", dimTime, 1, true},
	{"minutes", dimTime, 60, true}, {"minute", dimTime, 60, true},
	{"hours", dimTime, 3600, true}, {"hour", dimTime, 3600, true},
	{"days", dimTime, 86400, true}, {"day", dimTime, 86400, true},
	{"bytes", dimSize, 1, true},
	{"min", dimTime, 60, false}, {"ms", dimTime, 1e-3, false}, {"µs", dimTime, 1e-6, false}, {"us", dimTime, 1e-6, false},
	{"ns", dimTime, 1e-9, false}, {"s", dimTime, 1, false}, {"h", dimTime, 3600, false},
	{"KiB", dimSize, 1 << 10, false}, {"MiB", dimSize, 1 << 20, false}, {"GiB", dimSize, 1 << 30, false},
	{"Ki", dimSize, 1 << 10, false}, {"Mi", dimSize, 1 << 20, false}, {"Gi", dimSize, 1 << 30, false},
	{"KB", dimSize, 1e3, false}, {"MB", dimSize, 1e6, false}, {"GB", dimSize, 1e9, false}, {"B", dimSize, 1, false},
	{"x", dimRatio, 1, false}, {"%", dimPercent, 1, false},
}

const number = `\d+(?:,\d{3})*(?:\.\d+)?`

var (
	figureRE = func() *regexp.Regexp {
		var names []string
		for _, u := range units {
			names = append(names, regexp.QuoteMeta(u.name))
		}
		return regexp.MustCompile(`(` + number + `)(?:\s?[–-]\s?(` + number + `))?([\s-]?)(` + strings.Join(names, "|") + `)`)
	}()
	rateRE     = regexp.MustCompile(`(` + number + `)(?:\s?[–-]\s?(` + number + `))?(?:\s?/s|\s[a-z]+/s|(?:\s[a-z][a-z-]*){0,2}\s(?:a|per) second)\b`)
	measuredRE = regexp.MustCompile(`(?i)(?:\babout|\baround|\broughly|\bnearly|~|\bp\d\d|\bmax|\bpeak|\bmedian|\baverage|\+)\s*$`)
	spanRE     = regexp.MustCompile("`[^`\n]+`")
	linkRE     = regexp.MustCompile(`\[([^\]]*)\]\(([^)\s]+)\)`)
)

// figure is one figure a document gives.
type figure struct {
	text     string
	dim      dimension
	value    float64
	line     int
	measured bool   // preceded by a word that says it was measured
	link     string // the docs/benchmarks.md target it is the text of a link to
	spaced   bool   // its number and unit apart
	at       [2]int // where it is in its text
	number   string // its number as written (one end of a range)
	factor   float64
}

// near reports whether the figure gives v, to the precision it is written
// with (80.1 MiB is any value that rounds to it).
func (f figure) near(v float64) bool {
	decimals := 0
	if _, frac, ok := strings.Cut(f.number, "."); ok {
		decimals = len(frac)
	}
	tolerance := 0.5 * math.Pow(10, -float64(decimals)) * f.factor
	return math.Abs(f.value-v) <= tolerance+1e-9*math.Abs(v)
}

// parseFigures returns the figures of a text: durations, sizes, ratios and
// percentages, and rates.
func parseFigures(text string) []figure {
	var out []figure
	add := func(m []int, dim dimension, factor float64, spaced bool) {
		if m[0] > 0 {
			if r := rune(text[m[0]-1]); r == '.' || r == '/' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' {
				return // part of a name, a version or a formula (N/128 s)
			}
		}
		measured := measuredRE.MatchString(text[max(0, m[0]-16):m[0]]) // the words just before it
		for _, g := range [][2]int{{m[2], m[3]}, {m[4], m[5]}} {
			if g[0] < 0 {
				continue
			}
			v := parseNumber(text[g[0]:g[1]])
			if v == 0 {
				continue
			}
			out = append(out, figure{
				text: strings.TrimSpace(text[m[0]:m[1]]), dim: dim, value: v * factor, measured: measured, spaced: spaced,
				at: [2]int{m[0], m[1]}, number: text[g[0]:g[1]], factor: factor,
			})
		}
	}
	for _, m := range figureRE.FindAllStringSubmatchIndex(text, -1) {
		unit := text[m[8]:m[9]]
		sep := text[m[6]:m[7]]
		if m[9] < len(text) {
			if r := rune(text[m[9]]); r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' {
				continue // a word that begins with the unit's letters
			}
		}
		for _, u := range units {
			if u.name != unit {
				continue
			}
			switch {
			case u.word && sep == "", !u.word && sep == "-":
				continue
			case u.name == "x" && sep != "":
				continue // "2 x" is no ratio
			case u.name == "s" && sep == "" && m[4] < 0 && isStatus(text[m[2]:m[3]]):
				continue // 404s: answers with that HTTP status
			}
			add(m, u.dim, u.factor, sep != "")
			break
		}
	}
	for _, m := range rateRE.FindAllStringSubmatchIndex(text, -1) {
		add([]int{m[0], m[1], m[2], m[3], m[4], m[5]}, dimRate, 1, true)
	}
	return out
}

// isStatus reports whether n is an HTTP status code.
func isStatus(n string) bool {
	v, err := strconv.Atoi(n)
	return err == nil && v >= 100 && v < 600
}

func parseNumber(s string) float64 {
	v, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
	if err != nil {
		return math.NaN()
	}
	return v
}

// documentFigures returns the figures of a document outside fenced blocks,
// with their lines, less those written as code in an inline code span. A
// link's text may run over several lines.
func documentFigures(t *testing.T, file string) []figure {
	t.Helper()
	data, err := os.ReadFile(repo.Path(file))
	require.NoError(t, err)
	var out []figure
	lines := strings.Split(string(data), "\n")
	fenced := false
	for i, line := range lines {
		if strings.HasPrefix(strings.TrimSpace(line), "```") || fenced {
			fenced = fenced != strings.HasPrefix(strings.TrimSpace(line), "```")
			lines[i] = ""
			continue
		}
		// Code spans: only their spaced figures count; the rest of the
		// line is read with each span blanked out.
		prose := []byte(line)
		for _, s := range spanRE.FindAllStringIndex(line, -1) {
			for _, f := range parseFigures(line[s[0]+1 : s[1]-1]) {
				if f.spaced {
					f.line = i + 1
					out = append(out, f)
				}
			}
			for j := s[0]; j < s[1]; j++ {
				prose[j] = ' '
			}
		}
		lines[i] = string(prose)
	}
	text := strings.Join(lines, "\n")
	links := linkRE.FindAllStringSubmatchIndex(text, -1)
	start := 0 // of the line in text
	for i, line := range lines {
		for _, f := range parseFigures(line) {
			f.line = i + 1
			for _, l := range links {
				if start+f.at[0] >= l[2] && start+f.at[1] <= l[3] {
					if target := text[l[4]:l[5]]; linksTo(file, target) == benchmarks {
						f.link = target
					}
				}
			}
			out = append(out, f)
		}
		start += len(line) + 1
	}
	return out
}

// linksTo returns the file a link of a document points to.
func linksTo(file, target string) string {
	path, _, _ := strings.Cut(target, "#")
	if path == "" || strings.Contains(path, "://") {
		return ""
	}
	return filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(file), path)))
}

// benchmarksGive reports whether the section of docs/benchmarks.md a link
// points to (the whole file without an anchor) gives the figure.
func benchmarksGive(t *testing.T, target string, f figure) bool {
	t.Helper()
	data, err := os.ReadFile(repo.Path(benchmarks))
	require.NoError(t, err)
	_, anchor, _ := strings.Cut(target, "#")
	var section strings.Builder
	level := 0 // of the section's heading, while in it
	fenced := false
	for line := range strings.SplitSeq(string(data), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		if !fenced && strings.HasPrefix(line, "#") {
			l := len(line) - len(strings.TrimLeft(line, "#"))
			switch {
			case level > 0 && l <= level:
				level = 0
			case level == 0 && slug(strings.TrimSpace(strings.TrimLeft(line, "#"))) == anchor:
				level = l
			}
		}
		if anchor == "" || level > 0 {
			section.WriteString(line + "\n")
		}
	}
	for _, g := range parseFigures(section.String()) {
		if g.dim == f.dim && f.near(g.value) {
			return true
		}
	}
	return false
}

// values are the values of each dimension the code sets.
type values map[dimension][]float64

func (v values) add(d dimension, x float64) { v[d] = append(v[d], x) }

func (v values) has(d dimension, x float64) bool {
	for _, y := range v[d] {
		if math.Abs(x-y) <= 1e-9*math.Max(math.Abs(x), math.Abs(y)) {
			return true
		}
	}
	return false
}

var (
	goDurationRE = regexp.MustCompile(`(\d+(?:\.\d+)?) \* time \. (Nanosecond|Microsecond|Millisecond|Second|Minute|Hour)\b|time \. (Nanosecond|Microsecond|Millisecond|Second|Minute|Hour) (?:\* (\d+(?:\.\d+)?))?`)
	goShiftRE    = regexp.MustCompile(`(\d+) << (10|20|30)\b`)
	// A Go duration or a Kubernetes quantity, as values, templates,
	// Makefiles and Go strings write them.
	literalRE = regexp.MustCompile(`(?:^|[^\w.])((?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+|\d+(?:Ki|Mi|Gi))\b`)
	// A value whose name gives its unit: timeoutSeconds: 5.
	namedRE = regexp.MustCompile(`(?i)\b\w*?(seconds|days|ratio|percent|qps|bytes)\b"?\s*[:=]\s*(\d+(?:\.\d+)?)\b`)
)

var goUnits = map[string]float64{"Nanosecond": 1e-9, "Microsecond": 1e-6, "Millisecond": 1e-3, "Second": 1, "Minute": 60, "Hour": 3600}

// codeValues returns the values the code sets: the Go sources under dirs
// (their tests too when tests), and the files or directories of others.
func codeValues(t *testing.T, dirs, others []string, tests bool) values {
	t.Helper()
	v := values{}
	for _, dir := range dirs {
		err := filepath.WalkDir(repo.Path(dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || !tests && strings.HasSuffix(p, "_test.go") {
				return err
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			goValues(v, data)
			return nil
		})
		require.NoError(t, err)
	}
	for _, o := range others {
		err := filepath.WalkDir(repo.Path(o), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for line := range strings.SplitSeq(string(data), "\n") {
				if i := strings.Index(line, "#"); i >= 0 && !strings.Contains(line[:i], "{{") {
					line = line[:i] // a comment: it may repeat a measured figure
				}
				textValues(v, line)
			}
			return nil
		})
		require.NoError(t, err)
	}
	return v
}

// goValues adds the values a Go source sets: durations, shifted sizes, and
// duration and quantity strings, its comments left out.
func goValues(v values, src []byte) {
	var s scanner.Scanner
	fset := token.NewFileSet()
	s.Init(fset.AddFile("", fset.Base(), len(src)), src, nil, 0)
	var b strings.Builder
	for {
		_, tok, lit := s.Scan()
		if tok == token.EOF {
			break
		}
		switch {
		case tok == token.STRING:
			if u, err := strconv.Unquote(lit); err == nil {
				textValues(v, u)
			}
			b.WriteString(`"" `)
		case lit != "":
			b.WriteString(lit + " ")
		default:
			b.WriteString(tok.String() + " ")
		}
	}
	code := b.String()
	for _, m := range goDurationRE.FindAllStringSubmatch(code, -1) {
		switch {
		case m[1] != "":
			v.add(dimTime, parseNumber(m[1])*goUnits[m[2]])
		case m[4] != "":
			v.add(dimTime, parseNumber(m[4])*goUnits[m[3]])
		default:
			v.add(dimTime, goUnits[m[3]])
		}
	}
	for _, m := range goShiftRE.FindAllStringSubmatch(code, -1) {
		n, _ := strconv.Atoi(m[2])
		v.add(dimSize, parseNumber(m[1])*math.Pow(2, float64(n)))
	}
	textValues(v, code)
}

// textValues adds the values a line of a values file, a template, a
// Makefile or a Go string sets.
func textValues(v values, line string) {
	for _, m := range literalRE.FindAllStringSubmatch(line, -1) {
		lit := m[1]
		if q, ok := strings.CutSuffix(lit, "i"); ok {
			n := parseNumber(q[:len(q)-1])
			v.add(dimSize, n*map[byte]float64{'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}[q[len(q)-1]])
			continue
		}
		if d, err := time.ParseDuration(lit); err == nil {
			v.add(dimTime, d.Seconds())
		}
	}
	for _, m := range namedRE.FindAllStringSubmatch(line, -1) {
		n := parseNumber(m[2])
		switch strings.ToLower(m[1]) {
		case "seconds":
			v.add(dimTime, n)
		case "days":
			v.add(dimTime, n*86400)
		case "ratio":
			v.add(dimPercent, n*100)
		case "percent":
			v.add(dimPercent, n)
		case "qps":
			v.add(dimRate, n)
		case "bytes":
			v.add(dimSize, n)
		}
	}
}
