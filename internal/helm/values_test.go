package helm

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/pkg/config"
)

func TestValues(t *testing.T) {
	for name, tc := range map[string]struct {
		parents []config.Parent
		more    []map[string]any
		want    string
	}{
		"counts only": {
			parents: []config.Parent{WorkerPool(config.Completing)},
			want: `certificates: {mode: helm}
parents:
- {group: example.tally.dev, version: v1, kind: WorkerPool, resource: workerpools, counts: {completing: status.completing}}
`,
		},
		"a total brings the ledger": {
			parents: []config.Parent{WorkerPool(config.Active, config.CompletedTotal)},
			want: `certificates: {mode: helm}
parents:
- {group: example.tally.dev, version: v1, kind: WorkerPool, resource: workerpools, counts: {active: status.active, completedTotal: status.completedTotal}, ledger: status.tallyLedger}
`,
		},
		"nested maps merge, later values win": {
			parents: []config.Parent{WorkerPool(config.Completing)},
			more:    []map[string]any{LocalCertificates, {"logLevel": "info"}, {"logLevel": "debug", "webhook": map[string]any{"replicas": 1}}},
			want: `certificates: {mode: helm, helm: {ipAddresses: ["127.0.0.1"]}}
logLevel: debug
parents:
- {group: example.tally.dev, version: v1, kind: WorkerPool, resource: workerpools, counts: {completing: status.completing}}
webhook: {replicas: 1}
`,
		},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := Values(tc.parents, tc.more...)
			require.NoError(t, err)
			var gotV, wantV map[string]any
			require.NoError(t, yaml.Unmarshal(got, &gotV))
			require.NoError(t, yaml.Unmarshal([]byte(tc.want), &wantV))
			assert.Equal(t, wantV, gotV, "values:\n%s", got)
		})
	}
}

func TestValuesLeaveTheirInputsAlone(t *testing.T) {
	before, err := yaml.Marshal(LocalCertificates)
	require.NoError(t, err)
	_, err = Values(nil, LocalCertificates, map[string]any{"certificates": map[string]any{"helm": map[string]any{"duration": "1h"}}})
	require.NoError(t, err)
	after, err := yaml.Marshal(LocalCertificates)
	require.NoError(t, err)
	assert.Equal(t, string(before), string(after))
}
