// Package framework starts the real control plane (kube-apiserver and etcd,
// built from source by `make envtest-assets`) that tally's integration suites
// run against, and holds the builders those suites share. Each test package
// starts one control plane in its TestMain.
package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// KubernetesVersion is the version of the kube-apiserver the suites run
// against; the Makefile builds it into bin/k8s/<version>.
const KubernetesVersion = "1.37.2"

// Root returns the repository's root directory.
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Path returns a path relative to the repository's root.
func Path(elem ...string) string {
	return filepath.Join(append([]string{Root()}, elem...)...)
}

// Env is a running control plane.
type Env struct {
	*envtest.Environment
	// Config reaches the API server as a cluster administrator.
	Config *rest.Config
	// Client is a client built from Config.
	Client client.Client
}

// Options change what Start installs.
type Options struct {
	// CRDPaths are extra CRD files or folders; the WorkerPool CRD is always
	// installed.
	CRDPaths []string
	// Webhooks registers admission webhooks that point at the test process.
	Webhooks envtest.WebhookInstallOptions
	// EtcdQuotaBytes raises etcd's storage quota (2 GiB by default), for
	// the scale bench.
	EtcdQuotaBytes int64
}

// Start starts kube-apiserver and etcd and installs the CRDs. The binaries
// come from KUBEBUILDER_ASSETS or, when unset, from bin/k8s/<version>.
func Start(opts Options) (*Env, error) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		assets = Path("bin", "k8s", KubernetesVersion)
	}
	if _, err := os.Stat(filepath.Join(assets, "kube-apiserver")); err != nil {
		return nil, fmt.Errorf("no kube-apiserver in %s (run `make envtest-assets`): %w", assets, err)
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: assets,
		CRDInstallOptions: envtest.CRDInstallOptions{
			Paths:              append([]string{Path("examples", "workerpool", "crd")}, opts.CRDPaths...),
			ErrorIfPathMissing: true,
		},
		WebhookInstallOptions: opts.Webhooks,
	}
	if opts.EtcdQuotaBytes > 0 {
		env.ControlPlane.Etcd = &envtest.Etcd{}
		env.ControlPlane.Etcd.Configure().Set("quota-backend-bytes", strconv.FormatInt(opts.EtcdQuotaBytes, 10))
	}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("starting control plane: %w", err)
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("creating client: %w", err), env.Stop())
	}
	return &Env{Environment: env, Config: cfg, Client: c}, nil
}

// Namespace creates a namespace with a generated name and returns its name.
func (e *Env) Namespace(ctx context.Context, prefix string) (string, error) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}
	if err := e.Client.Create(ctx, ns); err != nil {
		return "", fmt.Errorf("creating namespace: %w", err)
	}
	return ns.Name, nil
}

// Tool versions the chart tests use; the Makefile builds them into bin/
// and exports their paths as HELM and CERT_MANAGER_CRDS.
const (
	HelmVersion        = "v3.22.0"
	CertManagerVersion = "v1.21.2"
)

// HelmBinary returns the path of the helm binary: $HELM, else
// bin/helm-<version>.
func HelmBinary() string {
	if h := os.Getenv("HELM"); h != "" {
		return h
	}
	return Path("bin", "helm-"+HelmVersion)
}

// CertManagerCRDs returns the folder of cert-manager's CRDs:
// $CERT_MANAGER_CRDS, else bin/cert-manager-crds-<version>.
func CertManagerCRDs() string {
	if d := os.Getenv("CERT_MANAGER_CRDS"); d != "" {
		return d
	}
	return Path("bin", "cert-manager-crds-"+CertManagerVersion)
}

// Main is a test package's TestMain body: it starts one control plane for
// the package, stores it in *env, runs setup on it, runs the tests and stops
// it. It returns the exit code.
func Main(m interface{ Run() int }, opts Options, env **Env, setup ...func(*Env) error) int {
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
		cmd.Dir = Root()
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
func MainWithBinaries(m interface{ Run() int }, opts Options, env **Env, bin *string, names ...string) int {
	var err error
	if *bin, err = os.MkdirTemp("", "tally-bin-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(*bin)
	return Main(m, opts, env, func(*Env) error { return BuildBinaries(*bin, names...) })
}
