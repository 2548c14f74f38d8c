package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/keys"
)

// down stops the cluster and puts the host back as up found it. It goes on
// after errors, so that one stuck step does not leave the rest behind, and
// reports them all at the end.
func (c *cluster) down(check bool) error {
	before, err := loadHost(c.path("host.json"))
	if errors.Is(err, os.ErrNotExist) {
		fmt.Println(">> no cluster recorded in", c.dir)
		return nil
	}
	if err != nil {
		return err
	}
	if err := c.loadState(); err != nil {
		// Stopping a component that never ran is a no-op: try them all.
		fmt.Printf(">> %v: stopping up to %d nodes\n", err, maxNodes)
		c.nodes = nodesOf(maxNodes)
	}
	start := time.Now()
	var errs []error
	keep := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}

	// Nothing recreates pods once the controllers are gone; the kubelet then
	// stops every pod, and CNI DEL removes its veth and address.
	keep(c.stop("kube-scheduler"))
	keep(c.stop("kube-controller-manager"))
	keep(c.drainPods())
	for i := len(c.nodes) - 1; i >= 0; i-- {
		nd := c.nodes[i]
		keep(c.stop(nd.component("kube-proxy")))
		keep(c.stop(nd.component("kubelet")))
		keep(c.removeContainers(nd))
		keep(c.stop(nd.component("containerd")))
	}
	keep(c.stop("kube-apiserver"))
	keep(c.stop("etcd"))
	killStrays()

	keep(unmountUnder(append([]string{c.dir, runDir}, hostPaths...), before.Mounts))
	now, err := snapshot(c)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, table := range now.NFTables {
		if !slices.Contains(before.NFTables, table) {
			keep(run(append([]string{"nft", "delete", "table"}, strings.Fields(table)...)...))
		}
	}
	for _, link := range now.Links {
		// A veth goes with the namespace that holds its peer, and
		// unmounting the namespace's file may have ended it already.
		if !slices.Contains(before.Links, link) && run("ip", "link", "show", "dev", link) == nil {
			keep(run("ip", "link", "delete", link))
		}
	}
	for _, ns := range now.Netns {
		if !slices.Contains(before.Netns, ns) {
			keep(os.Remove(filepath.Join("/run/netns", ns)))
		}
	}
	keep(removeCgroups(before.Cgroups))
	for key, v := range before.Sysctls {
		if b, err := os.ReadFile(sysctlPath(key)); err == nil && strings.TrimSpace(string(b)) != v {
			keep(os.WriteFile(sysctlPath(key), []byte(v), 0o644))
		}
	}
	for _, p := range hostPaths {
		if !slices.Contains(before.Paths, p) {
			keep(os.RemoveAll(p))
		}
	}
	keep(os.RemoveAll(runDir))
	// Keep the logs for a post-mortem; the rest is the next up's to create.
	entries, _ := os.ReadDir(c.dir)
	for _, e := range entries {
		if e.Name() != "logs" && e.Name() != "host.json" {
			keep(os.RemoveAll(c.path(e.Name())))
		}
	}

	after, err := snapshot(c)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	if diff := before.diff(after); len(diff) > 0 {
		msg := "the host differs from before the cluster:\n  " + strings.Join(diff, "\n  ")
		if check {
			errs = append(errs, errors.New(msg))
		} else {
			fmt.Println(">> " + msg)
		}
	} else {
		fmt.Println(">> host restored: no bridge, route, nftables table, cgroup, mount or path left; sysctls as before")
	}
	if len(errs) == 0 {
		keep(os.Remove(c.path("host.json")))
	}
	fmt.Printf(">> cluster down in %v\n", time.Since(start).Round(100*time.Millisecond))
	return errors.Join(errs...)
}

// drainPods deletes every pod and waits for the kubelets to stop them (CNI
// DEL then removes their veths and addresses). A pod on a node whose
// kubelet does not run (a lost node) is deleted at once: nothing would stop
// it, and removeContainers and killStrays end what it ran.
func (c *cluster) drainPods() error {
	if c.pid("kube-apiserver") == 0 || c.pid("kubelet") == 0 {
		return nil
	}
	running := map[string]bool{}
	for _, nd := range c.nodes {
		running[nd.name] = c.pid(nd.component("kubelet")) != 0
	}
	cs, err := c.clientset()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	// Pods keep appearing while their creators (an operator in a pod) are
	// still being stopped: delete again until none is left.
	for {
		pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err == nil && len(pods.Items) == 0 {
			return nil
		}
		if err == nil {
			for _, p := range pods.Items {
				grace := int64(1)
				if p.Spec.NodeName != "" && !running[p.Spec.NodeName] {
					grace = 0
				}
				if p.DeletionTimestamp == nil || grace == 0 {
					_ = cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
				}
				if slices.Contains(p.Finalizers, keys.TrackingFinalizer) {
					// tally's aggregator may be gone already (a test that
					// failed before it uninstalled tally).
					_, _ = cs.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.StrategicMergePatchType, aggregate.ReleasePatch(p.UID), metav1.PatchOptions{})
				}
			}
		}
		select {
		case <-ctx.Done():
			var left []string
			if pods != nil {
				for _, p := range pods.Items {
					left = append(left, fmt.Sprintf("%s/%s (%s, finalizers %v)", p.Namespace, p.Name, p.Status.Phase, p.Finalizers))
				}
			}
			return fmt.Errorf("pods still present after 90s: the kubelet did not stop them: %s", strings.Join(left, ", "))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// removeContainers kills and removes what node nd's containerd still runs
// (pods the kubelet did not get to).
func (c *cluster) removeContainers(nd node) error {
	if c.pid(nd.component("containerd")) == 0 {
		return nil
	}
	ctr := []string{"ctr", "--address", nd.socket(), "--namespace", "k8s.io"}
	ids, err := output(append(ctr, "containers", "list", "--quiet")...)
	if err != nil {
		return err
	}
	for _, id := range ids {
		_ = run(append(ctr, "tasks", "kill", "--signal", "SIGKILL", id)...)
		_ = run(append(ctr, "tasks", "delete", "--force", id)...)
		_ = run(append(ctr, "containers", "delete", id)...)
	}
	return nil
}

// pid returns the recorded PID of a component if that process still runs
// the component, else 0.
func (c *cluster) pid(name string) int {
	b, err := os.ReadFile(c.path("pids", name))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil || filepath.Base(strings.TrimSuffix(exe, " (deleted)")) != binary(name) {
		return 0
	}
	return pid
}

// stop sends SIGTERM to a component, and SIGKILL after 15 s.
func (c *cluster) stop(name string) error {
	defer os.Remove(c.path("pids", name))
	pid := c.pid(name)
	if pid == 0 {
		return nil
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return fmt.Errorf("stopping %s: %w", name, err)
	}
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if !alive(pid) {
			return nil
		}
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for i := 0; i < 50 && alive(pid); i++ {
		time.Sleep(100 * time.Millisecond)
	}
	return nil
}

// alive reports whether pid runs and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// killStrays kills containerd shims serving one of this cluster's
// containerds and any process left in a kubepods cgroup.
func killStrays() {
	killMatching(func(cmdline, cgroup string) bool {
		shim := strings.Contains(cmdline, "containerd-shim") && strings.Contains(cmdline, runDir+"/")
		return shim || strings.Contains(cgroup, "/kubepods")
	})
}

// killMatching sends SIGKILL to every process whose command line and
// /proc/PID/cgroup match, and returns how many it sent it to.
func killMatching(match func(cmdline, cgroup string) bool) int {
	n := 0
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		pid, _ := strconv.Atoi(filepath.Base(p))
		cmdline, _ := os.ReadFile(p + "/cmdline")
		cgroup, _ := os.ReadFile(p + "/cgroup")
		if pid != os.Getpid() && match(string(cmdline), string(cgroup)) && syscall.Kill(pid, syscall.SIGKILL) == nil {
			n++
		}
	}
	return n
}

// unmountUnder unmounts, deepest first, every mount under one of dirs that
// was not there before.
func unmountUnder(dirs, before []string) error {
	now, err := mounts()
	if err != nil {
		return err
	}
	var errs []error
	for i := len(now) - 1; i >= 0; i-- {
		m := now[i]
		if slices.Contains(before, m) {
			continue
		}
		for _, d := range dirs {
			if m == d || strings.HasPrefix(m, d+"/") {
				if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
					errs = append(errs, fmt.Errorf("unmounting %s: %w", m, err))
				}
				break
			}
		}
	}
	return errors.Join(errs...)
}

// removeCgroups removes, deepest first, the cgroups created below the
// first-level directories that were not there before.
func removeCgroups(before []string) error {
	var errs []error
	for _, dir := range cgroupDirs() {
		if slices.Contains(before, dir) {
			continue
		}
		var tree []string
		_ = filepath.WalkDir(filepath.Join("/sys/fs/cgroup", dir), func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				tree = append(tree, path)
			}
			return nil
		})
		for i := len(tree) - 1; i >= 0; i-- {
			var err error
			for try := 0; try < 20; try++ {
				if err = syscall.Rmdir(tree[i]); err == nil || errors.Is(err, syscall.ENOENT) {
					err = nil
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("removing cgroup %s: %w", tree[i], err))
			}
		}
	}
	return errors.Join(errs...)
}
