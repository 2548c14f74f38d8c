package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// imageRepositoryRE matches the image's repository in the chart's
// values.yaml: the first `repository:` key indented under `image:`.
var imageRepositoryRE = regexp.MustCompile(`(?m)^(image:\s*\n(?:[ \t]+#.*\n)*[ \t]+repository:[ \t]*)(\S+)(.*)$`)

// setImageRepository points the chart's default image.repository at
// repository, leaving the rest of values.yaml (its comments among it) as it is.
func setImageRepository(values []byte, repository string) ([]byte, error) {
	loc := imageRepositoryRE.FindSubmatchIndex(values)
	if loc == nil {
		return nil, errors.New("charts/tally/values.yaml: no image.repository (the first key indented under image)")
	}
	var b bytes.Buffer
	b.Write(values[:loc[4]])
	b.WriteString(repository)
	b.Write(values[loc[5]:])
	return b.Bytes(), nil
}

// stageChart copies the chart at src to dst with its default image
// repository set to repository.
func stageChart(src, dst, repository string) error {
	if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
		return fmt.Errorf("copying the chart: %w", err)
	}
	path := filepath.Join(dst, "values.yaml")
	values, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	values, err = setImageRepository(values, repository)
	if err != nil {
		return err
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
