package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"tally.dev/tally/internal/image"
)

// publisher pushes a release that build wrote.
type publisher struct {
	dist, registry, helm string
	plainHTTP            bool
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
	fmt.Printf("\npublished %s:\n  helm install tally %s --version %s -n tally-system --create-namespace\n  image %s@%s\n",
		rec.Version, rec.Chart, rec.Version, rec.Image, rec.ImageDigest)
	return nil
}
