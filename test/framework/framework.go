// Package framework is what tally's integration suites share on top of
// internal/controlplane: one control plane per test package (Main), tally's
// binaries built and run as processes, webhook registration against the
// test process, and the fault injectors (a cutting proxy, a conflict log).
package framework

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/repo"
)

// Env is a running control plane with what the suites ask of it.
type Env struct {
	*controlplane.Env
}

// Start starts a control plane (controlplane.Start).
func Start(opts controlplane.Options) (*Env, error) {
	env, err := controlplane.Start(opts)
	if err != nil {
		return nil, err
	}
	return &Env{Env: env}, nil
}

// CertManagerVersion is the cert-manager whose CRDs the chart tests
// install; the Makefile fetches them and exports their folder as
// CERT_MANAGER_CRDS.
const CertManagerVersion = "v1.21.2"

// CertManagerCRDs returns the folder of cert-manager's CRDs:
// $CERT_MANAGER_CRDS, else bin/cert-manager-crds-<version>.
func CertManagerCRDs() string {
	if d := os.Getenv("CERT_MANAGER_CRDS"); d != "" {
		return d
	}
	return repo.Path("bin", "cert-manager-crds-"+CertManagerVersion)
}

// Main is a test package's TestMain body: it starts one control plane for
// the package, stores it in *env, runs setup on it, runs the tests and stops
// it. It returns the exit code.
func Main(m interface{ Run() int }, opts controlplane.Options, env **Env, setup ...func(*Env) error) int {
	var err error
	if *env, err = Start(opts); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, s := range setup {
		if err := s(*env); err != nil {
			fmt.Fprintln(os.Stderr, err)
			_ = (*env).Stop()
			return 1
		}
	}
	code := m.Run()
	if err := (*env).Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	return code
}

// BuildBinaries builds the named commands of cmd/ into dir.
func BuildBinaries(dir string, names ...string) error {
	for _, name := range names {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), "./cmd/"+name)
		cmd.Dir = repo.Root()
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("building %s: %w: %s", name, err, out)
		}
	}
	return nil
}

// StatusCount reads the integer at path (such as "status", "completing") of
// the parent gvk ns/name; -1 when it is absent.
func (e *Env) StatusCount(ctx context.Context, gvk schema.GroupVersionKind, ns, name string, path ...string) (int64, error) {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(gvk)
	if err := e.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, u); err != nil {
		return 0, err
	}
	v, found, err := unstructured.NestedInt64(u.Object, path...)
	if !found || err != nil {
		return -1, nil
	}
	return v, nil
}

// MainWithBinaries is Main for a package that runs tally's binaries: it
// builds the commands names into a temporary directory, which *bin names,
// and removes it at the end.
func MainWithBinaries(m interface{ Run() int }, opts controlplane.Options, env **Env, bin *string, names ...string) int {
	var err error
	if *bin, err = os.MkdirTemp("", "tally-bin-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(*bin)
	return Main(m, opts, env, func(*Env) error { return BuildBinaries(*bin, names...) })
}
