// Command conformance runs the [Conformance] tests of Kubernetes' own
// end-to-end suite on the one-node cluster (make conformance): once without
// tally, then with tally installed by its chart and tracking the example
// WorkerPool kind while pools of it are scaled, marked and churned
// throughout the run, and writes the two results side by side.
//
//	conformance images --e2e E2E.TEST --agnhost AGNHOST --busybox BUSYBOX --curl CURL --pause PAUSE --out DIR
//	conformance run --cluster DIR --e2e E2E.TEST --ginkgo GINKGO --images DIR --out DIR
//
// The suite pulls its images from registry.k8s.io, which this build does not
// reach: images builds agnhost (from the same Kubernetes release, with
// busybox and a minimal curl beside it), busybox (Debian's static build) and
// pause into image archives named under tally.local, and writes the
// KUBE_TEST_REPO_LIST file that points the suite at those names. run imports
// nothing: make conformance loads the archives when it starts the cluster.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	e2e := fs.String("e2e", "", "Kubernetes' e2e.test binary")
	out := fs.String("out", "", "the directory to write to")
	var err error
	switch cmd {
	case "images":
		agnhost := fs.String("agnhost", "", "the agnhost binary, built for linux from the same Kubernetes release")
		busybox := fs.String("busybox", "", "a statically linked busybox binary")
		curl := fs.String("curl", "", "a statically linked curl (hack/conformance/curl)")
		pause := fs.String("pause", "", "the pause binary")
		_ = fs.Parse(args)
		need(fs, "e2e", "agnhost", "busybox", "curl", "pause", "out")
		err = buildImages(*e2e, *agnhost, *busybox, *curl, *pause, *out)
	case "run":
		cluster := fs.String("cluster", ".cluster", "the cluster's state directory (make cluster-up)")
		ginkgo := fs.String("ginkgo", "", "the ginkgo command, the same version e2e.test is built with")
		images := fs.String("images", "", "the directory images wrote (its repo-list.yaml)")
		nodes := fs.Int("nodes", 4, "how many ginkgo processes run the parallel tests")
		passes := fs.String("passes", "without,with", "the passes to run, in order: without (tally not installed), with")
		_ = fs.Parse(args)
		need(fs, "e2e", "ginkgo", "images", "out")
		err = run(runOptions{cluster: *cluster, e2e: *e2e, ginkgo: *ginkgo, images: *images, out: *out, nodes: *nodes, passes: *passes})
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance %s: %v\n", cmd, err)
		os.Exit(1)
	}
}

// need exits naming the first of flags that is not set.
func need(fs *flag.FlagSet, flags ...string) {
	for _, f := range flags {
		if fs.Lookup(f).Value.String() == "" {
			fmt.Fprintf(os.Stderr, "conformance %s: --%s is required\n", fs.Name(), f)
			fs.Usage()
			os.Exit(2)
		}
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: conformance images|run [flags] (conformance <command> -h lists them)")
	os.Exit(2)
}
