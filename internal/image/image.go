// Package image assembles tally's container image without a container
// engine: one layer per platform holding the statically linked binaries, an
// OCI image per platform, one OCI index over them, written as an OCI image
// layout archive (which `docker load` and `kind load image-archive` read) or
// pushed to a registry. The same binaries and options give the same digest.
package image

import (
	"archive/tar"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// User is the numeric user and group the image runs as.
const User = "65532:65532"

// Platform is the binaries of one platform: file name in the image root →
// path on disk; and any other files, directories and links its layer holds.
type Platform struct {
	OS, Architecture string
	Binaries         map[string]string
	Files            []File
}

// File is an entry of a layer other than a binary: a directory (Dir), a
// symbolic link (Link) or a regular file (Data), at Name, a path relative
// to the image root.
type File struct {
	Name string
	Mode int64
	Dir  bool
	Link string
	Data []byte
}

// Options describe the image.
type Options struct {
	Platforms []Platform
	// Created stamps the image config and every file in the layers.
	Created time.Time
	// Labels are the image config's labels (org.opencontainers.image.*).
	Labels map[string]string
	// Entrypoint is the image's entrypoint; tally's image has none (it
	// holds several commands; the chart names one).
	Entrypoint []string
	// Cmd is the image's default arguments.
	Cmd []string
	// User is the user the image runs as (default User).
	User string
	// Env is the image's environment (default PATH=/).
	Env []string
}

// Index builds the OCI index of one image per platform.
func Index(opts Options) (v1.ImageIndex, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range opts.Platforms {
		img, err := platformImage(p, opts)
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", p.OS, p.Architecture, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: p.OS, Architecture: p.Architecture}},
		})
	}
	return idx, nil
}

func platformImage(p Platform, opts Options) (v1.Image, error) {
	layerTar, err := layerTar(p, opts.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.OCIManifestSchema1), layer)
	if err != nil {
		return nil, err
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = p.OS, p.Architecture
	cfg.Created = v1.Time{Time: opts.Created}
	cfg.Config.User = cmp.Or(opts.User, User)
	cfg.Config.Labels = opts.Labels
	cfg.Config.Env = opts.Env
	if cfg.Config.Env == nil {
		cfg.Config.Env = []string{"PATH=/"}
	}
	cfg.Config.Entrypoint = opts.Entrypoint
	cfg.Config.Cmd = opts.Cmd
	cfg.History = []v1.History{{Created: v1.Time{Time: opts.Created}, CreatedBy: "tally make image", Comment: "statically linked binaries"}}
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return nil, err
	}
	return mutate.CreatedAt(img, v1.Time{Time: opts.Created})
}

// layerTar returns a tar of p's binaries, in the image root, executable by
// all, and of its other files, in name order, owned by root, stamped with
// created.
func layerTar(p Platform, created time.Time) ([]byte, error) {
	entries := slices.Clone(p.Files)
	for n, path := range p.Binaries {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		entries = append(entries, File{Name: n, Mode: 0o755, Data: data})
	}
	slices.SortFunc(entries, func(a, b File) int { return strings.Compare(a.Name, b.Name) })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i, e := range entries {
		if i > 0 && entries[i-1].Name == e.Name {
			return nil, fmt.Errorf("%s is in the layer twice", e.Name)
		}
		hdr := &tar.Header{Name: e.Name, Mode: e.Mode, ModTime: created, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
		switch {
		case e.Dir:
			hdr.Name, hdr.Typeflag = e.Name+"/", tar.TypeDir
		case e.Link != "":
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, e.Link
		default:
			hdr.Size = int64(len(e.Data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.Data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// WriteArchive writes idx as an OCI image layout in a tar file at path,
// naming it ref in index.json; it also writes the manifest.json of the
// legacy `docker load` format, for the platform hostArch of linux, so that
// Docker engines that do not read OCI layouts load it too. The tar's
// entries are sorted and stamped with created: the same index gives the
// same file.
func WriteArchive(idx v1.ImageIndex, ref name.Tag, hostArch string, created time.Time, path string) error {
	dir, err := os.MkdirTemp("", "tally-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := lp.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": ref.TagStr(),
		"io.containerd.image.name":          ref.Name(),
	})); err != nil {
		return err
	}
	legacy, err := legacyManifest(idx, ref, hostArch)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), legacy, 0o644); err != nil {
		return err
	}
	return tarDir(dir, path, created)
}

// legacyManifest is the manifest.json of `docker load`'s own format for the
// linux/arch image of idx, pointing into the layout's blobs.
func legacyManifest(idx v1.ImageIndex, ref name.Tag, arch string) ([]byte, error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	for _, d := range im.Manifests {
		if d.Platform == nil || d.Platform.OS != "linux" || d.Platform.Architecture != arch {
			continue
		}
		img, err := idx.Image(d.Digest)
		if err != nil {
			return nil, err
		}
		cfg, err := img.ConfigName()
		if err != nil {
			return nil, err
		}
		layers, err := img.Layers()
		if err != nil {
			return nil, err
		}
		entry := struct {
			Config   string
			RepoTags []string
			Layers   []string
		}{Config: blobPath(cfg), RepoTags: []string{ref.Name()}}
		for _, l := range layers {
			digest, err := l.Digest()
			if err != nil {
				return nil, err
			}
			entry.Layers = append(entry.Layers, blobPath(digest))
		}
		return json.Marshal([]any{entry})
	}
	return nil, fmt.Errorf("the index has no linux/%s image", arch)
}

func blobPath(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }

// tarDir writes the files below dir into a tar at path, sorted, stamped
// with created, owned by root.
func tarDir(dir, path string, created time.Time) error {
	var files []string
	if err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, p)
		}
		return err
	}); err != nil {
		return err
	}
	slices.Sort(files)
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(out)
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			out.Close()
			return err
		}
		rel := strings.TrimPrefix(filepath.ToSlash(strings.TrimPrefix(f, dir)), "/")
		if err := tw.WriteHeader(&tar.Header{Name: rel, Mode: 0o644, Size: int64(len(data)), ModTime: created, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
			out.Close()
			return err
		}
		if _, err := tw.Write(data); err != nil {
			out.Close()
			return err
		}
	}
	if err := tw.Close(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
