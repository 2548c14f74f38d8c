package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// node is one kubelet with its containerd and kube-proxy.
//
// The first node runs in the host's network namespace, on the bridge that
// also carries the API server's address. Every further node runs in a
// network namespace of its own, as a kind node runs in a container: a veth
// pair joins it to the host (uplink on the host's side, a /30 between
// them), its pods sit on a bridge inside it with a pod range of their own,
// and the host routes that range to the node's address. The kubelet,
// containerd and kube-proxy of such a node are started in its namespace
// (nsenter --net), so that their ports, nftables tables and sysctls do not
// meet the first node's; they share the host's mounts, so that containerd
// sees the volumes the kubelet mounts. The kubelet's pods go under a cgroup
// root of the node's own (both kubelets would otherwise manage /kubepods).
type node struct {
	// n counts from 1; name, ip and the paths follow from it.
	n    int
	name string
	// ip is the kubelet's address, the one the API server reaches it on.
	ip      string
	podCIDR string
	// gateway is the address of the node's bridge (bridgeName, in the
	// node's own namespace after the first), the pods' default route.
	gateway string
	// netns and uplink, the host's end of the veth pair, and hostIP, the
	// address on it, are empty for the first node.
	netns, uplink, hostIP string
}

// maxNodes bounds --nodes: each node takes a /24 of 10.244.0.0/16 and the
// host's CPU and memory.
const maxNodes = 4

// nodeOf returns the cluster's node n (1 to maxNodes).
func nodeOf(n int) node {
	if n == 1 {
		return node{n: 1, name: nodeName, ip: nodeIP, podCIDR: podCIDR, gateway: nodeIP}
	}
	return node{
		n:       n,
		name:    fmt.Sprintf("%s-%d", nodeName, n),
		ip:      fmt.Sprintf("10.243.%d.2", n),
		hostIP:  fmt.Sprintf("10.243.%d.1", n),
		podCIDR: fmt.Sprintf("10.244.%d.0/24", n-1),
		gateway: fmt.Sprintf("10.244.%d.1", n-1),
		netns:   fmt.Sprintf("%s-%d", nodeName, n),
		uplink:  fmt.Sprintf("tally-n%d", n),
	}
}

// nodesOf returns nodes 1 to count.
func nodesOf(count int) []node {
	nodes := make([]node, count)
	for i := range nodes {
		nodes[i] = nodeOf(i + 1)
	}
	return nodes
}

// component is the name a node's component is started, logged and recorded
// under: kubelet for the first node, kubelet-2 for the second.
func (nd node) component(name string) string {
	if nd.n == 1 {
		return name
	}
	return fmt.Sprintf("%s-%d", name, nd.n)
}

// binary is the executable a component runs: kubelet for kubelet-2.
func binary(component string) string {
	if i := strings.LastIndexByte(component, '-'); i > 0 {
		if _, err := strconv.Atoi(component[i+1:]); err == nil {
			return component[:i]
		}
	}
	return component
}

// dir is where the node's configuration and state live: the cluster's
// directory for the first node, node-<n> in it for the others.
func (nd node) dir(c *cluster, elem ...string) string {
	if nd.n == 1 {
		return c.path(elem...)
	}
	return c.path(append([]string{fmt.Sprintf("node-%d", nd.n)}, elem...)...)
}

// socket is where the node's containerd serves.
func (nd node) socket() string {
	if nd.n == 1 {
		return containerdSocket
	}
	return fmt.Sprintf("%s/containerd-%d.sock", runDir, nd.n)
}

// cgroupRoot is the kubelet's cgroup root: "/" for the first node.
func (nd node) cgroupRoot() string {
	if nd.n == 1 {
		return "/"
	}
	return "/" + nd.name
}

// network creates the node's namespace, the veth pair and the routes both
// ways, and the cgroup root its kubelet needs to exist. The first node's
// network is the cluster's (cluster.network).
func (nd node) network() error {
	if nd.n == 1 {
		return nil
	}
	inside := []string{"ip", "netns", "exec", nd.netns}
	cmds := [][]string{
		{"ip", "netns", "add", nd.netns},
		{"ip", "link", "add", nd.uplink, "type", "veth", "peer", "name", "eth0", "netns", nd.netns},
		{"ip", "addr", "add", nd.hostIP + "/30", "dev", nd.uplink},
		{"ip", "link", "set", nd.uplink, "up"},
		{"ip", "route", "add", nd.podCIDR, "via", nd.ip, "dev", nd.uplink},
		append(inside, "ip", "link", "set", "lo", "up"),
		append(inside, "ip", "addr", "add", nd.ip+"/30", "dev", "eth0"),
		append(inside, "ip", "link", "set", "eth0", "up"),
		append(inside, "ip", "route", "add", "default", "via", nd.hostIP),
		// The pods' traffic to other nodes leaves through eth0.
		append(inside, "sysctl", "-qw", "net.ipv4.ip_forward=1"),
	}
	for _, args := range cmds {
		if err := run(args...); err != nil {
			return err
		}
	}
	return nd.createCgroupRoot()
}

// createCgroupRoot creates the node's cgroup root in every hierarchy, which
// the kubelet refuses to start without. Under cgroup v1 a new cpuset
// starts with no CPUs and no memory nodes: it gets its parent's.
func (nd node) createCgroupRoot() error {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		return os.Mkdir(filepath.Join("/sys/fs/cgroup", nd.name), 0o755)
	}
	hierarchies, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	for _, h := range hierarchies {
		// cpu and cpuacct are often links to cpu,cpuacct.
		if !h.IsDir() {
			continue
		}
		dir := filepath.Join("/sys/fs/cgroup", h.Name(), nd.name)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("creating cgroup %s: %w", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
					return fmt.Errorf("writing %s of %s: %w", f, dir, err)
				}
			}
		}
	}
	return nil
}

// restartedIfExited is the kubelet step's readiness check, which starts
// the kubelet again when it exited: a containerd that answers its own API
// may not serve the CRI yet (after a node loss it first cleans up its dead
// shims), and the kubelet exits at once on "server is not initialized
// yet".
func (c *cluster) restartedIfExited(nd node, s step) func(context.Context) error {
	return func(ctx context.Context) error {
		if !c.exited(s.name) {
			return s.ready(ctx)
		}
		time.Sleep(time.Second)
		if err := c.start(nd, s.name, s.args); err != nil {
			return err
		}
		return fmt.Errorf("%s exited (its log says why); started again", s.name)
	}
}

// exited reports whether the process started for component name has
// ended: gone, or a zombie (its parent, this process, released it).
func (c *cluster) exited(name string) bool {
	pid, err := os.ReadFile(c.path("pids", name))
	if err != nil {
		return false
	}
	stat, err := os.ReadFile(filepath.Join("/proc", strings.TrimSpace(string(pid)), "stat"))
	if err != nil {
		return true
	}
	// The state follows the command, which is in parentheses.
	fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	return len(fields) > 0 && fields[0] == "Z"
}

// steps are the node's components, in the order they start.
func (c *cluster) nodeSteps(nd node) []step {
	return []step{
		{nd.component("containerd"), []string{"--config", nd.dir(c, "containerd.toml")}, func(context.Context) error {
			return run("ctr", "--address", nd.socket(), "version")
		}},
		{nd.component("kubelet"), []string{"--config", nd.dir(c, "kubelet.yaml"), "--kubeconfig", c.path(nd.component("kubelet") + ".kubeconfig"),
			"--root-dir", nd.dir(c, "kubelet", "root"), "--cert-dir", nd.dir(c, "kubelet", "pki"),
			"--node-ip", nd.ip, "--hostname-override", nd.name},
			func(ctx context.Context) error { return c.nodeReady(ctx, nd.name) }},
		{nd.component("kube-proxy"), []string{"--config", nd.dir(c, "kube-proxy.yaml")}, httpReady("http://"+nd.healthzAddress()+":10256/healthz", nil)},
	}
}

// startNode starts the node's components and waits until it is Ready,
// importing images into its containerd before the kubelet starts.
func (c *cluster) startNode(ctx context.Context, nd node, images []string) error {
	for _, s := range c.nodeSteps(nd) {
		t := time.Now()
		if s.name == nd.component("kubelet") {
			// The sandbox image must be in containerd before the first pod.
			if err := c.load(nd, images); err != nil {
				return err
			}
		}
		if err := c.start(nd, s.name, s.args); err != nil {
			return err
		}
		ready := s.ready
		if s.name == nd.component("kubelet") {
			ready = c.restartedIfExited(nd, s)
		}
		if err := waitFor(ctx, s.name, ready); err != nil {
			return fmt.Errorf("%w (log: %s)", err, c.path("logs", s.name+".log"))
		}
		fmt.Printf(">> %-24s ready in %v\n", s.name, time.Since(t).Round(10*time.Millisecond))
	}
	return nil
}

// loseNode takes node name off the cluster as a machine that loses power
// would: its kubelet, kube-proxy, containerd, containerd's shims and every
// container it ran are killed with SIGKILL, and its link to the host goes
// down. Its state directories stay, as a disk would; joinNode starts it
// again. The first node holds the control plane and cannot be lost.
func (c *cluster) loseNode(name string) error {
	nd, err := c.node(name)
	if err != nil {
		return err
	}
	if nd.n == 1 {
		return fmt.Errorf("%s runs the control plane: only a further node can be lost", name)
	}
	var killed []string
	for _, comp := range []string{"kubelet", "kube-proxy", "containerd"} {
		if pid := c.pid(nd.component(comp)); pid != 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			killed = append(killed, nd.component(comp))
		}
	}
	n := killMatching(func(cmdline, cgroup string) bool {
		shim := strings.Contains(cmdline, "containerd-shim") && strings.Contains(cmdline, nd.socket())
		return shim || strings.Contains(cgroup, ":"+nd.cgroupRoot()+"/")
	})
	for _, comp := range []string{"kubelet", "kube-proxy", "containerd"} {
		_ = os.Remove(c.path("pids", nd.component(comp)))
	}
	if err := run("ip", "link", "set", nd.uplink, "down"); err != nil {
		return err
	}
	fmt.Printf(">> %s lost: killed %s and %d shim and container processes; %s down\n", name, strings.Join(killed, ", "), n, nd.uplink)
	return nil
}

// joinNode brings a lost node back: its link and the route to its pods up,
// then containerd (which finds its dead shims), the kubelet (which
// registers the Node again if it was deleted, and stops the sandboxes of
// pods that are gone) and kube-proxy, and waits until the node is Ready.
func (c *cluster) joinNode(name string) error {
	nd, err := c.node(name)
	if err != nil {
		return err
	}
	if nd.n == 1 {
		return fmt.Errorf("%s runs the control plane and is never lost", name)
	}
	start := time.Now()
	// The kernel dropped the route through the link when it went down.
	for _, args := range [][]string{
		{"ip", "link", "set", nd.uplink, "up"},
		{"ip", "route", "replace", nd.podCIDR, "via", nd.ip, "dev", nd.uplink},
	} {
		if err := run(args...); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := c.startNode(ctx, nd, nil); err != nil {
		return err
	}
	fmt.Printf(">> %s joined again in %v\n", name, time.Since(start).Round(100*time.Millisecond))
	return nil
}

// node returns the cluster's node called name.
func (c *cluster) node(name string) (node, error) {
	for _, nd := range c.nodes {
		if nd.name == name {
			return nd, nil
		}
	}
	var names []string
	for _, nd := range c.nodes {
		names = append(names, nd.name)
	}
	return node{}, fmt.Errorf("no node %q in the cluster (it has %s)", name, strings.Join(names, ", "))
}

// nodeReady answers nil once the Node called name reports Ready.
func (c *cluster) nodeReady(ctx context.Context, name string) error {
	cs, err := c.clientset()
	if err != nil {
		return err
	}
	node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, cond := range node.Status.Conditions {
		if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
			return nil
		}
	}
	return fmt.Errorf("node %s not Ready yet", name)
}

// healthzAddress is where the node's kube-proxy serves its health: the
// host's loopback for the first node, the node's address, which the host
// reaches, for the others.
func (nd node) healthzAddress() string {
	if nd.n == 1 {
		return "127.0.0.1"
	}
	return nd.ip
}
