// Package framework is what tally's integration suites share on top of
// internal/controlplane: one control plane per test package (Main), tally's
// binaries built and run as processes, webhook registration against the
// test process, and the fault injectors (a cutting proxy, a conflict log).
package framework

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/helm"
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

// CertManagerCRDs returns the folder of cert-manager's CRDs, which the
// Makefile fetches and exports as CERT_MANAGER_CRDS.
func CertManagerCRDs() string { return os.Getenv("CERT_MANAGER_CRDS") }

// testTools are the variables through which `make test` hands every suite
// with a control plane its tools.
var testTools = []string{controlplane.AssetsEnv, "HELM", "CERT_MANAGER_CRDS"}

// strict reports whether a missing tool fails rather than skips: in CI
// (CI=true), where every tier must run.
func strict() bool { return os.Getenv("CI") == "true" }

// Tool returns the path of a tool that the Makefile builds and exports as
// $env. When it is not set, the test is skipped with a message naming
// target, the make target that builds and sets it, which Notice also
// writes; under CI=true it fails.
// A path that is set but does not exist always fails.
func Tool(t testing.TB, env, target string) string {
	t.Helper()
	p := os.Getenv(env)
	if p == "" {
		msg := fmt.Sprintf("$%s is not set: run `make %s`, which builds the tool and sets it", env, target)
		if strict() {
			t.Fatal(msg)
		}
		Notice("SKIP: " + msg)
		t.Skip("SKIP: " + msg)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("$%s: %v", env, err)
	}
	return p
}

// LongMessage is what a long scenario says when `make test` skips it.
const LongMessage = "SKIP: a long scenario (it waits out outages, leases or grace periods, or works at scale), not run under -short: `make test-all` runs it, and CI"

// Long is called first by a test that waits out real time (an outage, a
// lease, a grace period) or works at scale: under -short, as `make test`
// runs, it skips the test with LongMessage. `make test-all`, which CI runs,
// runs it.
func Long(t testing.TB) { long(t, testing.Short()) }

func long(t testing.TB, short bool) {
	t.Helper()
	if short {
		t.Skip(LongMessage)
	}
}

// HaveTools is for a TestMain whose package needs the tools `make test`
// builds (kube-apiserver, etcd, helm, cert-manager's CRDs). When one is not
// set it says so on stderr (Notice) and returns false with the exit code:
// 0, the package skipped, or 1 under CI=true. A package skipped says too
// that it ran no test, as the testing package does when -run matches none:
// go test then ends its "ok" line with [no tests to run].
func HaveTools() (ok bool, code int) {
	var missing []string
	for _, e := range testTools {
		if os.Getenv(e) == "" {
			missing = append(missing, "$"+e)
		}
	}
	if len(missing) == 0 {
		return true, 0
	}
	Notice(fmt.Sprintf("SKIP: %s not set: run `make test`, which builds the tools and sets them", strings.Join(missing, ", ")))
	if strict() {
		return false, 1
	}
	fmt.Fprintln(stderr, "testing: warning: no tests to run")
	return false, 0
}

// stderr is where HaveTools and Notice write, goStderr what opens the go
// command's stderr for Notice (goTestStderr); tests replace both. noticed
// holds the lines Notice has written.
var (
	stderr   io.Writer = os.Stderr
	goStderr           = goTestStderr
	noticed  sync.Map
)

// Notice writes msg, a test or package skipped (or not run) and what it
// lacks, on stderr as one line that names the test package, once per
// message. go test shows a passing package's output only with -v, so when
// it would hide the line, Notice also writes it to the go command's own
// stderr: `go test ./test/kopf/` then says why the package ran nothing.
func Notice(msg string) {
	line := fmt.Sprintf("%s: %s\n", testPackage(), strings.ReplaceAll(msg, "\n", " "))
	if _, said := noticed.LoadOrStore(line, true); said {
		return
	}
	fmt.Fprint(stderr, line)
	if f := goStderr(); f != nil {
		fmt.Fprint(f, line)
		f.Close()
	}
}

// testPackage returns the import path of the package this test binary
// tests, as go test names it.
func testPackage() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Path != "" {
		return strings.TrimSuffix(bi.Path, ".test")
	}
	return filepath.Base(os.Args[0])
}

// goTestStderr opens the stderr of the go command that runs this test
// binary when that command would not show the binary's output: without -v
// go test keeps a passing package's output to itself, unless it handed the
// binary its own stdout (`go test` without packages streams it). It
// returns nil when the output is shown (-v, or under CI=true, where a
// missing tool fails the package), when the parent is not the go command,
// when its stderr is a regular file (written at an offset of its own, the
// line could be overwritten), and where /proc does not tell.
func goTestStderr() *os.File {
	verbose := flag.Lookup("test.v")
	if verbose == nil || strict() {
		return nil
	}
	if !flag.Parsed() {
		flag.Parse() // called from TestMain, before m.Run parses them
	}
	if verbose.Value.String() != "false" {
		return nil
	}
	parent := fmt.Sprintf("/proc/%d/", os.Getppid())
	if exe, err := os.Readlink(parent + "exe"); err != nil || filepath.Base(exe) != "go" {
		return nil
	}
	ours, err := os.Stdout.Stat()
	if err != nil {
		return nil
	}
	if its, err := os.Stat(parent + "fd/1"); err != nil || os.SameFile(ours, its) {
		return nil
	}
	if its, err := os.Stat(parent + "fd/2"); err != nil || its.Mode().IsRegular() {
		return nil
	}
	f, err := os.OpenFile(parent+"fd/2", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return nil
	}
	return f
}

// Main is a test package's TestMain body: it starts one control plane for
// the package, stores it in *env, runs setup on it, runs the tests and stops
// it. It returns the exit code. Without the tools `make test` sets, the
// package is skipped with a message saying so (failed under CI=true).
func Main(m interface{ Run() int }, opts controlplane.Options, env **Env, setup ...func(*Env) error) int {
	if ok, code := HaveTools(); !ok {
		return code
	}
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

// BinariesEnv names a directory holding every command of cmd/, built from
// the same tree: make test builds them once before go test and sets it, so
// that the packages which run tally's binaries link none of their own.
const BinariesEnv = "TALLY_TEST_BINARIES"

// BuildBinaries puts the named commands of cmd/ into dir: links to those
// in $TALLY_TEST_BINARIES when it is set, else one go build of them all.
func BuildBinaries(dir string, names ...string) error {
	if prebuilt := os.Getenv(BinariesEnv); prebuilt != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, name := range names {
			src := filepath.Join(prebuilt, name)
			if _, err := os.Stat(src); err != nil {
				return fmt.Errorf("%s=%s: %w", BinariesEnv, prebuilt, err)
			}
			dst := filepath.Join(dir, name)
			if err := os.Remove(dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
			if err := os.Symlink(src, dst); err != nil {
				return err
			}
		}
		return nil
	}
	return goBuild(dir, nil, names...)
}

// BuildRaceBinaries is BuildBinaries, but the commands are built with the
// race detector when this test binary is: a data race in a child process
// is then found as one in the test's own code would be (the child reports
// it in its log, and goes on).
func BuildRaceBinaries(dir string, names ...string) error {
	if !raceEnabled {
		return BuildBinaries(dir, names...)
	}
	return goBuild(dir, []string{"-race"}, names...)
}

// goBuild builds the named commands of cmd/ into dir with flags.
func goBuild(dir string, flags []string, names ...string) error {
	args := append([]string{"build"}, flags...)
	args = append(args, "-o", dir+string(filepath.Separator))
	for _, name := range names {
		args = append(args, "./cmd/"+name)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = repo.Root()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s: %w: %s", strings.Join(names, ", "), err, out)
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

// AsTally returns a client that acts as tally's aggregator (its service
// account's username, with every permission). The webhook is not called
// for its requests, as for the aggregator's own, so a test can create pods
// as tally would have left them, the tracking finalizer included, which
// the webhook removes from any other client's pod at CREATE.
func (e *Env) AsTally() (client.Client, error) {
	cfg := rest.CopyConfig(e.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: helm.AggregatorUser, Groups: []string{"system:masters", "system:authenticated"}}
	return client.New(cfg, client.Options{Scheme: e.Client.Scheme()})
}
