package notices

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/repo"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		name, text string
		want       []string
	}{
		{name: "Apache-2.0", text: "Apache License\n  Version 2.0, January 2004\n http://www.apache.org/licenses/", want: []string{"Apache-2.0"}},
		{name: "MIT", text: "Permission is hereby granted, free of charge, to any person obtaining a copy\nof this software", want: []string{"MIT"}},
		{name: "BSD-3-Clause", text: "Redistribution and use in source and binary forms, with or without\nmodification ... Neither the name of Google Inc. nor the names of its\ncontributors may be used to endorse or promote products derived from this software", want: []string{"BSD-3-Clause"}},
		{name: "BSD-2-Clause", text: "Redistribution and use in source and binary forms, with or without modification, are permitted", want: []string{"BSD-2-Clause"}},
		{name: "ISC", text: "Permission to use, copy, modify, and/or distribute this software for any\npurpose with or without fee is hereby granted", want: []string{"ISC"}},
		{name: "MPL-2.0", text: "Mozilla Public License Version 2.0\n==================================\n1.12. \"Secondary License\" means either the GNU General Public License, Version 2.0, the GNU Lesser General Public License, Version 2.1, the GNU Affero General Public License, Version 3.0, or any later versions of those licenses.", want: []string{"MPL-2.0"}},
		{name: "two in one file", text: "Apache License Version 2.0 ... and the MIT part: Permission is hereby granted, free of charge, to any person obtaining a copy", want: []string{"Apache-2.0", "MIT"}},
		{name: "BSD-3-Clause, endorsement in other words", text: "Redistribution and use in source and binary forms ... The names of its contributors may not be used to endorse or promote products derived from this software", want: []string{"BSD-3-Clause"}},
		{name: "BSD-4-Clause", text: "Redistribution and use in source and binary forms ... All advertising materials mentioning features or use of this software must display ... may be used to endorse or promote products derived from this software", want: []string{"BSD-4-Clause"}},
		{name: "JSON", text: "Permission is hereby granted, free of charge, to any person obtaining a copy ... The Software shall be used for Good, not Evil.", want: []string{"MIT", "JSON"}},
		{name: "Apache-2.0 with the Commons Clause", text: "\"Commons Clause\" License Condition v1.0 ... Apache License Version 2.0", want: []string{"Apache-2.0", "Commons-Clause"}},
		{name: "GPL", text: "GNU GENERAL PUBLIC LICENSE Version 3, 29 June 2007", want: []string{"GPL"}},
		{name: "GPL quoting an MIT part", text: "GNU General Public License ... Permission is hereby granted, free of charge, to any person obtaining a copy", want: []string{"MIT", "GPL"}},
		{name: "Apache-2.0 or the Elastic License", text: "Apache License Version 2.0, or the Elastic License 2.0, at your choice", want: []string{"Apache-2.0", "Elastic"}},
		{name: "MIT and a noncommercial Creative Commons licence", text: "Permission is hereby granted, free of charge, to any person obtaining a copy ... Creative Commons Attribution-NonCommercial 4.0", want: []string{"MIT", "CC-NC/SA", "NonCommercial"}},
		{name: "nothing", text: "All rights reserved."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, Classify([]byte(tt.text)))
		})
	}
}

func TestNoticeFileNames(t *testing.T) {
	for name, want := range map[string]bool{
		"LICENSE": true, "LICENSE.txt": true, "LICENCE": true, "license.md": true, "LICENSE-MIT": true, "LICENSE.libyaml": true,
		"COPYING": true, "NOTICE": true, "NOTICE.txt": true,
		"license.go": false, "license_test.go": false, "licenses.json": false, "README": false, "LICENSES": false, "notice.yaml": false,
	} {
		assert.Equal(t, want, noticeFile.MatchString(name) && !sourceFile.MatchString(name), name)
	}
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name string
		mod  Module
		err  string
	}{
		{name: "allowed", mod: Module{Path: "a", Files: []string{"LICENSE", "NOTICE"}, Licenses: []string{"Apache-2.0"}}},
		{name: "a NOTICE alone", mod: Module{Path: "a", Version: "v1", Files: []string{"NOTICE"}}, err: "module a v1 has no licence file"},
		{name: "no file", mod: Module{Path: "a", Version: "v1"}, err: "module a v1 has no licence file"},
		{name: "unknown", mod: Module{Path: "a", Version: "v1", Files: []string{"COPYING"}, Unknown: []string{"COPYING"}}, err: "module a v1: its licence files COPYING match no licence tally knows"},
		{name: "one known, one unknown", mod: Module{Path: "a", Version: "v1", Files: []string{"COPYING", "LICENSE"}, Licenses: []string{"MIT"}, Unknown: []string{"COPYING"}}, err: "its licence files COPYING match no licence"},
		{name: "not allowed", mod: Module{Path: "a", Version: "v1", Files: []string{"LICENSE"}, Licenses: []string{"GPL", "MIT"}}, err: "module a v1 is licensed GPL, not one of"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Check([]Module{tt.mod})
			if tt.err == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorContains(t, err, tt.err)
		})
	}
}

// TestBundledModules: every module tally's commands link, on every
// platform a release builds, carries a licence file tally may ship, and
// Files ships each module's licence and NOTICE files (Prometheus' client
// among the modules with a NOTICE).
func TestBundledModules(t *testing.T) {
	mods, err := Bundled(context.Background(), repo.Root(), Platforms, Commands)
	require.NoError(t, err)
	require.NoError(t, Check(mods))
	paths := make([]string, 0, len(mods))
	for _, m := range mods {
		paths = append(paths, m.Path)
	}
	for _, p := range []string{"std", "k8s.io/client-go", "sigs.k8s.io/controller-runtime", "github.com/prometheus/client_golang", "github.com/google/cel-go"} {
		assert.Contains(t, paths, p)
	}
	files, err := Files(mods)
	require.NoError(t, err)
	names := map[string][]byte{}
	for _, f := range files {
		names[f.Name] = f.Data
	}
	for _, m := range mods {
		for _, name := range m.Files {
			data, ok := names[Dir+"/"+m.Path+"/"+name]
			if assert.True(t, ok, "%s/%s is not shipped", m.Path, name) {
				want, err := os.ReadFile(filepath.Join(m.Dir, filepath.FromSlash(name)))
				require.NoError(t, err)
				assert.Equal(t, want, data)
			}
		}
	}
	assert.Contains(t, names, Dir+"/github.com/prometheus/client_golang/NOTICE")
	// The licence of a package forked into a module, beside it.
	assert.Contains(t, names, Dir+"/k8s.io/kube-openapi/pkg/internal/third_party/govalidator/LICENSE")
	index := string(names[Dir+"/README"])
	for _, m := range mods {
		assert.Contains(t, index, m.Path+" "+m.Version+" ", "the index lists every module")
	}
	assert.True(t, slices.IsSortedFunc(mods, func(a, b Module) int { return strings.Compare(a.Path, b.Path) }))
}

// TestPlatformsAreTheReleases: Platforms are those .goreleaser.yaml builds
// kubectl-tally for, so that the archives carry the licences of what each
// platform links.
func TestPlatformsAreTheReleases(t *testing.T) {
	data, err := os.ReadFile(repo.Path(".goreleaser.yaml"))
	require.NoError(t, err)
	var cfg struct {
		Builds []struct {
			ID     string
			Goos   []string
			Goarch []string
			Ignore []struct{ Goos, Goarch string }
		}
	}
	require.NoError(t, yaml.Unmarshal(data, &cfg))
	var built []string
	for _, b := range cfg.Builds {
		if b.ID != "kubectl-tally" {
			continue
		}
		for _, goos := range b.Goos {
			for _, goarch := range b.Goarch {
				if !slices.ContainsFunc(b.Ignore, func(i struct{ Goos, Goarch string }) bool { return i.Goos == goos && i.Goarch == goarch }) {
					built = append(built, goos+"/"+goarch)
				}
			}
		}
	}
	assert.ElementsMatch(t, built, Platforms)
}
