package config

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestParseValid(t *testing.T) {
	tests := map[string]struct {
		doc  string
		want Config
	}{
		"defaults counts to completing": {
			doc: `
parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
`,
			want: Config{Parents: []Parent{{
				Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool",
				Counts: map[Count]string{Completing: "status.completing"},
			}}, NamespaceSelector: DefaultNamespaceSelector()},
		},
		"explicit mapping, core group, verifyOwner": {
			doc: `
parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    resource: workerpools
    counts:
      completing: status.completing
      active: status.pods.active
  - group: ""
    version: v1
    kind: ReplicationController
verifyOwner: true
namespaceSelector:
  matchLabels: {team: a}
`,
			want: Config{
				VerifyOwner:       true,
				NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "a"}},
				Parents: []Parent{
					{
						Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Resource: "workerpools",
						Counts: map[Count]string{Completing: "status.completing", Active: "status.pods.active"},
					},
					{Version: "v1", Kind: "ReplicationController", Counts: map[Count]string{Completing: "status.completing"}},
				},
			},
		},
		"totals with their ledger": {
			doc: `
parents:
  - version: v1
    kind: A
    counts:
      unexpectedTotal: status.restarts
    ledger: status.tallyLedger
`,
			want: Config{Parents: []Parent{{
				Version: "v1", Kind: "A",
				Counts: map[Count]string{UnexpectedTotal: "status.restarts"}, Ledger: "status.tallyLedger",
			}}, NamespaceSelector: DefaultNamespaceSelector()},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			cfg, err := Parse([]byte(tc.doc))
			require.NoError(t, err)
			assert.Equal(t, tc.want, *cfg)
		})
	}
}

func TestParseInvalid(t *testing.T) {
	tests := map[string]struct {
		doc     string
		wantErr string
	}{
		"unknown top-level key": {
			doc:     "parents: [{version: v1, kind: A}]\nverifyOwnr: true\n",
			wantErr: `verifyOwnr: unknown key`,
		},
		"unknown parent key": {
			doc:     "parents: [{version: v1, kind: A, resources: as}]\n",
			wantErr: `parents[0].resources: unknown key`,
		},
		"bad namespace selector": {
			doc:     "parents: [{version: v1, kind: A}]\nnamespaceSelector: {matchExpressions: [{key: team, operator: Near}]}\n",
			wantErr: `namespaceSelector: "Near" is not a valid label selector operator`,
		},
		"no parents": {
			doc:     "verifyOwner: true\n",
			wantErr: "parents: at least one parent kind is required",
		},
		"missing kind": {
			doc:     "parents: [{group: example.tally.dev, version: v1}]\n",
			wantErr: "parents[0].kind: required",
		},
		"missing version": {
			doc:     "parents: [{kind: A}]\n",
			wantErr: "parents[0].version: required",
		},
		"ReplicaSet: tally's own pods": {
			doc:     "parents: [{group: apps, version: v1, kind: ReplicaSet}]\n",
			wantErr: "parents[0]: apps/ReplicaSet cannot be a parent kind: it controls tally's own pods",
		},
		"bad group": {
			doc:     "parents: [{group: Example_Group, version: v1, kind: A}]\n",
			wantErr: `parents[0].group: "Example_Group" is not a valid API group`,
		},
		"unknown count": {
			doc:     "parents: [{version: v1, kind: A, counts: {finished: status.finished}}]\n",
			wantErr: `parents[0].counts.finished: unknown count "finished"`,
		},
		"path outside status": {
			doc:     "parents: [{version: v1, kind: A, counts: {completing: spec.completing}}]\n",
			wantErr: `parents[0].counts.completing: field path "spec.completing" must be under status.`,
		},
		"bare status path": {
			doc:     "parents: [{version: v1, kind: A, counts: {completing: status}}]\n",
			wantErr: `parents[0].counts.completing: field path "status" must be under status.`,
		},
		"empty path segment": {
			doc:     "parents: [{version: v1, kind: A, counts: {completing: status..x}}]\n",
			wantErr: `parents[0].counts.completing: field path "status..x" has an invalid segment ""`,
		},
		"overlapping paths": {
			doc:     "parents: [{version: v1, kind: A, counts: {active: status.a, completing: status.a.b}}]\n",
			wantErr: `overlaps "status.a"`,
		},
		"duplicate kind": {
			doc:     "parents: [{version: v1, kind: A}, {version: v2, kind: A}]\n",
			wantErr: "parents[1]: kind A is already configured at parents[0]",
		},
		"total without a ledger": {
			doc:     "parents: [{version: v1, kind: A, counts: {completedTotal: status.done}}]\n",
			wantErr: "parents[0].ledger: required when completedTotal or unexpectedTotal is mapped",
		},
		"ledger without a total": {
			doc:     "parents: [{version: v1, kind: A, ledger: status.l}]\n",
			wantErr: "parents[0].ledger: set, but neither completedTotal nor unexpectedTotal is mapped",
		},
		"ledger outside status": {
			doc:     "parents: [{version: v1, kind: A, counts: {unexpectedTotal: status.u}, ledger: spec.l}]\n",
			wantErr: `parents[0].ledger: field path "spec.l" must be under status.`,
		},
		"ledger overlapping a count": {
			doc:     "parents: [{version: v1, kind: A, counts: {unexpectedTotal: status.l.u}, ledger: status.l}]\n",
			wantErr: `parents[0].counts.unexpectedTotal: field path "status.l.u" overlaps "status.l", mapped by the ledger`,
		},
		"wrong type": {
			doc:     "parents: [{version: v1, kind: A}]\nverifyOwner: yes please\n",
			wantErr: "verifyOwner",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.doc))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

// TestParseCustomCountErrors checks that a custom count's own problem is
// that count's Err, naming its key: Parse keeps the rest of the
// configuration (another count after it included), the count has no
// field, and Check refuses the document with the same message.
func TestParseCustomCountErrors(t *testing.T) {
	tests := map[string]struct {
		// counts are the kind's custom counts, before a valid one.
		counts string
		// bad is the index of the count in error.
		bad     int
		wantErr string
	}{
		"unknown custom count key": {
			counts:  "{name: ready, path: status.ready, expr: 'true'}",
			wantErr: `parents[0].customCounts[0].expr: unknown key`,
		},
		"a key twice in a custom count": {
			counts:  "{name: ready, path: status.ready, expression: 'true', name: up}",
			wantErr: `parents[0].customCounts[0]: not a custom count (name, path, expression):`,
		},
		"a value of the wrong type": {
			counts:  "{name: ready, path: status.ready, expression: [true]}",
			wantErr: `parents[0].customCounts[0]: error unmarshaling JSON: while decoding JSON: json: cannot unmarshal array into Go struct field CustomCount.expression of type string`,
		},
		"an item that is not a map": {
			counts:  "ready",
			wantErr: `parents[0].customCounts[0]: not a custom count (name, path, expression):`,
		},
		"custom count without a name": {
			counts:  "{path: status.ready, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].name: required`,
		},
		"custom count named as a built-in one": {
			counts:  "{name: active, path: status.ready, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].name: "active" is a built-in count: map it in counts`,
		},
		"custom count with a bad name": {
			counts:  "{name: Ready-1, path: status.ready, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].name: "Ready-1" is not a count name`,
		},
		"two custom counts of one name": {
			counts:  "{name: ready, path: status.ready, expression: 'true'}, {name: ready, path: status.up, expression: 'true'}",
			bad:     1,
			wantErr: `parents[0].customCounts[1].name: "ready" is already the name of customCounts[0]`,
		},
		"custom count without a path": {
			counts:  "{name: ready, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].path: required (e.g. status.ready)`,
		},
		"custom count over the default completing": {
			counts:  "{name: ready, path: status.completing, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].path: field path "status.completing" overlaps "status.completing", mapped by count completing`,
		},
		"custom count over another": {
			counts:  "{name: ready, path: status.r, expression: 'true'}, {name: up, path: status.r.up, expression: 'true'}",
			bad:     1,
			wantErr: `parents[0].customCounts[1].path: field path "status.r.up" overlaps "status.r", mapped by count ready`,
		},
		"custom count outside status": {
			counts:  "{name: ready, path: spec.ready, expression: 'true'}",
			wantErr: `parents[0].customCounts[0].path: field path "spec.ready" must be under status.`,
		},
		"custom count whose expression does not compile": {
			counts:  "{name: ready, path: status.ready, expression: 'pod.stauts.phase == \"Running\"'}",
			wantErr: "parents[0].customCounts[0].expression: the expression of A.example.tally.dev's count \"ready\" does not compile:\nERROR: parents[0].customCounts[0].expression:1:4: undefined field 'stauts'",
		},
		"custom count that is not boolean": {
			counts:  "{name: ready, path: status.ready, expression: 'pod.status.phase'}",
			wantErr: `parents[0].customCounts[0].expression: the expression of A.example.tally.dev's count "ready" is of type string, not bool`,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			doc := "parents: [{group: example.tally.dev, version: v1, kind: A, customCounts: [" + tc.counts +
				", {name: fine, path: status.fine, expression: 'true'}]}]\n"
			cfg, err := Parse([]byte(doc))
			require.NoError(t, err, "a custom count's problem is its own")
			p := cfg.Parents[0]
			require.ErrorContains(t, p.CustomCounts[tc.bad].Err, tc.wantErr)
			fine := len(p.CustomCounts) - 1
			require.NoError(t, p.CustomCounts[fine].Err)
			var fields []Count
			for _, f := range p.Fields() {
				fields = append(fields, f.Count)
			}
			assert.Contains(t, fields, Count("fine"))
			programs, errs := p.Programs()
			assert.Nil(t, programs[tc.bad])
			assert.Equal(t, p.CustomCounts[tc.bad].Err, errs[tc.bad])
			assert.NotNil(t, programs[fine])
			assert.Len(t, p.Broken(), 1)

			_, err = Check([]byte(doc))
			var invalid *InvalidError
			require.ErrorAs(t, err, &invalid)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

// TestParseCustomCountsApart: customCounts that is not a list is one
// count in error, the kind's other settings kept; everything outside
// custom counts decodes as strictly as before.
func TestParseCustomCountsApart(t *testing.T) {
	cfg, err := Parse([]byte("parents: [{version: v1, kind: A, counts: {active: status.active}, customCounts: {name: ready}}]\n"))
	require.NoError(t, err)
	p := cfg.Parents[0]
	assert.Equal(t, map[Count]string{Active: "status.active"}, p.Counts)
	require.Len(t, p.CustomCounts, 1)
	require.ErrorContains(t, p.CustomCounts[0].Err, "parents[0].customCounts: not a list of custom counts")

	cfg, err = Parse([]byte("parents: [{version: v1, kind: A, customCounts: [], customCounts: []}]\n"))
	require.NoError(t, err, "a customCounts given twice is the custom counts' problem")
	require.Len(t, cfg.Parents[0].CustomCounts, 1)
	require.ErrorContains(t, cfg.Parents[0].CustomCounts[0].Err, "parents[0].customCounts: given 2 times")

	cfg, err = Parse([]byte("parents: [{version: v1, kind: A, customCounts: }]\nverifyOwner: yes\nnamespaceSelector: {matchLabels: {'team': '007'}}\n"))
	require.NoError(t, err)
	assert.Empty(t, cfg.Parents[0].CustomCounts)
	assert.True(t, cfg.VerifyOwner, "YAML 1.1's yes, as before")
	assert.Equal(t, map[string]string{"team": "007"}, cfg.NamespaceSelector.MatchLabels)

	for doc, want := range map[string]string{
		"parents: [{version: v1, kind: A}]\nverifyOwner: true\nverifyOwner: false\n":                                       `"verifyOwner" already set in map`,
		"parents: [{version: v1, kind: A, customCounts: [{name: ready, path: status.ready, expression: 'true'}]}]\nx: 1\n": "x: unknown key",
		"parents: [{version: v1, kind: A, counts: [active]}]\n":                                                            "cannot unmarshal array",
	} {
		_, err := Parse([]byte(doc))
		assert.ErrorContains(t, err, want, doc)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	require.NoError(t, os.WriteFile(path, []byte("parents: [{version: v1, kind: A, counts: {x: status.x}}]\n"), 0o600))

	_, err := Load(path)
	require.ErrorContains(t, err, "config "+path+": parents[0].counts.x: unknown count")

	_, err = Load(filepath.Join(dir, "missing.yaml"))
	require.ErrorContains(t, err, "reading config")
}

func TestFieldsOrder(t *testing.T) {
	p := Parent{Counts: map[Count]string{Unexpected: "status.u", Completing: "status.c.n", Active: "status.a", CompletedTotal: "status.t"},
		CustomCounts: []CustomCount{{Name: "ready", Path: "status.r"}, {Name: "restarted", Path: "status.x.r"}}}
	assert.Equal(t, []Field{
		{Count: Completing, Path: []string{"status", "c", "n"}},
		{Count: Active, Path: []string{"status", "a"}},
		{Count: Unexpected, Path: []string{"status", "u"}},
		{Count: "ready", Path: []string{"status", "r"}, Custom: true, Index: 0},
		{Count: "restarted", Path: []string{"status", "x", "r"}, Custom: true, Index: 1},
		{Count: CompletedTotal, Path: []string{"status", "t"}},
	}, p.Fields())
}

func TestParseCustomCounts(t *testing.T) {
	cfg, err := Parse([]byte(`parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    counts: {active: status.active}
    customCounts:
      - name: ready
        path: status.ready
        expression: 'pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")'
      - name: restarted
        path: status.restarted
        expression: 'pod.status.containerStatuses.exists(s, s.restartCount > 0)'
`))
	require.NoError(t, err)
	p := cfg.Parents[0]
	assert.Equal(t, []string{"ready", "restarted"}, []string{p.CustomCounts[0].Name, p.CustomCounts[1].Name})
	programs, errs := p.Programs()
	assert.Equal(t, []error{nil, nil}, errs)
	assert.Len(t, programs, 2)
	require.NoError(t, cfg.CustomCountErrors())

	many := "parents: [{version: v1, kind: A, customCounts: ["
	for i := range MaxCustomCounts + 1 {
		many += fmt.Sprintf("{name: c%d, path: status.c%d, expression: 'true'},", i, i)
	}
	cfg, err = Parse([]byte(many + "]}]\n"))
	require.NoError(t, err)
	require.Len(t, cfg.Parents[0].Broken(), 1, "the counts past the most one kind may have")
	require.ErrorContains(t, cfg.Parents[0].CustomCounts[MaxCustomCounts].Err, "parents[0].customCounts[32]: A has more than 32 custom counts, the most one kind may have")
}

// TestParseCompare: a comparison that can be made is kept in Compare; one
// that cannot is in CompareErrs, naming its key, the rest of the
// configuration kept, and Check refuses the document with the same
// message.
func TestParseCompare(t *testing.T) {
	const kind = "{group: example.tally.dev, version: v1, kind: A, counts: {completing: status.tally.completing, completedTotal: status.tally.done}, ledger: status.ledger, customCounts: [{name: ready, path: status.tally.ready, expression: 'true'}, {name: broken, path: status.tally.broken, expression: 'pod.nope'}], "
	tests := map[string]struct {
		compare string
		want    map[Count]string
		wantErr string
	}{
		"a built-in count": {
			compare: "{completing: status.completing}",
			want:    map[Count]string{Completing: "status.completing"},
		},
		"an unmapped count and a custom count": {
			compare: "{active: status.running, ready: status.readyPods}",
			want:    map[Count]string{Active: "status.running", "ready": "status.readyPods"},
		},
		"the field tally writes": {
			compare: "{completing: status.tally.completing}",
			wantErr: `parents[0].compare.completing: field path "status.tally.completing" overlaps "status.tally.completing", which tally writes (count completing)`,
		},
		"a field inside one tally writes": {
			compare: "{ready: status.tally.ready.now}",
			wantErr: `parents[0].compare.ready: field path "status.tally.ready.now" overlaps "status.tally.ready", which tally writes (count ready)`,
		},
		"the ledger": {
			compare: "{active: status.ledger}",
			wantErr: `overlaps "status.ledger", which tally writes (the ledger)`,
		},
		"a total": {
			compare: "{completedTotal: status.done}",
			wantErr: `parents[0].compare.completedTotal: a total cannot be compared`,
		},
		"an unknown count": {
			compare: "{running: status.running}",
			wantErr: `parents[0].compare.running: unknown count "running"`,
		},
		"a custom count that cannot be kept": {
			compare: "{broken: status.broken}",
			wantErr: `parents[0].compare.broken: custom count "broken" cannot be kept`,
		},
		"a path outside status": {
			compare: "{completing: spec.completing}",
			wantErr: `parents[0].compare.completing: field path "spec.completing" must be under status.`,
		},
		"a value that is not a path": {
			compare: "{completing: 3}",
			wantErr: `parents[0].compare.completing: not a status path`,
		},
		"a count twice": {
			compare: "{completing: status.a, completing: status.b}",
			wantErr: `parents[0].compare.completing: given twice`,
		},
		"not a map": {
			compare: "[completing]",
			wantErr: `parents[0].compare: not a map of count names`,
		},
	}
	// The same, written through YAML's aliases, and given twice: the
	// comparisons' problem still, never the document's.
	written := map[string]struct {
		doc     string
		want    map[Count]string
		wantErr string
	}{
		"given twice": {
			doc:     "parents: [{version: v1, kind: A, counts: {completing: status.tally.completing}, compare: {completing: status.a}, compare: {active: status.b}}]\n",
			wantErr: "parents[0].compare: given 2 times",
		},
		"an anchor inside it that the rest uses": {
			doc:  "parents:\n- {version: v1, kind: A, counts: {completing: status.tally.completing}, compare: {completing: &legacy status.legacy}}\n- {version: v1, kind: B, counts: {completing: *legacy}}\n",
			want: map[Count]string{Completing: "status.legacy"},
		},
		"an anchor that contains itself": {
			doc:     "parents:\n- {version: v1, kind: A, counts: {completing: status.tally.completing}, compare: &c {completing: *c}}\n",
			wantErr: "parents[0].compare: line 2: aliases expand to more than",
		},
		"a merge key inside it": {
			doc:     "parents:\n- {version: v1, kind: A, counts: {completing: status.tally.completing}, compare: {<<: [status.x]}}\n",
			wantErr: "parents[0].compare.<<: a merge key (<<) is not read here",
		},
		"an alias of a valid map": {
			doc: "parents:\n- {version: v1, kind: A, counts: {completing: status.tally.completing}, compare: &c {completing: status.completing}}\n" +
				"- {version: v1, kind: B, counts: {completing: status.tally.completing}, compare: *c}\n",
			want: map[Count]string{Completing: "status.completing"},
		},
	}
	for name, tc := range written {
		t.Run(name, func(t *testing.T) {
			cfg, err := Parse([]byte(tc.doc))
			require.NoError(t, err, "a comparison's problem is its own")
			if tc.wantErr != "" {
				require.ErrorContains(t, cfg.CompareErrors(), tc.wantErr)
				_, err = Check([]byte(tc.doc))
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, cfg.CompareErrors())
			assert.Equal(t, tc.want, cfg.Parents[0].Compare)
		})
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			doc := "parents: [" + kind + "compare: " + tc.compare + "}]\nverifyOwner: true\n"
			cfg, err := Parse([]byte(doc))
			require.NoError(t, err, "a comparison's problem is its own")
			assert.True(t, cfg.VerifyOwner)
			p := cfg.Parents[0]
			assert.Equal(t, "status.tally.completing", p.Counts[Completing])
			_, err = Check([]byte(doc))
			if tc.wantErr == "" {
				assert.Equal(t, tc.want, p.Compare)
				assert.Empty(t, p.CompareErrs)
				require.ErrorContains(t, err, "customCounts[1]", "only the broken custom count")
				return
			}
			require.ErrorContains(t, cfg.CompareErrors(), tc.wantErr)
			assert.Empty(t, p.Compare)
			var invalid *InvalidError
			require.ErrorAs(t, err, &invalid)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

// TestFixedNamespaces: a namespaceSelector that lists namespaces by name,
// and selects by nothing else, is read as that list.
func TestFixedNamespaces(t *testing.T) {
	byName := func(op metav1.LabelSelectorOperator, names ...string) metav1.LabelSelectorRequirement {
		return metav1.LabelSelectorRequirement{Key: corev1.LabelMetadataName, Operator: op, Values: names}
	}
	tests := []struct {
		name string
		sel  *metav1.LabelSelector
		want []string
	}{
		{"none", nil, nil},
		{"names", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpIn, "b", "a", "b")}}, []string{"a", "b"}},
		{"an empty name left out", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpIn, "", "a")}}, []string{"a"}},
		{"no namespace's name", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpIn, "", "A")}}, nil},
		{"names excluded", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpNotIn, "a")}}, nil},
		{"names and labels", &metav1.LabelSelector{MatchLabels: map[string]string{"team": "x"}, MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpIn, "a")}}, nil},
		{"names and another requirement", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{byName(metav1.LabelSelectorOpIn, "a"), {Key: "team", Operator: metav1.LabelSelectorOpExists}}}, nil},
		{"another key", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "team", Operator: metav1.LabelSelectorOpIn, Values: []string{"a"}}}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := &Config{NamespaceSelector: tt.sel}
			assert.Equal(t, tt.want, cfg.FixedNamespaces())
		})
	}
}
