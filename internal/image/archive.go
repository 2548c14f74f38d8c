package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// Archive is an image archive written by WriteArchive, unpacked to read.
type Archive struct {
	// Index is the image index the archive holds.
	Index v1.ImageIndex
	// Ref is the reference the archive names it by (repository:tag).
	Ref string
	dir string
}

// OpenArchive unpacks the archive at path into a temporary directory and
// reads its image index; Close removes the directory.
func OpenArchive(path string) (*Archive, error) {
	dir, err := os.MkdirTemp("", "tally-image-read-")
	if err != nil {
		return nil, err
	}
	a, err := openArchive(path, dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("reading image archive %s: %w", path, err)
	}
	return a, nil
}

func openArchive(path, dir string) (*Archive, error) {
	if err := untar(path, dir); err != nil {
		return nil, err
	}
	lp, err := layout.FromPath(dir)
	if err != nil {
		return nil, err
	}
	top, err := lp.ImageIndex()
	if err != nil {
		return nil, err
	}
	im, err := top.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(im.Manifests) != 1 || !im.Manifests[0].MediaType.IsIndex() {
		return nil, errors.New("index.json must name exactly one image index")
	}
	d := im.Manifests[0]
	idx, err := top.ImageIndex(d.Digest)
	if err != nil {
		return nil, err
	}
	ref := d.Annotations["io.containerd.image.name"]
	if ref == "" {
		return nil, errors.New("index.json names no image (io.containerd.image.name)")
	}
	return &Archive{Index: idx, Ref: ref, dir: dir}, nil
}

// Close removes the unpacked archive.
func (a *Archive) Close() error { return os.RemoveAll(a.dir) }

// untar extracts the regular files of the tar at path below dir.
func untar(path, dir string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		name := filepath.FromSlash(h.Name)
		if !filepath.IsLocal(name) || strings.HasPrefix(name, "..") {
			return fmt.Errorf("entry %q leaves the archive", h.Name)
		}
		out := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
			return err
		}
		w, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		_, err = io.Copy(w, tr)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
}
