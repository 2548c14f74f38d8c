// Command cluster runs a one-node Kubernetes cluster on this host, built
// from source (`make cluster-up`, `make cluster-down`, `make e2e-cluster`):
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd,
// kubelet and kube-proxy, with the pods on a private bridge that never
// forwards to another interface.
//
//	cluster up   --dir D --bin B --sandbox-image REF --load IMAGE.tar...   start, check, import images
//	cluster down --dir D [--check]                       stop, restore the host
//	cluster load --dir D IMAGE.tar...                    import images into containerd
//
// It needs root on Linux: it creates a bridge, routes, nftables tables,
// cgroups and mounts. `up` records what the host looked like first
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
		err = c.up(append(loads, fs.Args()...))
	case "down":
		err = c.down(*check)
	case "load":
		err = c.load(fs.Args())
	case "outage":
		err = c.outage(*outageFor)
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cluster:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cluster up|down|load|outage --dir DIR [flags]")
	os.Exit(2)
}

// preflight refuses before touching anything unless this is Linux and root.
func preflight() error {
	if runtime.GOOS != "linux" {
		return fmt.Errorf("a one-node cluster runs only on Linux (this is %s)", runtime.GOOS)
	}
	if os.Geteuid() != 0 {
		return errors.New("a one-node cluster needs root: it creates a bridge, routes, nftables tables, cgroups and mounts (run as root, or use make test, which needs none of this)")
	}
	return nil
}

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }
