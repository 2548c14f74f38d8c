package config

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A parent's customCounts and compare are the aggregator's business: nothing
// inside them may make the document invalid.
func TestNothingInsideTheAggregatorKeysFailsParse(t *testing.T) {
	for name, doc := range map[string]string{
		"a compare value <<": "parents:\n- version: v1\n  kind: A\n  counts: {completing: status.tally.completing}\n" +
			"  compare:\n    completing: <<\n    active: status.active\n",
		"a custom count's expression <<": "parents:\n- version: v1\n  kind: A\n" +
			"  customCounts:\n  - {name: ready, expression: <<, path: status.ready}\n",
		"a merge key inside a custom count": "parents:\n- version: v1\n  kind: A\n" +
			"  customCounts:\n  - {<<: 1, name: ready, path: status.ready, expression: 'true'}\n",
		"a merge key inside compare": "parents:\n- version: v1\n  kind: A\n  counts: {completing: status.tally.completing}\n" +
			"  compare: {<<: [status.x]}\n",
		"an anchor that contains itself, inside compare": "parents:\n- version: v1\n  kind: A\n  counts: {completing: status.tally.completing}\n" +
			"  compare: &c {completing: *c}\n",
		"aliases expanding past the bound, inside compare": "parents:\n- version: v1\n  kind: A\n  counts: {completing: status.tally.completing}\n" +
			"  compare:\n    a: &a [x,x,x,x,x,x,x,x]\n    b: &b [*a,*a,*a,*a,*a,*a,*a,*a]\n    c: &c [*b,*b,*b,*b,*b,*b,*b,*b]\n" +
			"    d: &d [*c,*c,*c,*c,*c,*c,*c,*c]\n    e: &e [*d,*d,*d,*d,*d,*d,*d,*d]\n    f: [*e,*e,*e,*e,*e,*e,*e,*e]\n",
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := Parse([]byte(doc))
			require.NoError(t, err, "a problem inside customCounts or compare is the entry's, not the document's")
			_, err = Check([]byte(doc))
			assert.Error(t, err, "Check still refuses it")
			assert.Error(t, errorsOf(cfg))
		})
	}
}

func errorsOf(cfg *Config) error {
	if err := cfg.CustomCountErrors(); err != nil {
		return err
	}
	return cfg.CompareErrors()
}

// Everything outside customCounts and compare is refused exactly as the
// strict decoder refuses it: whether the document also has a compare must
// not matter.
func TestMergeKeysElsewhereRefusedAsBefore(t *testing.T) {
	for name, doc := range map[string]string{
		// The strict decoder refuses a key set both by a merge and
		// directly ("key already set in map").
		"a merge that a key overrides": "parents:\n- &b {version: v1, kind: B}\n- <<: *b\n  kind: A\n  compare: {}\n",
		"two merged maps that overlap": "parents:\n- &b {version: v1, kind: B}\n- &c {version: v1, kind: C}\n- <<: [*b, *c]\n  group: x.y\n  compare: {}\n",
		// The strict decoder refuses a merge key whose value is an alias
		// of a sequence ("map merge requires map or sequence of maps").
		"a merge of an alias of a sequence": "namespaceSelector: {matchExpressions: &l []}\nparents:\n- <<: *l\n  version: v1\n  kind: A\n  compare: {}\n",
	} {
		t.Run(name, func(t *testing.T) {
			_, errWithout := Parse([]byte(strings.Replace(doc, "  compare: {}\n", "", 1)))
			require.Error(t, errWithout, "refused without a compare")
			_, err := Parse([]byte(doc))
			assert.Error(t, err, "so it must be refused with one")
		})
	}
}

// Aliases of a long scalar cost no more than the bounds allow: the rest is
// written out with its aliases (the strict decoding checks them itself),
// and a custom count's are expanded within a number of nodes and bytes.
func TestAliasesOfALongScalarStayCheap(t *testing.T) {
	list := func(anchor, of string, n int) string {
		return anchor + " [" + strings.TrimSuffix(strings.Repeat(of+", ", n), ", ") + "]"
	}
	bomb := "  s: &s " + strings.Repeat("x", 256) + "\n  a: " + list("&l1", "*s", 16) + "\n  b: " + list("&l2", "*l1", 16) +
		"\n  c: " + list("&l3", "*l2", 16) + "\n  d: " + list("", "*l3", 6) + "\n"
	for name, doc := range map[string]string{
		"in the rest":       "parents:\n- version: v1\n  kind: A\n  compare: {}\nx:\n" + bomb,
		"in a custom count": "parents:\n- version: v1\n  kind: A\n  customCounts:\n  - name: r\n    path: status.r\n    expression: 'true'\n    x:\n  " + strings.ReplaceAll(bomb, "\n  ", "\n    ") + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			_, _ = Parse([]byte(doc))
			runtime.ReadMemStats(&after)
			allocated := after.TotalAlloc - before.TotalAlloc
			assert.Less(t, allocated, uint64(32<<20), "Parse of a %d-byte document allocated %d MiB", len(doc), allocated>>20)
		})
	}
}

// The bounds count only what aliases add: a long document with no alias
// is read as before.
func TestNoBoundOnADocumentWithoutAliases(t *testing.T) {
	doc := "parents: [{version: v1, kind: A}]\nnamespaceSelector:\n  matchExpressions:\n  - key: team\n    operator: In\n    values: [" +
		strings.TrimSuffix(strings.Repeat("a,", 70000), ",") + "]\n"
	require.NotContains(t, doc, "*")
	_, err := Parse([]byte(doc))
	assert.NoError(t, err, "nothing here is an alias")
}

// TestBoundsAreEachValues: the bounds on what aliases add hold for each
// value on its own: a document of many long custom counts, with no alias,
// keeps every one.
func TestBoundsAreEachValues(t *testing.T) {
	var doc strings.Builder
	doc.WriteString("parents:\n")
	for k := range 40 {
		fmt.Fprintf(&doc, "- version: v1\n  kind: K%d\n  counts: {completing: status.tally.completing}\n  compare: {completing: status.completing}\n  customCounts:\n", k)
		fmt.Fprintf(&doc, "  - {name: long, path: status.long, expression: '%s'}\n", "true"+strings.Repeat(" && true", 4000))
	}
	cfg, err := Check([]byte(doc.String()))
	require.NoError(t, err)
	require.Len(t, cfg.Parents, 40)
	for _, p := range cfg.Parents {
		require.Len(t, p.CustomCounts, 1)
		assert.Equal(t, map[Count]string{Completing: "status.completing"}, p.Compare)
	}
}

// TestWholeCustomCountsErrorsAlone: customCounts given twice, or not a
// list, is reported as such, with no other message about a count nobody
// wrote.
func TestWholeCustomCountsErrorsAlone(t *testing.T) {
	for doc, want := range map[string]string{
		"parents: [{version: v1, kind: A, customCounts: [], customCounts: []}]\n": "parents[0].customCounts: given 2 times",
		"parents: [{version: v1, kind: A, customCounts: {name: r}}]\n":            "parents[0].customCounts: not a list of custom counts",
	} {
		_, err := Check([]byte(doc))
		require.Error(t, err, doc)
		assert.Equal(t, want, err.Error(), doc)
	}
}
