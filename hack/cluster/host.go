package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// sysctls are the kernel settings the kubelet, kube-proxy and the bridge
// plugin may change; down writes back what up found.
var sysctls = []string{
	"vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
	"kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
	"net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding", "net.ipv4.conf.all.route_localnet",
	"net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
	"net.netfilter.nf_conntrack_max", "net.netfilter.nf_conntrack_tcp_timeout_established",
	"net.netfilter.nf_conntrack_tcp_timeout_close_wait", "net.netfilter.nf_conntrack_tcp_be_liberal",
}

// hostPaths are directories the node's components create outside the state
// directory; down removes those that did not exist before.
var hostPaths = []string{"/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd", "/run/netns", "/var/lib/cni", "/etc/cni", "/opt/cni"}

// host is what the cluster may change on the host, recorded before up and
// compared after down.
type host struct {
	Sysctls map[string]string `json:"sysctls"`
	// NFTables are "family name" of every nftables table (iptables-nft's
	// chains live in tables too).
	NFTables []string `json:"nftables"`
	Links    []string `json:"links"`
	Routes   []string `json:"routes"`
	// Cgroups are the first-level directories of every cgroup hierarchy.
	Cgroups []string `json:"cgroups"`
	Mounts  []string `json:"mounts"`
	Paths   []string `json:"paths"`
	// Netns are the named network namespaces (CNI's pod namespaces).
	Netns []string `json:"netns"`
}

func snapshot(c *cluster) (*host, error) {
	h := &host{Sysctls: map[string]string{}}
	for _, key := range sysctls {
		if b, err := os.ReadFile(sysctlPath(key)); err == nil {
			h.Sysctls[key] = strings.TrimSpace(string(b))
		}
	}
	tables, err := output("nft", "list", "tables")
	if err != nil {
		return nil, err
	}
	for _, line := range tables {
		h.NFTables = append(h.NFTables, strings.TrimPrefix(line, "table "))
	}
	links, err := output("ip", "-o", "link", "show")
	if err != nil {
		return nil, err
	}
	for _, line := range links {
		if f := strings.Fields(line); len(f) > 1 {
			h.Links = append(h.Links, strings.SplitN(strings.TrimSuffix(f[1], ":"), "@", 2)[0])
		}
	}
	if h.Routes, err = output("ip", "route", "show", "table", "all"); err != nil {
		return nil, err
	}
	h.Cgroups = cgroupDirs()
	if h.Mounts, err = mounts(); err != nil {
		return nil, err
	}
	for _, p := range hostPaths {
		if _, err := os.Stat(p); err == nil {
			h.Paths = append(h.Paths, p)
		}
	}
	netns, _ := os.ReadDir("/run/netns")
	for _, e := range netns {
		h.Netns = append(h.Netns, e.Name())
	}
	for _, list := range [][]string{h.NFTables, h.Links, h.Routes, h.Cgroups, h.Mounts, h.Netns} {
		slices.Sort(list)
	}
	return h, nil
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

// cgroupDirs lists hierarchy/dir for the first-level directories of each
// mounted cgroup hierarchy (cgroup v1 controllers and the unified one).
func cgroupDirs() []string {
	var dirs []string
	hierarchies, _ := os.ReadDir("/sys/fs/cgroup")
	for _, hier := range hierarchies {
		if !hier.IsDir() {
			continue
		}
		entries, _ := os.ReadDir(filepath.Join("/sys/fs/cgroup", hier.Name()))
		for _, e := range entries {
			if e.IsDir() {
				dirs = append(dirs, hier.Name()+"/"+e.Name())
			}
		}
	}
	return dirs
}

// mounts lists the mount points of this mount namespace.
func mounts() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var points []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) > 4 {
			points = append(points, unescapeMount(f[4]))
		}
	}
	return points, s.Err()
}

func unescapeMount(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

func (h *host) save(path string) error {
	b, err := json.MarshalIndent(h, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

func loadHost(path string) (*host, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	h := &host{}
	return h, json.Unmarshal(b, h)
}

// diff lists how now differs from h, one line per difference.
func (h *host) diff(now *host) []string {
	var out []string
	for key, v := range h.Sysctls {
		if now.Sysctls[key] != v {
			out = append(out, fmt.Sprintf("sysctl %s = %q, was %q", key, now.Sysctls[key], v))
		}
	}
	lists := []struct {
		what        string
		before, now []string
	}{
		{"nftables table", h.NFTables, now.NFTables},
		{"link", h.Links, now.Links},
		{"route", h.Routes, now.Routes},
		{"cgroup", h.Cgroups, now.Cgroups},
		{"mount", h.Mounts, now.Mounts},
		{"path", h.Paths, now.Paths},
		{"network namespace", h.Netns, now.Netns},
	}
	for _, l := range lists {
		for _, x := range l.now {
			if !slices.Contains(l.before, x) {
				out = append(out, fmt.Sprintf("%s %q added", l.what, x))
			}
		}
		for _, x := range l.before {
			if !slices.Contains(l.now, x) {
				out = append(out, fmt.Sprintf("%s %q removed", l.what, x))
			}
		}
	}
	slices.Sort(out)
	return out
}

func output(args ...string) ([]string, error) {
	out, err := exec.Command(args[0], args[1:]...).Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", strings.Join(args, " "), err)
	}
	var lines []string
	for _, line := range strings.Split(string(out), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			lines = append(lines, line)
		}
	}
	return lines, nil
}
