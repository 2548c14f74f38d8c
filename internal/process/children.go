package process

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Children returns the PIDs of parent's children running the named
// commands (their names as /proc shows them), from /proc; none where there
// is no /proc.
func Children(parent int, names ...string) ([]int, error) {
	procs, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, p := range procs {
		name, ppid, _, ok := stat(p)
		if !ok || ppid != parent || !slices.Contains(names, name) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		pids = append(pids, pid)
	}
	return pids, nil
}

// Gone reports whether process pid has ended: it no longer exists, or is a
// zombie no one has reaped yet (an orphan whose new parent does not reap).
func Gone(pid int) bool {
	_, _, state, ok := stat(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	return !ok || state == "Z" || state == "X"
}

// stat reads a process's name, parent and state from its /proc stat file.
func stat(path string) (name string, ppid int, state string, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", 0, "", false
	}
	st := string(b)
	open, closing := strings.IndexByte(st, '('), strings.LastIndexByte(st, ')')
	if open < 0 || closing < 0 || closing+2 > len(st) {
		return "", 0, "", false
	}
	f := strings.Fields(st[closing+2:])
	if len(f) < 2 {
		return "", 0, "", false
	}
	ppid, err = strconv.Atoi(f[1])
	if err != nil {
		return "", 0, "", false
	}
	return st[open+1 : closing], ppid, f[0], true
}
