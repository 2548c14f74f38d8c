package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"tally.dev/tally/internal/image"
)

// publisher pushes a release that build wrote.
type publisher struct {
	dist, registry, helm string
	plainHTTP            bool
	sign                 signer
}

func (p publisher) publish() error {
	data, err := os.ReadFile(filepath.Join(p.dist, recordFile))
	if err != nil {
		return fmt.Errorf("%w: run make release first", err)
	}
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return fmt.Errorf("%s: %w", recordFile, err)
	}
	if p.registry != "" && p.registry != rec.Registry {
		return fmt.Errorf("the release in %s was built for %s, not %s: its chart's default image is %s; run make release REGISTRY=%s", p.dist, rec.Registry, p.registry, rec.Image, p.registry)
	}

	var opts []name.Option
	if p.plainHTTP {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.NewTag(rec.Image, opts...)
	if err != nil {
		return err
	}
	a, err := image.OpenArchive(filepath.Join(p.dist, rec.ImageArchive))
	if err != nil {
		return err
	}
	defer a.Close()
	digest, err := a.Index.Digest()
	if err != nil {
		return err
	}
	if a.Ref != rec.Image || digest.String() != rec.ImageDigest {
		return fmt.Errorf("%s holds %s@%s, not %s@%s as %s says: run make release again", rec.ImageArchive, a.Ref, digest, rec.Image, rec.ImageDigest, recordFile)
	}
	fmt.Printf(">> pushing %s@%s\n", ref, digest)
	if err := remote.WriteIndex(ref, a.Index, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("pushing %s: %w", ref, err)
	}

	fmt.Printf(">> pushing the chart to %s\n", rec.Chart)
	args := []string{"push", filepath.Join(p.dist, rec.ChartArchive), chartRepository(rec.Registry)}
	if p.plainHTTP {
		args = append(args, "--plain-http")
	}
	if err := run(".", nil, p.helm, args...); err != nil {
		return err
	}
	chartRef, err := name.NewTag(strings.TrimPrefix(rec.Chart, "oci://")+":"+rec.Version, opts...)
	if err != nil {
		return err
	}
	chart, err := remote.Head(chartRef, remote.WithAuthFromKeychain(authn.DefaultKeychain))
	if err != nil {
		return fmt.Errorf("reading the pushed chart's digest: %w", err)
	}

	image := ref.Context().Digest(digest.String()).String()
	fmt.Printf(">> signing the image index and the chart %s\n", p.sign.describe())
	for _, r := range []string{image, chartRef.Context().Digest(chart.Digest.String()).String()} {
		if err := p.sign.signImage(r); err != nil {
			return err
		}
	}
	fmt.Println(">> attesting the provenance to the image index, each platform's SBOM to its image")
	if err := p.sign.attest(image, "slsaprovenance1", filepath.Join(p.dist, provenanceFile)); err != nil {
		return err
	}
	im, err := a.Index.IndexManifest()
	if err != nil {
		return err
	}
	for _, m := range im.Manifests {
		if m.Platform == nil {
			return fmt.Errorf("%s: the index's manifest %s names no platform", rec.ImageArchive, m.Digest)
		}
		sbom := filepath.Join(p.dist, fmt.Sprintf("tally-image_%s_%s_%s.spdx.json", rec.Version, m.Platform.OS, m.Platform.Architecture))
		if err := p.sign.attest(ref.Context().Digest(m.Digest.String()).String(), "spdxjson", sbom); err != nil {
			return err
		}
	}
	fmt.Printf("\npublished %s:\n  helm install tally %s --version %s -n tally-system --create-namespace\n  image %s\n  chart %s@%s\n",
		rec.Version, rec.Chart, rec.Version, image, chartRef.Context(), chart.Digest)
	return nil
}
