//go:build linux

package controlplane

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"tally.dev/tally/internal/process"
)

// helperEnv makes TestHelperStartsAControlPlane run, in a child process.
const helperEnv = "TALLY_CONTROLPLANE_TEST_HELPER"

// TestHelperStartsAControlPlane is not a test of its own: run as a child
// of TestNothingOutlivesItsStarter, it starts a control plane as the demo
// and the bench do, prints the PIDs of its kube-apiserver and etcd, and
// waits for SIGINT, on which it stops them as they do.
func TestHelperStartsAControlPlane(t *testing.T) {
	if os.Getenv(helperEnv) == "" {
		t.Skip("run by TestNothingOutlivesItsStarter")
	}
	ctx, _ := process.Interruptible()
	env, err := Start(Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "starting the control plane:", err)
		os.Exit(1)
	}
	pids, err := process.Children(os.Getpid(), supervised...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "finding its processes:", err)
		os.Exit(1)
	}
	fmt.Println("PIDS", strings.Trim(fmt.Sprint(pids), "[]"))
	<-ctx.Done()
	_ = env.Stop()
	os.Exit(0)
}

// TestNothingOutlivesItsStarter kills a process that started a control
// plane, with SIGKILL (no cleanup runs) and with SIGINT: its kube-apiserver
// and etcd are gone within 10 s either way.
func TestNothingOutlivesItsStarter(t *testing.T) {
	if os.Getenv(AssetsEnv) == "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("$%s is not set: run `make test`", AssetsEnv)
		}
		t.Skipf("$%s is not set: run `make test`, which builds kube-apiserver and etcd", AssetsEnv)
	}
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperStartsAControlPlane$", "-test.v")
			// The control plane's folder, which a killed helper cannot
			// remove, goes with the test's.
			cmd.Env = append(os.Environ(), helperEnv+"=1", "TMPDIR="+t.TempDir())
			cmd.Stderr = os.Stderr
			out, err := cmd.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
			pids := make(chan []int, 1)
			go func() {
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					if rest, ok := strings.CutPrefix(sc.Text(), "PIDS "); ok {
						var found []int
						for _, f := range strings.Fields(rest) {
							pid, _ := strconv.Atoi(f)
							found = append(found, pid)
						}
						pids <- found
					}
				}
				close(pids)
			}()
			var started []int
			select {
			case started = <-pids:
			case <-time.After(2 * time.Minute):
				t.Fatal("the helper did not start its control plane within 2 minutes")
			}
			require.Len(t, started, 2, "kube-apiserver and etcd, as children of the helper")
			require.NoError(t, cmd.Process.Signal(sig))
			_ = cmd.Wait()
			deadline := time.Now().Add(10 * time.Second)
			for {
				var left []int
				for _, pid := range started {
					if !process.Gone(pid) {
						left = append(left, pid)
					}
				}
				if len(left) == 0 {
					return
				}
				require.True(t, time.Now().Before(deadline), "%v still running 10 s after the helper got %s", left, sig)
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
}
