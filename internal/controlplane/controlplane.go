// Package controlplane starts a real kube-apiserver and etcd (built from
// source by `make envtest-assets`) with the example WorkerPool CRD: the
// control plane the demo runs on and the suites test against.
package controlplane

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
)

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
	// Webhooks registers admission webhooks that point at the calling
	// process.
	Webhooks envtest.WebhookInstallOptions
	// EtcdQuotaBytes raises etcd's storage quota (2 GiB by default), for
	// the scale bench.
	EtcdQuotaBytes int64
}

// AssetsEnv names the variable that holds the folder of kube-apiserver and
// etcd; the Makefile builds them (make envtest-assets) and exports it.
const AssetsEnv = "KUBEBUILDER_ASSETS"

// assets returns the folder of kube-apiserver and etcd ($KUBEBUILDER_ASSETS),
// or an error that says how to get them.
func assets() (string, error) {
	dir := os.Getenv(AssetsEnv)
	if dir == "" {
		return "", fmt.Errorf("$%s is not set: run through make (make demo, make test), which builds kube-apiserver and etcd and sets it", AssetsEnv)
	}
	if _, err := os.Stat(filepath.Join(dir, "kube-apiserver")); err != nil {
		return "", fmt.Errorf("no kube-apiserver in $%s=%s (run `make envtest-assets`): %w", AssetsEnv, dir, err)
	}
	return dir, nil
}

// Start starts kube-apiserver and etcd from assets and installs the CRDs.
func Start(opts Options) (*Env, error) {
	dir, err := assets()
	if err != nil {
		return nil, err
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: dir,
		CRDInstallOptions: envtest.CRDInstallOptions{
			Paths:              append([]string{repo.Path("examples", "workerpool", "crd")}, opts.CRDPaths...),
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

// AggregatorIdentity provisions a client certificate for
// helm.AggregatorUser, so that an aggregator run with it is the one the
// webhook registration exempts and the chart's policy fences.
func (e *Env) AggregatorIdentity() (*envtest.AuthenticatedUser, error) {
	user, err := e.AddUser(envtest.User{Name: helm.AggregatorUser, Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return nil, fmt.Errorf("provisioning the aggregator's identity: %w", err)
	}
	return user, nil
}

// WriteKubeconfig writes user's kubeconfig to path.
func WriteKubeconfig(user *envtest.AuthenticatedUser, path string) error {
	data, err := user.KubeConfig()
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}
