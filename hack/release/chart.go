package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// setValue sets the scalar at path (image.repository) in a block-style
// values.yaml to value, leaving every other line (comments among them) as
// it is.
func setValue(values []byte, path, value string) ([]byte, error) {
	lines := strings.SplitAfter(string(values), "\n")
	type key struct {
		indent int
		name   string
	}
	var stack []key // the keys of the line and of its ancestors
	for i, l := range lines {
		m := keyRE.FindStringSubmatchIndex(l)
		if m == nil {
			continue
		}
		k := key{indent: m[3] - m[2], name: l[m[4]:m[5]]}
		for len(stack) > 0 && stack[len(stack)-1].indent >= k.indent {
			stack = stack[:len(stack)-1]
		}
		stack = append(stack, k)
		names := make([]string, len(stack))
		for j, s := range stack {
			names[j] = s.name
		}
		if strings.Join(names, ".") != path {
			continue
		}
		if m[6] < 0 {
			return nil, fmt.Errorf("values.yaml: %s is not a scalar", path)
		}
		lines[i] = l[:m[6]] + value + l[m[7]:]
		return []byte(strings.Join(lines, "")), nil
	}
	return nil, fmt.Errorf("values.yaml: no %s", path)
}

// keyRE matches a mapping key's line in block-style YAML: its indent, its
// key and, when it has one on the line, its scalar value (before a comment).
var keyRE = regexp.MustCompile(`^(\s*)([A-Za-z0-9_]+):(?:[ \t]+([^#\s][^#\n]*?))?[ \t]*(?:#.*)?\r?\n?$`)

// stageChart copies the chart at src to dst with the values set (path →
// value): the release's image repository, its runbook URL.
func stageChart(src, dst string, set map[string]string) error {
	if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
		return fmt.Errorf("copying the chart: %w", err)
	}
	path := filepath.Join(dst, "values.yaml")
	values, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	for _, k := range slices.Sorted(maps.Keys(set)) {
		if values, err = setValue(values, k, set[k]); err != nil {
			return err
		}
	}
	return os.WriteFile(path, values, 0o644)
}

// stampChartArchive rewrites the chart archive helm package wrote so that
// every entry carries modified instead of the time of packaging (helm 3
// stamps each with time.Now()); entries, order, content and gzip header are
// kept, so the same chart gives the same bytes.
func stampChartArchive(path string, modified time.Time) error {
	in, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	zr, err := gzip.NewReader(bytes.NewReader(in))
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	zw.Header = gzip.Header{Comment: zr.Header.Comment, Extra: zr.Header.Extra, OS: zr.Header.OS}
	tr, tw := tar.NewReader(zr), tar.NewWriter(zw)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		h.ModTime, h.AccessTime, h.ChangeTime = modified, time.Time{}, time.Time{}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.Copy(tw, tr); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}
	return os.WriteFile(path, out.Bytes(), 0o644)
}
