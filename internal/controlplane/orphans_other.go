//go:build !linux

package controlplane

import "path/filepath"

// supervise returns the binaries in assets: only Linux has a parent-death
// signal, so elsewhere kube-apiserver and etcd stop only when Stop stops
// them.
func supervise(_, assets string) (apiserver, etcd string, err error) {
	return filepath.Join(assets, "kube-apiserver"), filepath.Join(assets, "etcd"), nil
}
