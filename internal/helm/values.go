package helm

import (
	"maps"
	"os"
	"path/filepath"
	"slices"

	"sigs.k8s.io/yaml"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
)

// WorkerPool is the example WorkerPool as a parent kind, with each of
// counts mapped to status.<count>; when a total is among them, the ledger
// they need is status.tallyLedger.
func WorkerPool(counts ...config.Count) config.Parent {
	p := config.Parent{Group: operator.GVK.Group, Version: operator.GVK.Version, Kind: operator.GVK.Kind, Resource: "workerpools", Counts: map[config.Count]string{}}
	for _, c := range counts {
		p.Counts[c] = "status." + string(c)
		if slices.Contains(config.Totals, c) {
			p.Ledger = "status.tallyLedger"
		}
	}
	return p
}

// Values returns, as YAML, the chart values that track parents, with
// certificates issued by Helm (no cert-manager needed), and each of more (in
// the chart's values layout) merged over them in turn.
func Values(parents []config.Parent, more ...map[string]any) ([]byte, error) {
	v := map[string]any{"parents": parents, "certificates": map[string]any{"mode": "helm"}}
	for _, m := range more {
		merge(v, m)
	}
	return yaml.Marshal(v)
}

// WriteValues writes Values to dir/values.yaml and returns its path.
func WriteValues(dir string, parents []config.Parent, more ...map[string]any) (string, error) {
	data, err := Values(parents, more...)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "values.yaml")
	return path, os.WriteFile(path, data, 0o600)
}

// merge sets into dst every value of src, merging nested maps.
func merge(dst, src map[string]any) {
	for k, v := range src {
		d, dok := dst[k].(map[string]any)
		s, sok := v.(map[string]any)
		if dok && sok {
			d = maps.Clone(d)
			merge(d, s)
			dst[k] = d
			continue
		}
		dst[k] = v
	}
}

// LocalCertificates are values for a webhook that runs outside the cluster
// and is reached at 127.0.0.1: the Helm-issued certificate names that
// address.
var LocalCertificates = map[string]any{"certificates": map[string]any{"helm": map[string]any{"ipAddresses": []string{"127.0.0.1"}}}}
