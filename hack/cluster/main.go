// Command cluster runs a Kubernetes cluster of one or more nodes on this
// host, built from source (`make cluster-up`, `make cluster-down`,
// `make e2e-cluster`): etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler, and on each node containerd, kubelet and kube-proxy, with
// the pods on private bridges whose traffic is never forwarded to another
// interface of the host. Nodes after the first run in network namespaces
// of their own (node).
//
//	cluster up   --dir D --bin B --sandbox-image REF [--nodes N] --load IMAGE.tar...   start, check, import images
//	cluster down --dir D [--check]                       stop, restore the host
//	cluster load --dir D IMAGE.tar...                    import images into every node's containerd
//	cluster outage --dir D [--for 2m]                    stop kube-apiserver for a while
//	cluster lose-node --dir D --node NAME                kill a node's kubelet, containerd and containers, cut its link
//	cluster join-node --dir D --node NAME                start a lost node again
//
// It needs root on Linux: it creates bridges, network namespaces, routes,
// nftables tables, cgroups and mounts. `up` records what the host looked like first
// (D/host.json); `down` stops every process by PID, removes what the cluster
// added, puts the sysctls back and, with --check, fails if the host differs
// from the record.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// The cluster's fixed names and addresses.
const (
	nodeName = "tally-node"
	// bridgeName carries the pods, and nodeIP on it the API server and
	// kubelet (neither accepts a loopback address).
	bridgeName = "tally0"
	nodeIP     = "10.244.0.1"
	podCIDR    = "10.244.0.0/24"
	// serviceCIDR is routed onto the bridge, so that a ClusterIP kube-proxy
	// has not programmed yet never follows the default route.
	serviceCIDR  = "10.96.0.0/24"
	apiServiceIP = "10.96.0.1"
	apiPort      = "6443"
	etcdClient   = "http://127.0.0.1:23790"
	etcdPeer     = "http://127.0.0.1:23800"
	// runDir holds the sockets: a unix socket path must be short.
	runDir = "/run/tally-cluster"
	// guardTable drops anything forwarded from the bridge to another
	// interface.
	guardTable = "tally_cluster_guard"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	dir := fs.String("dir", ".cluster", "the cluster's state directory (certificates, kubeconfigs, data, logs)")
	bin := fs.String("bin", "", "directory holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy (up)")
	sandbox := fs.String("sandbox-image", "", "the pause image's name; an image given to --load must hold it (up)")
	check := fs.Bool("check", false, "fail if the host differs from what up recorded (down)")
	outageFor := fs.Duration("for", 2*time.Minute, "how long kube-apiserver stays stopped (outage)")
	nodes := fs.Int("nodes", 1, fmt.Sprintf("how many nodes, 1 to %d (up)", maxNodes))
	nodeFlag := fs.String("node", "", "the node's name (lose-node, join-node)")
	var loads stringList
	fs.Var(&loads, "load", "an image archive to import into containerd (up; repeatable)")
	_ = fs.Parse(args)

	if err := preflight(); err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(2)
	}
	abs, err := filepath.Abs(*dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(2)
	}
	c := &cluster{dir: abs, bin: *bin, sandboxImage: *sandbox}
	switch cmd {
	case "up":
		if *bin == "" || *sandbox == "" {
			fmt.Fprintln(os.Stderr, "cluster: up needs --bin and --sandbox-image")
			os.Exit(2)
		}
		if *nodes < 1 || *nodes > maxNodes {
			fmt.Fprintf(os.Stderr, "cluster: --nodes %d: a cluster has 1 to %d nodes\n", *nodes, maxNodes)
			os.Exit(2)
		}
		c.nodes = nodesOf(*nodes)
		err = c.up(append(loads, fs.Args()...))
	case "down":
		err = c.down(*check)
	case "load":
		if err = c.loadState(); err == nil {
			for _, nd := range c.nodes {
				if err = c.load(nd, fs.Args()); err != nil {
					break
				}
			}
		}
	case "outage":
		err = c.outage(*outageFor)
	case "lose-node", "join-node":
		if *nodeFlag == "" {
			fmt.Fprintf(os.Stderr, "cluster: %s needs --node\n", cmd)
			os.Exit(2)
		}
		if err = c.loadState(); err == nil && cmd == "lose-node" {
			err = c.loseNode(*nodeFlag)
		} else if err == nil {
			err = c.joinNode(*nodeFlag)
		}
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cluster up|down|load|outage|lose-node|join-node --dir DIR [flags]")
	os.Exit(2)
}

// preflight refuses before touching anything unless this is Linux and root.
func preflight() error {
	if runtime.GOOS != "linux" {
		return fmt.Errorf("the cluster runs only on Linux (this is %s)", runtime.GOOS)
	}
	if os.Geteuid() != 0 {
		return errors.New("the cluster needs root: it creates bridges, network namespaces, routes, nftables tables, cgroups and mounts (run as root, or use make test, which needs none of this)")
	}
	return nil
}

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }
