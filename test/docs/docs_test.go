// Package docs checks that the documentation names only what exists, and
// documents everything a user sets or reads: every make target, flag, chart
// value and metric named in README.md, docs/ and the chart's README exists;
// every flag of the binaries, every chart value and every metric the
// binaries export is documented; and a measured figure is given only in
// docs/benchmarks.md (figures_test.go).
package docs

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"tally.dev/tally/internal/repo"
	"tally.dev/tally/test/framework"
)

// docFiles are the documents a user reads.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md", "CHANGELOG.md", filepath.Join("charts", "tally", "README.md")}
	for _, glob := range []string{"docs/*.md", "examples/*/README.md"} {
		m, err := filepath.Glob(repo.Path(glob))
		require.NoError(t, err)
		for _, f := range m {
			rel, err := filepath.Rel(repo.Root(), f)
			require.NoError(t, err)
			files = append(files, rel)
		}
	}
	return files
}

// code returns the code a document shows, by file: the text of its inline
// code spans and the lines of its fenced blocks.
func code(t *testing.T) map[string][]string {
	t.Helper()
	spanRE := regexp.MustCompile("`([^`\n]+)`")
	out := map[string][]string{}
	for _, f := range docFiles(t) {
		data, err := os.ReadFile(repo.Path(f))
		require.NoError(t, err)
		fenced := false
		for line := range strings.SplitSeq(string(data), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				fenced = !fenced
				continue
			}
			if fenced {
				out[f] = append(out[f], line)
				continue
			}
			for _, m := range spanRE.FindAllStringSubmatch(line, -1) {
				out[f] = append(out[f], m[1])
			}
		}
	}
	return out
}

// text returns the whole text of the documents.
func text(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for _, f := range docFiles(t) {
		data, err := os.ReadFile(repo.Path(f))
		require.NoError(t, err)
		b.Write(data)
	}
	return b.String()
}

func TestMakeTargets(t *testing.T) {
	makefile, err := os.ReadFile(repo.Path("Makefile"))
	require.NoError(t, err)
	targets := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^([a-z0-9-]+):`).FindAllStringSubmatch(string(makefile), -1) {
		targets[m[1]] = true
	}
	require.True(t, targets["test"])
	makeRE := regexp.MustCompile(`(?:^|[\s;&(])make ([a-z][a-z0-9-]*)`)
	var named int
	for f, snippets := range code(t) {
		for _, s := range snippets {
			for _, m := range makeRE.FindAllStringSubmatch(s, -1) {
				named++
				assert.True(t, targets[m[1]], "%s names `make %s`, which the Makefile does not have", f, m[1])
			}
		}
	}
	assert.Greater(t, named, 20)
}

// externalFlags are flags the documents name of commands that are not
// tally's, by command.
var externalFlags = map[string][]string{
	"helm":               {"create-namespace", "namespace", "version", "no-hooks", "wait", "timeout", "reuse-values", "set"},
	"kubectl":            {"kubeconfig", "context", "namespace", "as", "all-namespaces", "type", "dry-run", "server-side"},
	"cosign":             {"key", "insecure-ignore-tlog", "bundle", "type", "certificate-identity", "certificate-oidc-issuer"},
	"sha256sum":          {"check"},
	"kubectl krew":       {"manifest-url"},
	"kopf":               {"standalone", "priority", "namespace", "all-namespaces"},
	"go run ./certs/gen": {"dir", "hosts", "validity"},
	"nsenter":            {"net"},
	// hack/cluster, behind make cluster-up, cluster-down and e2e-cluster.
	"cluster": {"dir", "bin", "sandbox-image", "nodes", "node", "load", "check", "for"},
}

// ownFlags returns the flags of tally's commands, from their --help.
func ownFlags(t *testing.T) map[string][]string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, framework.BuildBinaries(dir, "webhook", "aggregator", "kubectl-tally", "tally-demo"))
	goFlagRE := regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
	cobraFlagRE := regexp.MustCompile(`(?m)^\s+(?:-[a-zA-Z], )?--([a-z][a-z0-9-]*)`)
	help := func(name string, args ...string) string {
		// Go's flag package exits 0 for -help and prints to stderr.
		out, _ := exec.Command(filepath.Join(dir, name), append(args, "--help")...).CombinedOutput()
		return string(out)
	}
	flags := map[string][]string{}
	for _, name := range []string{"webhook", "aggregator", "tally-demo"} {
		for _, m := range goFlagRE.FindAllStringSubmatch(help(name), -1) {
			flags[name] = append(flags[name], m[1])
		}
	}
	for _, sub := range [][]string{nil, {"explain"}, {"doctor"}, {"finalizers", "remove"}, {"version"}} {
		for _, m := range cobraFlagRE.FindAllStringSubmatch(help("kubectl-tally", sub...), -1) {
			if !slices.Contains(flags["kubectl-tally"], m[1]) {
				flags["kubectl-tally"] = append(flags["kubectl-tally"], m[1])
			}
		}
	}
	for _, name := range []string{"webhook", "aggregator", "kubectl-tally", "tally-demo"} {
		require.NotEmpty(t, flags[name], "%s --help lists no flag", name)
	}
	return flags
}

func TestFlags(t *testing.T) {
	own := ownFlags(t)
	known := map[string]bool{}
	for _, flags := range []map[string][]string{own, externalFlags} {
		for _, fs := range flags {
			for _, f := range fs {
				known[f] = true
			}
		}
	}
	flagRE := regexp.MustCompile(`(?:^|[\s(\[])--([a-z][a-z0-9-]*)`)
	for f, snippets := range code(t) {
		for _, s := range snippets {
			for _, m := range flagRE.FindAllStringSubmatch(s, -1) {
				assert.True(t, known[m[1]], "%s names --%s, a flag of no command it documents", f, m[1])
			}
		}
	}

	// Every flag of the servers in docs/configuration.md, and every flag
	// of kubectl tally's own (not kubectl's) in the documents.
	config, err := os.ReadFile(repo.Path("docs", "configuration.md"))
	require.NoError(t, err)
	for _, name := range []string{"webhook", "aggregator"} {
		for _, f := range own[name] {
			if strings.HasPrefix(f, "zap-") {
				f = "zap-log-level" // one row for controller-runtime's logging flags
			}
			assert.True(t, strings.Contains(string(config), "`--"+f+"`"), "docs/configuration.md does not document %s's --%s", name, f)
		}
	}
	all := text(t)
	for _, f := range kubectlTallyFlags(t) {
		assert.True(t, strings.Contains(all, "--"+f), "no document names kubectl tally's --%s", f)
	}
}

// kubectlTallyFlags returns the flags kubectl tally defines itself (not
// kubectl's, which it takes too).
func kubectlTallyFlags(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(repo.Path("cmd", "kubectl-tally", "app", "*.go"))
	require.NoError(t, err)
	defRE := regexp.MustCompile(`Flags\(\)\.\w+\(&?[\w.]*,\s*"([a-z][a-z0-9-]*)"`)
	var flags []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range defRE.FindAllStringSubmatch(string(data), -1) {
			flags = append(flags, m[1])
		}
	}
	require.NotEmpty(t, flags)
	return flags
}

// valuePaths returns every value the chart's schema accepts, by path, with
// list elements as name[] (parents[].kind); true for the leaves.
func valuePaths(t *testing.T) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(repo.Path("charts", "tally", "values.schema.json"))
	require.NoError(t, err)
	var schema map[string]any
	require.NoError(t, json.Unmarshal(data, &schema))
	paths := map[string]bool{}
	var walk func(prefix string, node map[string]any) bool
	walk = func(prefix string, node map[string]any) (children bool) {
		props, _ := node["properties"].(map[string]any)
		for k, c := range props {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			child, _ := c.(map[string]any)
			paths[p] = !walk(p, child)
			children = true
		}
		if items, ok := node["items"].(map[string]any); ok {
			children = walk(prefix+"[]", items) || children
		}
		return children
	}
	walk("", schema)
	require.Greater(t, len(paths), 50)
	return paths
}

// documentedValues returns the values the chart README's table has a row
// for, each named as `a.b`, or as `.c` after `a.b` (a sibling: a.c).
func documentedValues(t *testing.T) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(repo.Path("charts", "tally", "README.md"))
	require.NoError(t, err)
	rows := map[string]bool{}
	cellRE := regexp.MustCompile("`([^`]+)`")
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		first := strings.SplitN(line[1:], "|", 2)[0]
		var last string
		for _, m := range cellRE.FindAllStringSubmatch(first, -1) {
			name := m[1]
			if strings.HasPrefix(name, ".") && last != "" {
				name = last[:strings.LastIndex(last, ".")] + name
			}
			rows[name] = true
			last = name
		}
	}
	return rows
}

func TestValues(t *testing.T) {
	paths := valuePaths(t)
	rows := documentedValues(t)
	var missing []string
	for p, leaf := range paths {
		if !leaf {
			continue
		}
		documented := false
		for q := p; q != "" && !documented; {
			documented = rows[q]
			if i := strings.LastIndexAny(q, ".["); i >= 0 {
				q = q[:i]
			} else {
				q = ""
			}
		}
		if !documented {
			missing = append(missing, p)
		}
	}
	sort.Strings(missing)
	assert.Empty(t, missing, "values the schema accepts without a row in charts/tally/README.md")
	for row := range rows {
		_, ok := paths[row]
		assert.True(t, ok, "charts/tally/README.md documents the value %s, which the chart's schema does not accept", row)
	}

	// A value named anywhere in the documents exists.
	tops := map[string]bool{}
	for p := range paths {
		if !strings.ContainsAny(p, ".[") {
			tops[p] = true
		}
	}
	valueRE := regexp.MustCompile(`(?:^|[\s,])(?:--set[= ])?([a-z][A-Za-z]*(?:\[\])?(?:\.[a-zA-Z][A-Za-z0-9]*(?:\[\])?)+)(?:=|$|[\s,)])`)
	for f, snippets := range code(t) {
		for _, s := range snippets {
			for _, m := range valueRE.FindAllStringSubmatch(s, -1) {
				top := strings.SplitN(strings.SplitN(m[1], ".", 2)[0], "[", 2)[0]
				if !tops[top] || f == "docs/configuration.md" && !strings.Contains(s, "=") {
					continue // another file's key (the config file's parents[], ...)
				}
				_, ok := paths[m[1]]
				assert.True(t, ok, "%s names the chart value %s, which the chart's schema does not accept (in %q)", f, m[1], s)
			}
		}
	}
}

// metricRE matches the name of one of tally's metrics.
var metricRE = regexp.MustCompile(`tally_(?:webhook|aggregator)_[a-z0-9_]*[a-z0-9]`)

// exported returns the metrics the product defines: the names in its
// non-test sources.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	quoted := regexp.MustCompile(`"(` + metricRE.String() + `)"`)
	for _, dir := range []string{"cmd", "pkg", "internal"} {
		err := filepath.WalkDir(repo.Path(dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, m := range quoted.FindAllStringSubmatch(string(data), -1) {
				names[m[1]] = true
			}
			return nil
		})
		require.NoError(t, err)
	}
	require.Greater(t, len(names), 20)
	return names
}

func TestMetrics(t *testing.T) {
	names := exported(t)
	all := text(t)
	named := map[string]bool{}
	for _, m := range metricRE.FindAllString(all, -1) {
		named[m] = true
	}
	for m := range named {
		base := m
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(m, suffix); ok && names[b] {
				base = b
			}
		}
		assert.True(t, names[base], "the documents name the metric %s, which no binary defines", m)
	}
	operating, err := os.ReadFile(repo.Path("docs", "operating.md"))
	require.NoError(t, err)
	for m := range names {
		assert.True(t, strings.Contains(string(operating), "`"+m), "docs/operating.md does not document the metric %s", m)
	}
}

// TestSampleValuesInReadme: the README shows the sample values file as it
// is (test/chart renders it with the chart and its schema).
func TestSampleValuesInReadme(t *testing.T) {
	sample, err := os.ReadFile(repo.Path("examples", "values.yaml"))
	require.NoError(t, err)
	readme, err := os.ReadFile(repo.Path("README.md"))
	require.NoError(t, err)
	assert.Contains(t, string(readme), "```yaml\n"+string(sample)+"```", "README.md shows examples/values.yaml as it is")
}
