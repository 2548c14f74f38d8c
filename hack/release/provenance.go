package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// provenanceFile is the SLSA provenance predicate make release writes and
// make publish attests to the image index.
const provenanceFile = "provenance.json"

// provenance is a SLSA v1.0 provenance predicate
// (https://slsa.dev/spec/v1.0/provenance): how a release was built, from
// which commit, by which builder. cosign attest wraps it in an in-toto
// statement whose subject is the image index's digest; its byproducts are
// the release's other files with their digests.
type provenance struct {
	BuildDefinition buildDefinition `json:"buildDefinition"`
	RunDetails      runDetails      `json:"runDetails"`
}

type buildDefinition struct {
	BuildType            string             `json:"buildType"`
	ExternalParameters   externalParameters `json:"externalParameters"`
	InternalParameters   map[string]string  `json:"internalParameters"`
	ResolvedDependencies []descriptor       `json:"resolvedDependencies"`
}

// externalParameters are what the release's caller chose.
type externalParameters struct {
	Version     string `json:"version"`
	Registry    string `json:"registry"`
	ProjectURL  string `json:"projectURL"`
	DownloadURL string `json:"downloadURL"`
	RunbookURL  string `json:"runbookURL,omitempty"`
	// Snapshot: built without the tag and clean-tree checks.
	Snapshot bool `json:"snapshot"`
}

type runDetails struct {
	Builder    slsaBuilder  `json:"builder"`
	Metadata   metadata     `json:"metadata"`
	Byproducts []descriptor `json:"byproducts"`
}

type slsaBuilder struct {
	ID string `json:"id"`
}

type metadata struct {
	InvocationID string    `json:"invocationId,omitempty"`
	StartedOn    time.Time `json:"startedOn"`
	FinishedOn   time.Time `json:"finishedOn"`
}

// descriptor is SLSA's ResourceDescriptor, as much of it as a release uses.
type descriptor struct {
	URI    string            `json:"uri,omitempty"`
	Name   string            `json:"name,omitempty"`
	Digest map[string]string `json:"digest"`
}

// sha256File returns the hex SHA-256 of a file.
func sha256File(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// releaseFiles lists, sorted, every file a release publishes, all in dist
// itself (a GitHub release's files have no folders): dist's files but
// goreleaser's own and the checksums and their signature.
func releaseFiles(dist string) ([]string, error) {
	entries, err := os.ReadDir(dist)
	if err != nil {
		return nil, err
	}
	var files []string
	for _, e := range entries {
		if e.IsDir() || slices.Contains(goreleaserFiles, e.Name()) || e.Name() == checksumsFile || e.Name() == checksumsBundle {
			continue
		}
		files = append(files, e.Name())
	}
	slices.Sort(files)
	return files, nil
}

// checksumsFile lists the SHA-256 of every file of a release, in the
// format sha256sum --check reads; checksumsBundle is its signature.
const (
	checksumsFile   = "checksums.txt"
	checksumsBundle = checksumsFile + ".sigstore.json"
)

// writeChecksums writes checksums.txt over files (relative to dist).
func writeChecksums(dist string, files []string) error {
	var b strings.Builder
	for _, f := range files {
		sum, err := sha256File(filepath.Join(dist, f))
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s  %s\n", sum, f)
	}
	return os.WriteFile(filepath.Join(dist, checksumsFile), []byte(b.String()), 0o644)
}

// byproducts describes files (relative to dist) with their digests.
func byproducts(dist string, files []string) ([]descriptor, error) {
	var ds []descriptor
	for _, f := range files {
		sum, err := sha256File(filepath.Join(dist, f))
		if err != nil {
			return nil, err
		}
		ds = append(ds, descriptor{Name: f, Digest: map[string]string{"sha256": sum}})
	}
	return ds, nil
}
