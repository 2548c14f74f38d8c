// Package process runs tally's binaries as child processes, for the demo and
// the suites that need real processes (signals, restarts, fail-over).
package process

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// Process is one of tally's binaries, run as a child process whose output
// goes to a log file.
type Process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan error
}

// Start runs bin with args as the child process name, its output appended to
// logDir/<name>.log.
func Start(name, bin, logDir string, args ...string) (*Process, error) {
	logPath := filepath.Join(logDir, name+".log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// The child dies with the demo, even if the demo is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &Process{name: name, cmd: cmd, logPath: logPath, done: make(chan error, 1)}
	go func() {
		p.done <- cmd.Wait()
		logFile.Close()
	}()
	return p, nil
}

// Stop asks the process to exit (SIGTERM) and kills it if it has not after
// a grace period. Stopping a process that has exited returns at once.
func (p *Process) Stop() error {
	if p == nil {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		p.done <- err
		var exit *exec.ExitError
		if errors.As(err, &exit) && exit.Sys().(syscall.WaitStatus).Signaled() {
			return nil
		}
		return err
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		p.done <- <-p.done
		return fmt.Errorf("%s did not exit within 15s of SIGTERM and was killed", p.name)
	}
}

// WaitReady polls url until it answers 200, the process exits or ctx ends
// (at most 60 s unless ctx has a deadline of its own).
func (p *Process) WaitReady(ctx context.Context, url string) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
	}
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-p.done:
			p.done <- err
			return fmt.Errorf("%s exited before it was ready (%v); see %s", p.name, err, p.logPath)
		case <-ctx.Done():
			return fmt.Errorf("%s not ready at %s: %w; see %s", p.name, url, ctx.Err(), p.logPath)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Pid returns the process's ID.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// LogPath returns the path of the process's log file.
func (p *Process) LogPath() string { return p.logPath }

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Exited reports whether the process has exited, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case err := <-p.done:
		p.done <- err
		return true, err
	default:
		return false, nil
	}
}
