package docs

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/cli-runtime/pkg/genericiooptions"

	"tally.dev/tally/cmd/kubectl-tally/app"
	"tally.dev/tally/internal/repo"
)

// readmeLines bounds README.md: it is for users; contributors read
// docs/development.md.
const readmeLines = 200

// TestReadmeForUsers: README.md stays within its length, carries no dated
// figure (measured figures live, dated, in docs/benchmarks.md), and names
// every certificate mode the chart accepts.
func TestReadmeForUsers(t *testing.T) {
	data, err := os.ReadFile(repo.Path("README.md"))
	require.NoError(t, err)
	readme := string(data)
	lines := strings.Count(readme, "\n")
	assert.LessOrEqual(t, lines, readmeLines, "README.md has %d lines; move what is for contributors to docs/development.md", lines)
	dateRE := regexp.MustCompile(`\b20\d\d-[01]\d-[0-3]\d\b`)
	for _, d := range dateRE.FindAllString(readme, -1) {
		t.Errorf("README.md carries the date %s: a measured figure goes, dated, to docs/benchmarks.md", d)
	}
	for _, mode := range certificateModes(t) {
		assert.Contains(t, readme, "`"+mode+"`", "README.md does not name the certificate mode %s, which the chart accepts", mode)
	}
}

// certificateModes returns the values of certificates.mode the chart's
// schema accepts.
func certificateModes(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(repo.Path("charts", "tally", "values.schema.json"))
	require.NoError(t, err)
	var schema struct {
		Properties struct {
			Certificates struct {
				Properties struct {
					Mode struct {
						Enum []string `json:"enum"`
					} `json:"mode"`
				} `json:"properties"`
			} `json:"certificates"`
		} `json:"properties"`
	}
	require.NoError(t, json.Unmarshal(data, &schema))
	modes := schema.Properties.Certificates.Properties.Mode.Enum
	require.NotEmpty(t, modes, "the chart's schema lists no certificates.mode")
	return modes
}

// TestLinks: every relative link of the documents points to a file of the
// tree, and, into a Markdown file, to one of its headings.
func TestLinks(t *testing.T) {
	linkRE := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, f := range docFiles(t) {
		for _, m := range linkRE.FindAllStringSubmatch(prose(t, f), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			file := f
			if path != "" {
				file = filepath.Join(filepath.Dir(f), path)
				if _, err := os.Stat(repo.Path(file)); err != nil {
					t.Errorf("%s links to %s, which does not exist", f, target)
					continue
				}
			}
			if anchor != "" && strings.HasSuffix(file, ".md") {
				assert.Contains(t, headings(t, file), anchor, "%s links to %s, a heading %s does not have", f, target, file)
			}
		}
	}
}

// prose returns a document without its code: fenced blocks and inline
// code spans.
func prose(t *testing.T, file string) string {
	t.Helper()
	data, err := os.ReadFile(repo.Path(file))
	require.NoError(t, err)
	spanRE := regexp.MustCompile("`[^`\n]+`")
	var b strings.Builder
	fenced := false
	for line := range strings.SplitSeq(string(data), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			b.WriteString(spanRE.ReplaceAllString(line, ""))
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// headings returns the anchors of a Markdown file's headings, as GitHub
// makes them.
func headings(t *testing.T, file string) []string {
	t.Helper()
	data, err := os.ReadFile(repo.Path(file))
	require.NoError(t, err)
	var out []string
	fenced := false
	for line := range strings.SplitSeq(string(data), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		out = append(out, slug(title))
	}
	return out
}

// slug is GitHub's anchor of a heading: lower case, punctuation dropped but
// hyphens and underscores, spaces as hyphens.
func slug(title string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(title) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-', r == '_', r >= 'a' && r <= 'z', r >= '0' && r <= '9', r > 127 && isLetter(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func isLetter(r rune) bool { return strings.ToUpper(string(r)) != strings.ToLower(string(r)) }

// TestKubectlTallyCommands: every `kubectl tally X` the documents show is a
// command of the plugin, and for a command that has subcommands
// (finalizers), the word after it is one of them.
func TestKubectlTallyCommands(t *testing.T) {
	root := subcommands(t)
	require.Contains(t, root, "doctor")
	cmdRE := regexp.MustCompile(`kubectl[ -]tally ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?`)
	named := 0
	for f, snippets := range code(t) {
		for _, s := range snippets {
			for _, m := range cmdRE.FindAllStringSubmatch(s, -1) {
				named++
				if !assert.Contains(t, root, m[1], "%s shows `kubectl tally %s`, which is no command of the plugin", f, m[1]) {
					continue
				}
				if children := subcommands(t, m[1]); len(children) > 0 && m[2] != "" {
					assert.Contains(t, children, m[2], "%s shows `kubectl tally %s %s`, which is no command of the plugin", f, m[1], m[2])
				}
			}
		}
	}
	assert.Greater(t, named, 5)
}

// subcommands returns the commands the plugin's help lists under the
// command path (the plugin itself when empty).
func subcommands(t *testing.T, path ...string) []string {
	t.Helper()
	var out bytes.Buffer
	code := app.Main(append(path, "--help"), genericiooptions.IOStreams{Out: &out, ErrOut: &out})
	require.Zero(t, code, "kubectl tally %s --help: %s", strings.Join(path, " "), out.String())
	_, list, found := strings.Cut(out.String(), "Available Commands:\n")
	if !found {
		return nil
	}
	var names []string
	for line := range strings.SplitSeq(list, "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 || !strings.HasPrefix(line, "  ") {
			break
		}
		names = append(names, fields[0])
	}
	return names
}
