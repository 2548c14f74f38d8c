package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"

	"tally.dev/tally/internal/image"
	"tally.dev/tally/internal/repo"
)

// registry is where the repo list sends the suite for the images built
// here.
const registry = "tally.local"

// repoList is the KUBE_TEST_REPO_LIST file: the suite's own images (agnhost,
// busybox) and pause under tally.local; every other registry stays as the
// suite has it, and the tests that need its images cannot pull them.
const repoList = `promoterE2eRegistry: ` + registry + `/e2e-test-images
gcRegistry: ` + registry + `
`

// built is an image the suite uses that images builds, under every version
// the suite names (agnhost 2.55 and 2.66.1 are both this release's agnhost:
// the tests that name both need two references to roll from one to the
// other), by its name under the suite's registry (repository without the
// registry).
type built struct {
	repository string
	build      func(b *imageBuild, ref string) error
}

// imageBuild holds what the images are made of.
type imageBuild struct {
	agnhost, busybox, curl, pause, out string
	// agnhostSource is agnhost's directory in the Kubernetes module, for
	// the files its Dockerfile adds.
	agnhostSource string
	// applets are the busybox applets, as paths relative to the root
	// (bin/sh, usr/bin/wc, ...).
	applets []string
	created time.Time
}

func buildImages(e2e, agnhost, busybox, curl, pause, out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	listFile := filepath.Join(out, "repo-list.yaml")
	if err := os.WriteFile(listFile, []byte(repoList), 0o644); err != nil {
		return err
	}
	cmd := exec.Command(e2e, "--list-images")
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+listFile)
	listed, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("%s --list-images: %w", e2e, err)
	}
	applets, err := exec.Command(busybox, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("%s --list-full: %w", busybox, err)
	}
	_, created, err := repo.LastCommit(repo.Root())
	if err != nil {
		return err
	}
	src, err := agnhostSource()
	if err != nil {
		return err
	}
	b := &imageBuild{agnhost: agnhost, agnhostSource: src, curl: curl, busybox: busybox, pause: pause, out: out, applets: strings.Fields(string(applets)), created: created}
	wanted := []built{
		{repository: "e2e-test-images/agnhost", build: (*imageBuild).agnhostImage},
		{repository: "e2e-test-images/busybox", build: (*imageBuild).busyboxImage},
		{repository: "pause", build: (*imageBuild).pauseImage},
	}
	for _, w := range wanted {
		refs, err := pick(string(listed), w)
		if err != nil {
			return err
		}
		for _, ref := range refs {
			if err := w.build(b, ref); err != nil {
				return fmt.Errorf("%s: %w", ref, err)
			}
		}
	}
	return nil
}

// pick finds the suite's references for w among the images e2e.test lists.
func pick(listed string, w built) ([]string, error) {
	var refs []string
	for _, ref := range strings.Fields(listed) {
		rest, ok := strings.CutPrefix(ref, registry+"/")
		repository, _, tagged := strings.Cut(rest, ":")
		if ok && tagged && repository == w.repository {
			refs = append(refs, ref)
		}
	}
	if len(refs) == 0 {
		return nil, fmt.Errorf("e2e.test --list-images names no image %s/%s", registry, w.repository)
	}
	return refs, nil
}

// agnhostSource finds agnhost's source in the Kubernetes module that
// hack/envtest builds from.
func agnhostSource() (string, error) {
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes")
	cmd.Dir = repo.Path("hack", "envtest")
	dir, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("finding k8s.io/kubernetes: %w", err)
	}
	return filepath.Join(strings.TrimSpace(string(dir)), "test", "images", "agnhost"), nil
}

// busyboxFiles are busybox at /bin/busybox with its applets linked to it,
// and the directories they sit in.
func (b *imageBuild) busyboxFiles() ([]image.File, error) {
	data, err := os.ReadFile(b.busybox)
	if err != nil {
		return nil, err
	}
	files := []image.File{
		{Name: "bin/busybox", Mode: 0o755, Data: data},
		{Name: "tmp", Mode: 0o1777, Dir: true},
		{Name: "root", Mode: 0o700, Dir: true},
	}
	dirs := map[string]bool{"tmp": true, "root": true}
	for _, a := range b.applets {
		a = strings.TrimPrefix(a, "/")
		for d := filepath.Dir(a); d != "."; d = filepath.Dir(d) {
			if !dirs[d] {
				dirs[d] = true
				files = append(files, image.File{Name: d, Mode: 0o755, Dir: true})
			}
		}
		if a != "bin/busybox" {
			files = append(files, image.File{Name: a, Mode: 0o777, Link: "/bin/busybox"})
		}
	}
	return files, nil
}

// etc is /etc with the passwd and group files of users.
func etc(passwd, group string) []image.File {
	return []image.File{
		{Name: "etc", Mode: 0o755, Dir: true},
		{Name: "etc/passwd", Mode: 0o644, Data: []byte(passwd)},
		{Name: "etc/group", Mode: 0o644, Data: []byte(group)},
	}
}

// path is the environment of the images with a shell.
var path = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// agnhostImage is the suite's agnhost: /agnhost (also as /agnhost-2, for
// the entrypoint tests), busybox for the shell commands tests run in it and
// curl (hack/conformance/curl: the lifecycle hook tests run `curl URL`),
// the user and group the supplemental-groups test expects, /uploads, and
// porter's certificate and key at the root, as agnhost's Dockerfile has
// them (the StatefulSet tests' readiness probe reads /localhost.crt).
func (b *imageBuild) agnhostImage(ref string) error {
	files, err := b.busyboxFiles()
	if err != nil {
		return err
	}
	files = append(files, etc(
		"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/sbin/nologin\nuser-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n",
		"root:x:0:root\nuser-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\nnobody:x:65534:\n")...)
	curl, err := os.ReadFile(b.curl)
	if err != nil {
		return err
	}
	files = append(files, image.File{Name: "usr/bin/curl", Mode: 0o755, Data: curl})
	for _, f := range []string{"localhost.crt", "localhost.key"} {
		data, err := os.ReadFile(filepath.Join(b.agnhostSource, "porter", f))
		if err != nil {
			return err
		}
		files = append(files, image.File{Name: f, Mode: 0o644, Data: data})
	}
	files = append(files,
		image.File{Name: "agnhost-2", Mode: 0o777, Link: "agnhost"},
		image.File{Name: "uploads", Mode: 0o755, Dir: true},
		image.File{Name: "home", Mode: 0o755, Dir: true},
		image.File{Name: "home/user-defined-in-image", Mode: 0o755, Dir: true},
	)
	return b.write(ref, image.Options{Entrypoint: []string{"/agnhost"}, Cmd: []string{"pause"}, User: "0", Env: path},
		map[string]string{"agnhost": b.agnhost}, files)
}

// busyboxImage is busybox alone.
func (b *imageBuild) busyboxImage(ref string) error {
	files, err := b.busyboxFiles()
	if err != nil {
		return err
	}
	files = append(files, etc("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", "root:x:0:\nnobody:x:65534:\n")...)
	return b.write(ref, image.Options{Cmd: []string{"sh"}, User: "0", Env: path}, nil, files)
}

// pauseImage is the cluster's pause binary under the suite's name.
func (b *imageBuild) pauseImage(ref string) error {
	return b.write(ref, image.Options{Entrypoint: []string{"/pause"}}, map[string]string{"pause": b.pause}, nil)
}

// write writes the image archive of one platform, the host's, to
// out/<last path element of the repository>-<tag>.tar.
func (b *imageBuild) write(ref string, opts image.Options, binaries map[string]string, files []image.File) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	opts.Created = b.created
	opts.Labels = map[string]string{"org.opencontainers.image.title": tag.RepositoryStr()}
	opts.Platforms = []image.Platform{{OS: "linux", Architecture: runtime.GOARCH, Binaries: binaries, Files: files}}
	idx, err := image.Index(opts)
	if err != nil {
		return err
	}
	file := filepath.Join(b.out, filepath.Base(tag.RepositoryStr())+"-"+tag.TagStr()+".tar")
	if err := image.WriteArchive(idx, tag, runtime.GOARCH, b.created, file); err != nil {
		return err
	}
	fmt.Printf("wrote %s: %s\n", file, ref)
	return nil
}
