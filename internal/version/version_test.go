package version

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestCheckKubernetes(t *testing.T) {
	tests := []struct {
		gitVersion string
		err        string
	}{
		{gitVersion: "v1.31.0"},
		{gitVersion: "v1.31.14"},
		{gitVersion: "v1.37.2"},
		{gitVersion: "v1.33.5-eks-1234567"},
		{gitVersion: "v2.0.0"},
		{gitVersion: "v1.30.14", err: "the API server is Kubernetes v1.30.14, older than 1.31"},
		{gitVersion: "v1.29.3-gke.100", err: "older than 1.31"},
		{gitVersion: "", err: `the API server's version "" cannot be read`},
		{gitVersion: "main", err: `the API server's version "main" cannot be read`},
	}
	for _, tt := range tests {
		t.Run(tt.gitVersion, func(t *testing.T) {
			err := CheckKubernetes(tt.gitVersion)
			if tt.err == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorContains(t, err, tt.err)
		})
	}
}
