package config

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
	p := Parent{Counts: map[Count]string{Unexpected: "status.u", Completing: "status.c.n", Active: "status.a"}}
	assert.Equal(t, []Field{
		{Count: Completing, Path: []string{"status", "c", "n"}},
		{Count: Active, Path: []string{"status", "a"}},
		{Count: Unexpected, Path: []string{"status", "u"}},
	}, p.Fields())
}
