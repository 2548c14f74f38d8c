package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPublishRefusesWhatItCannotPush(t *testing.T) {
	const rec = `{"version":"0.1.0","registry":"registry.example/team","image":"registry.example/team/tally:0.1.0","imageDigest":"sha256:00","imageArchive":"tally-image_0.1.0.tar","chart":"oci://registry.example/team/charts/tally","chartArchive":"tally-0.1.0.tgz"}`
	tests := []struct {
		name, record, registry, err string
	}{
		{name: "no release", err: "run make release first"},
		{name: "bad record", record: "{", err: "release.json"},
		{name: "another registry", record: rec, registry: "other.example/team", err: "was built for registry.example/team, not other.example/team"},
		{name: "no image archive", record: rec, registry: "registry.example/team", err: "tally-image_0.1.0.tar"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dist := t.TempDir()
			if tt.record != "" {
				require.NoError(t, os.WriteFile(filepath.Join(dist, recordFile), []byte(tt.record), 0o644))
			}
			err := publisher{dist: dist, registry: tt.registry, helm: "false"}.publish()
			require.ErrorContains(t, err, tt.err)
		})
	}
}
