package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cluster is one cluster's state directory, binaries and nodes.
type cluster struct {
	dir, bin string
	// sandboxImage is the pause image containerd runs for every pod; one of
	// the images up loads must hold it.
	sandboxImage string
	nodes        []node
}

func (c *cluster) path(elem ...string) string {
	return filepath.Join(append([]string{c.dir}, elem...)...)
}

// binaries are what up needs from --bin (containerd comes from Debian).
var binaries = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"}

// packages are the Debian packages the node needs, by a file each installs.
var packages = map[string]string{
	"/usr/bin/containerd":   "containerd",
	"/usr/bin/ctr":          "containerd",
	"/usr/sbin/runc":        "runc",
	"/usr/lib/cni/bridge":   "containernetworking-plugins",
	"/usr/sbin/nft":         "nftables",
	"/usr/sbin/iptables":    "iptables",
	"/usr/sbin/conntrack":   "conntrack",
	"/usr/sbin/ip":          "iproute2",
	"/usr/bin/mountpoint":   "util-linux",
	"/usr/bin/nsenter":      "util-linux",
	"/usr/lib/cni/loopback": "containernetworking-plugins",
}

// up starts the cluster; if it cannot, it takes down what it started.
func (c *cluster) up(images []string) (err error) {
	start := time.Now()
	if _, err := os.Stat(c.path("host.json")); err == nil {
		fmt.Println(">> a cluster from an earlier run is recorded: taking it down first")
		// down reads that cluster's binaries and nodes, not this one's.
		earlier := &cluster{dir: c.dir}
		if err := earlier.down(false); err != nil {
			return fmt.Errorf("taking the earlier cluster down: %w", err)
		}
	}
	for _, name := range binaries {
		if _, err := os.Stat(filepath.Join(c.bin, name)); err != nil {
			return fmt.Errorf("%s is missing from %s (make cluster-binaries builds it)", name, c.bin)
		}
	}
	if err := installPackages(); err != nil {
		return err
	}
	if err := os.RemoveAll(c.dir); err != nil {
		return err
	}
	for _, d := range []string{"logs", "pids", "cni", "etcd"} {
		if err := os.MkdirAll(c.path(d), 0o755); err != nil {
			return err
		}
	}
	before, err := snapshot(c)
	if err != nil {
		return err
	}
	if err := before.save(c.path("host.json")); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			fmt.Printf(">> the cluster did not start (%v): taking it down\n", err)
			if downErr := c.down(false); downErr != nil {
				err = errors.Join(err, downErr)
			}
		}
	}()
	if err := c.saveState(); err != nil {
		return err
	}
	if err := c.network(); err != nil {
		return err
	}
	if err := writePKI(c.dir, c.nodes); err != nil {
		return err
	}
	for _, nd := range c.nodes {
		if err := nd.network(); err != nil {
			return err
		}
		if err := c.writeConfigs(nd); err != nil {
			return err
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(2+len(c.nodes))*time.Minute)
	defer cancel()
	for _, s := range c.controlPlane() {
		t := time.Now()
		if err := c.start(c.nodes[0], s.name, s.args); err != nil {
			return err
		}
		if err := waitFor(ctx, s.name, s.ready); err != nil {
			return fmt.Errorf("%w (log: %s)", err, c.path("logs", s.name+".log"))
		}
		fmt.Printf(">> %-24s ready in %v\n", s.name, time.Since(t).Round(10*time.Millisecond))
	}
	for _, nd := range c.nodes {
		if err := c.startNode(ctx, nd, images); err != nil {
			return err
		}
	}
	if err := c.defaultServiceAccount(ctx); err != nil {
		return err
	}
	fmt.Printf(">> cluster of %d node(s) ready in %v; kubeconfig: %s\n", len(c.nodes), time.Since(start).Round(100*time.Millisecond), c.path("admin.kubeconfig"))
	return nil
}

// saveState records what down, outage and the node commands need: the
// binaries' directory and the number of nodes.
func (c *cluster) saveState() error {
	if err := os.WriteFile(c.path("bin"), []byte(c.bin), 0o644); err != nil {
		return err
	}
	return os.WriteFile(c.path("nodes"), []byte(strconv.Itoa(len(c.nodes))), 0o644)
}

// loadState reads what saveState recorded; a cluster that recorded no node
// count has one node.
func (c *cluster) loadState() error {
	bin, err := os.ReadFile(c.path("bin"))
	if err != nil {
		return fmt.Errorf("no cluster recorded in %s: %w", c.dir, err)
	}
	c.bin = string(bin)
	count := 1
	if b, err := os.ReadFile(c.path("nodes")); err == nil {
		if count, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil || count < 1 || count > maxNodes {
			return fmt.Errorf("%s: not a node count from 1 to %d: %q", c.path("nodes"), maxNodes, b)
		}
	}
	c.nodes = nodesOf(count)
	return nil
}

// step is one component of the node: how it is started and when it is
// ready.
type step struct {
	name  string
	args  []string
	ready func(context.Context) error
}

// controlPlane are the control plane's components, in the order they
// start, all on the first node.
func (c *cluster) controlPlane() []step {
	pki := func(f string) string { return c.path("pki", f) }
	return []step{
		{"etcd", []string{"--name", "default", "--data-dir", c.path("etcd"),
			"--listen-client-urls", etcdClient, "--advertise-client-urls", etcdClient,
			"--listen-peer-urls", etcdPeer, "--initial-advertise-peer-urls", etcdPeer,
			"--initial-cluster", "default=" + etcdPeer, "--unsafe-no-fsync"},
			httpReady(etcdClient+"/health", nil)},
		{"kube-apiserver", []string{"--etcd-servers", etcdClient,
			"--bind-address", nodeIP, "--advertise-address", nodeIP, "--secure-port", apiPort,
			"--service-cluster-ip-range", serviceCIDR, "--client-ca-file", pki("ca.crt"),
			"--tls-cert-file", pki("apiserver.crt"), "--tls-private-key-file", pki("apiserver.key"),
			"--service-account-key-file", pki("sa.pub"), "--service-account-signing-key-file", pki("sa.key"),
			"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
			"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
			"--kubelet-client-certificate", pki("apiserver-kubelet-client.crt"), "--kubelet-client-key", pki("apiserver-kubelet-client.key"),
			"--kubelet-preferred-address-types", "InternalIP", "--allow-privileged", "--cert-dir", c.path("pki", "apiserver-generated")},
			c.apiReady},
		{"kube-controller-manager", []string{"--kubeconfig", c.path("controller-manager.kubeconfig"),
			"--authentication-kubeconfig", c.path("controller-manager.kubeconfig"), "--authorization-kubeconfig", c.path("controller-manager.kubeconfig"),
			"--bind-address", "127.0.0.1", "--leader-elect=false", "--use-service-account-credentials",
			"--service-account-private-key-file", pki("sa.key"), "--root-ca-file", pki("ca.crt"),
			"--cluster-signing-cert-file", pki("ca.crt"), "--cluster-signing-key-file", pki("ca.key"),
			"--flex-volume-plugin-dir", c.path("kubelet", "flex"), "--cert-dir", c.path("pki", "controller-manager-generated")},
			httpReady("https://127.0.0.1:10257/healthz", nil)},
		{"kube-scheduler", []string{"--kubeconfig", c.path("scheduler.kubeconfig"),
			"--authentication-kubeconfig", c.path("scheduler.kubeconfig"), "--authorization-kubeconfig", c.path("scheduler.kubeconfig"),
			"--bind-address", "127.0.0.1", "--leader-elect=false", "--cert-dir", c.path("pki", "scheduler-generated")},
			httpReady("https://127.0.0.1:10259/healthz", nil)},
	}
}

// outage stops kube-apiserver for d and starts it again as up started it,
// as an API server upgrade or a control-plane node reboot would.
func (c *cluster) outage(d time.Duration) error {
	if err := c.loadState(); err != nil {
		return err
	}
	const name = "kube-apiserver"
	if err := c.stop(name); err != nil {
		return err
	}
	fmt.Printf(">> %s stopped for %v\n", name, d)
	time.Sleep(d)
	for _, s := range c.controlPlane() {
		if s.name != name {
			continue
		}
		t := time.Now()
		if err := c.start(c.nodes[0], s.name, s.args); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := waitFor(ctx, s.name, s.ready); err != nil {
			return fmt.Errorf("%w (log: %s)", err, c.path("logs", s.name+".log"))
		}
		fmt.Printf(">> %s ready again in %v\n", name, time.Since(t).Round(10*time.Millisecond))
	}
	return nil
}

// installPackages installs the Debian packages the node needs when missing.
func installPackages() error {
	var missing []string
	seen := map[string]bool{}
	for file, pkg := range packages {
		if _, err := os.Stat(file); err != nil && !seen[pkg] {
			seen[pkg] = true
			missing = append(missing, pkg)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	fmt.Printf(">> installing Debian packages: %s\n", strings.Join(missing, " "))
	install := func() error {
		cmd := exec.Command("apt-get", append([]string{"install", "-y", "--no-install-recommends"}, missing...)...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("apt-get install %s: %w\n%s", strings.Join(missing, " "), err, out)
		}
		return nil
	}
	if install() == nil {
		return nil
	}
	if out, err := exec.Command("apt-get", "update").CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get update: %w\n%s", err, out)
	}
	return install()
}

// network creates the bridge with the first node's address, routes the
// Service range onto it, and adds the guard table: nothing the cluster's
// links carry is forwarded to another interface of the host.
func (c *cluster) network() error {
	links := []string{bridgeName}
	for _, nd := range c.nodes[1:] {
		links = append(links, nd.uplink)
	}
	set := "{ " + strings.Join(links, ", ") + " }"
	cmds := [][]string{
		{"ip", "link", "add", bridgeName, "type", "bridge"},
		{"ip", "addr", "add", nodeIP + "/24", "dev", bridgeName},
		{"ip", "link", "set", bridgeName, "up"},
		{"ip", "route", "add", serviceCIDR, "dev", bridgeName},
		{"nft", "add", "table", "inet", guardTable},
		{"nft", "add", "chain", "inet", guardTable, "forward", "{ type filter hook forward priority -10 ; policy accept ; }"},
		{"nft", "add", "rule", "inet", guardTable, "forward", "iifname", set, "oifname", "!=", set, "counter", "drop"},
	}
	for _, args := range cmds {
		if err := run(args...); err != nil {
			return err
		}
	}
	return nil
}

// writeConfigs writes the node's configuration files.
func (c *cluster) writeConfigs(nd node) error {
	kubeletName := "tally"
	if nd.n > 1 {
		kubeletName = nd.name
	}
	files := map[string]string{
		"containerd.toml": fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = %[3]q

[plugins."io.containerd.internal.v1.opt"]
  path = %[4]q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[5]q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %[6]q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
`, nd.dir(c, "containerd", "root"), filepath.Join(runDir, nd.component("containerd")), nd.socket(), nd.dir(c, "containerd", "opt"), c.sandboxImage, nd.dir(c, "cni")),
		"cni/10-tally.conflist": fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": %q,
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q, "rangeStart": %q, "gateway": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
`, kubeletName, bridgeName, nd.dir(c, "cni", "ipam"), nd.podCIDR, strings.TrimSuffix(nd.gateway, ".1")+".10", nd.gateway),
		"kubelet.yaml": fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# The hosts run cgroup v1, which kubelet refuses by default since 1.35.
failCgroupV1: false
cgroupDriver: cgroupfs
# Without CAP_SYS_RESOURCE no process may lower its oom_score_adj.
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%s
address: %s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %q}
authorization: {mode: Webhook}
podLogsDir: %q
volumePluginDir: %q
failSwapOn: false
clusterDomain: cluster.local
evictionHard: {memory.available: 100Mi, nodefs.available: 1%%, imagefs.available: 1%%, nodefs.inodesFree: 1%%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 250
cgroupRoot: %s
`, nd.socket(), nd.ip, c.path("pki", "ca.crt"), nd.dir(c, "kubelet", "pod-logs"), nd.dir(c, "kubelet", "volume-plugins"), nd.cgroupRoot()),
		"kube-proxy.yaml": fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: %q}
hostnameOverride: %s
clusterCIDR: %s
detectLocalMode: ClusterCIDR
healthzBindAddress: %s:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [%s/32]
# Leave the host's conntrack sysctls alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}
`, c.path("kube-proxy.kubeconfig"), nd.name, nd.podCIDR, nd.healthzAddress(), nd.ip),
	}
	for name, content := range files {
		path := nd.dir(c, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// containerdSocket is where containerd serves, for the kubelet and ctr.
const containerdSocket = runDir + "/containerd.sock"

// start runs a component of node nd in its own session, so that it
// outlives this command, with its output in logs/<name>.log and its PID in
// pids/<name>; in the node's network namespace if it has one.
func (c *cluster) start(nd node, name string, args []string) error {
	bin := filepath.Join(c.bin, binary(name))
	if binary(name) == "containerd" {
		bin = "/usr/bin/containerd"
	}
	if nd.netns != "" {
		// nsenter enters the namespace and execs bin: the PID is bin's.
		args = append([]string{"--net=" + filepath.Join("/run/netns", nd.netns), "--", bin}, args...)
		bin = "/usr/bin/nsenter"
	}
	log, err := os.OpenFile(c.path("logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", name, err)
	}
	if err := os.WriteFile(c.path("pids", name), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		return err
	}
	return cmd.Process.Release()
}

// load imports image archives into the Kubernetes namespace of node nd's
// containerd.
func (c *cluster) load(nd node, images []string) error {
	for _, img := range images {
		if err := run("ctr", "--address", nd.socket(), "--namespace", "k8s.io", "images", "import", "--no-unpack", img); err != nil {
			return err
		}
	}
	return nil
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
