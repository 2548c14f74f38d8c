// Package controlplane starts a real kube-apiserver and etcd (built from
// source by `make envtest-assets`) with the example WorkerPool CRD: the
// control plane the demo runs on and the suites test against.
package controlplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

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
	// certDir holds the API server's certificates, kept across
	// RestartAPIServer, and etcd's data in etcd/, kept across RestartEtcd.
	certDir string
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

// stopTimeout is how long Stop waits for kube-apiserver or etcd to go after
// SIGTERM before it SIGKILLs them (envtest's default is 20 s).
const stopTimeout = 10 * time.Second

// Start starts kube-apiserver and etcd from assets and installs the CRDs.
func Start(opts Options) (*Env, error) {
	dir, err := assets()
	if err != nil {
		return nil, err
	}
	// The API server's certificates live in a folder of this package's,
	// not one envtest makes and forgets on Stop: a restarted API server
	// then serves the same certificate, so every client stays valid.
	certDir, err := os.MkdirTemp("", "tally-controlplane-")
	if err != nil {
		return nil, fmt.Errorf("creating the control plane's folder: %w", err)
	}
	// kube-apiserver and etcd die with this process, whatever ends it
	// (orphans_linux.go); Stop gives them stopTimeout to go after SIGTERM,
	// then SIGKILLs them (envtest sets that on both, over their own).
	apiserverPath, etcdPath, err := supervise(filepath.Join(certDir, "bin"), dir)
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(certDir))
	}
	env := &envtest.Environment{
		ControlPlane:            envtest.ControlPlane{APIServer: &envtest.APIServer{CertDir: certDir, Path: apiserverPath}},
		ControlPlaneStopTimeout: stopTimeout,
		BinaryAssetsDirectory:   dir,
		CRDInstallOptions: envtest.CRDInstallOptions{
			Paths:              append([]string{repo.Path("examples", "workerpool", "crd")}, opts.CRDPaths...),
			ErrorIfPathMissing: true,
		},
		WebhookInstallOptions: opts.Webhooks,
	}
	// etcd's data lives in that folder too: envtest removes a data
	// folder it made itself when etcd stops, and RestartEtcd needs it kept.
	env.ControlPlane.Etcd = &envtest.Etcd{DataDir: filepath.Join(certDir, "etcd"), Path: etcdPath}
	if opts.EtcdQuotaBytes > 0 {
		env.ControlPlane.Etcd.Configure().Set("quota-backend-bytes", strconv.FormatInt(opts.EtcdQuotaBytes, 10))
	}
	e := &Env{Environment: env, certDir: certDir}
	cfg, err := env.Start()
	if err != nil {
		return nil, errors.Join(fmt.Errorf("starting control plane: %w", err), os.RemoveAll(certDir))
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("creating client: %w", err), e.Stop())
	}
	e.Config, e.Client = cfg, c
	return e, nil
}

// Stop stops the API server and etcd and removes their files.
func (e *Env) Stop() error {
	return errors.Join(e.Environment.Stop(), os.RemoveAll(e.certDir))
}

// RestartAPIServer kills kube-apiserver (SIGKILL: a crash, an OOM kill or
// a lost machine; its graceful stop would take Stop's whole timeout),
// waits down, and starts it again on the same address, with the same
// certificates and the same etcd: what an API server restart is to its
// clients (every connection cut, new ones refused meanwhile, every watch to
// be opened again). It returns once the API server answers its health
// check again.
func (e *Env) RestartAPIServer(down time.Duration) error {
	pid, err := e.pidOf("kube-apiserver", "--cert-dir="+e.certDir)
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("killing kube-apiserver (pid %d): %w", pid, err)
	}
	api := e.ControlPlane.GetAPIServer()
	// Reaps the killed process.
	if err := api.Stop(); err != nil {
		return fmt.Errorf("stopping kube-apiserver: %w", err)
	}
	time.Sleep(down)
	// envtest waits 20 s by default: a loaded machine (a cluster suite
	// beside) has taken longer.
	api.StartTimeout = time.Minute
	if err := api.Start(); err != nil {
		return fmt.Errorf("starting kube-apiserver again: %w", err)
	}
	return nil
}

// RestartEtcd kills etcd (SIGKILL), waits down, and starts it again on the
// same address with the same data: what an etcd crash is to kube-apiserver
// (its watches on etcd end, requests fail meanwhile). It returns once etcd
// answers its health check again.
func (e *Env) RestartEtcd(down time.Duration) error {
	etcd := e.ControlPlane.Etcd
	pid, err := e.pidOf("etcd", "--data-dir="+etcd.DataDir)
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("killing etcd (pid %d): %w", pid, err)
	}
	// Reaps the killed process.
	if err := etcd.Stop(); err != nil {
		return fmt.Errorf("stopping etcd: %w", err)
	}
	time.Sleep(down)
	etcd.StartTimeout = time.Minute
	if err := etcd.Start(); err != nil {
		return fmt.Errorf("starting etcd again: %w", err)
	}
	return nil
}

// pidOf returns the pid of this control plane's process name: the one
// started with arg, which names a folder of its own (envtest keeps its
// processes to itself).
func (e *Env) pidOf(name, arg string) (int, error) {
	want := []byte(arg + "\x00")
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("finding %s: %w", name, err)
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if err == nil && bytes.Contains(cmdline, want) {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no %s runs with %s", name, arg)
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
