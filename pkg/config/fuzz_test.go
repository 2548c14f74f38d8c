package config

import (
	"errors"
	"testing"
)

// FuzzParse: no document makes Parse panic; Check accepts exactly what
// Parse accepts with no custom count in error; a custom count in error has
// no program and no field, and every other one compiles and has its field.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		"parents: [{version: v1, kind: A}]\n",
		"parents: [{group: example.tally.dev, version: v1, kind: A, counts: {active: status.active}, customCounts: [{name: ready, path: status.ready, expression: 'true'}]}]\n",
		"parents: [{version: v1, kind: A, customCounts: [{name: ready, path: status.ready, expression: 'pod.stauts.phase == \"x\"', name: up}, ready, {expression: [1]}]}]\n",
		"parents: [{version: v1, kind: A, customCounts: {name: ready}}, {version: v1, kind: B, customCounts: [{name: ready, path: status.completing, expression: 'true'}]}]\n",
		"parents:\n  - &p {version: v1, kind: A, customCounts: [{name: r, path: status.r, expression: 'true'}]}\n  - *p\nverifyOwner: yes\n",
		"parents: [{version: v1, kind: A, customCounts: [], customCounts: []}]\n",
		"namespaceSelector: {matchLabels: {team: '007'}}\nparents: [~, {version: v1, kind: A, customCounts: ~}]\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse(data)
		checked, checkErr := Check(data)
		if err != nil {
			if checkErr == nil {
				t.Fatalf("Check accepted what Parse refused (%v)", err)
			}
			return
		}
		if own := errors.Join(cfg.CustomCountErrors(), cfg.CompareErrors()); (own == nil) != (checkErr == nil) {
			t.Fatalf("Check: %v, with the custom counts' and comparisons' errors %v", checkErr, own)
		}
		if checked != nil && len(checked.Parents) != len(cfg.Parents) {
			t.Fatalf("Check and Parse read %d and %d parents", len(checked.Parents), len(cfg.Parents))
		}
		for _, p := range cfg.Parents {
			fields := map[int]bool{}
			for _, fl := range p.Fields() {
				if fl.Custom {
					fields[fl.Index] = true
				}
			}
			programs, errs := p.Programs()
			for i, c := range p.CustomCounts {
				if (c.Err == nil) != (programs[i] != nil) || (c.Err == nil) != fields[i] || (c.Err == nil) != (errs[i] == nil) {
					t.Fatalf("custom count %d (%q): Err %v, program %t, field %t, error %v", i, c.Name, c.Err, programs[i] != nil, fields[i], errs[i])
				}
			}
		}
	})
}
