//go:build linux

package controlplane

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// kube-apiserver and etcd outlive the process that starts them unless it
// stops them: envtest puts each in a process group of its own, so a
// SIGKILL, a panic or a lost terminal of that process leaves them running
// (a kube-apiserver holds gigabytes and a core). So each is started through
// a symbolic link to this process's own executable, named for the binary:
// init, run first in the new process, asks the kernel to SIGKILL it when
// the process that started it dies (PR_SET_PDEATHSIG), then executes the
// binary in its place, which keeps that request. (The kernel sends it when
// the thread that started the process ends; Go ends a thread only when a
// goroutine that locked it to itself ends locked, as test/cluster's
// dialFrom does: a program that starts a control plane must not do so.)
const (
	// realAssetsEnv is the folder of the binaries to execute.
	realAssetsEnv = "TALLY_CONTROLPLANE_ASSETS"
	// parentEnv is the PID of the process that starts them.
	parentEnv = "TALLY_CONTROLPLANE_PARENT"
)

// supervised are the binaries started through the links.
var supervised = []string{"kube-apiserver", "etcd"}

func init() {
	dir, name := os.Getenv(realAssetsEnv), filepath.Base(os.Args[0])
	if dir == "" || !slices.Contains(supervised, name) {
		return
	}
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
		fmt.Fprintf(os.Stderr, "%s: asking for the parent-death signal: %v\n", name, err)
		os.Exit(1)
	}
	// The parent may have died before the request: nothing would come.
	if parent := os.Getenv(parentEnv); strconv.Itoa(os.Getppid()) != parent {
		fmt.Fprintf(os.Stderr, "%s: started by process %d, not %q, which started the control plane: not starting\n", name, os.Getppid(), parent)
		os.Exit(1)
	}
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, realAssetsEnv+"=") || strings.HasPrefix(kv, parentEnv+"=")
	})
	target := filepath.Join(dir, name)
	err := unix.Exec(target, append([]string{target}, os.Args[1:]...), env)
	fmt.Fprintf(os.Stderr, "%s: executing %s: %v\n", name, target, err)
	os.Exit(1)
}

// supervise returns the paths to start kube-apiserver and etcd from, links
// in dir to this process's executable (see init), and sets what those
// processes read to find the binaries in assets.
func supervise(dir, assets string) (apiserver, etcd string, err error) {
	self, err := os.Executable()
	if err != nil {
		return "", "", fmt.Errorf("finding this process's executable: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", "", err
	}
	paths := map[string]string{}
	for _, name := range supervised {
		p := filepath.Join(dir, name)
		if err := os.Symlink(self, p); err != nil {
			return "", "", fmt.Errorf("linking %s to this process's executable: %w", name, err)
		}
		paths[name] = p
	}
	// Inherited by every child; only a process started through a link,
	// whose first argument names it, acts on them.
	if err := os.Setenv(realAssetsEnv, assets); err != nil {
		return "", "", err
	}
	if err := os.Setenv(parentEnv, strconv.Itoa(os.Getpid())); err != nil {
		return "", "", err
	}
	return paths["kube-apiserver"], paths["etcd"], nil
}
