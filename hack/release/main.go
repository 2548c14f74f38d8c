// Command release builds a tally release and publishes it (`make release`,
// `make publish`).
//
// build writes under dist/ everything a release publishes: the image
// archive (hack/image, tagged <registry>/tally:<version>), the chart
// packaged with its version, appVersion and default image repository set,
// and goreleaser's kubectl-tally archives, SBOMs, krew manifest and
// checksums (.goreleaser.yaml), with the release's notes from CHANGELOG.md
// and release.json, which says where publish puts what. The same commit and
// version give byte-identical archives.
//
// publish pushes the image archive and the chart (helm push) to the
// registry release.json names. Credentials come from the Docker config (the
// image) and helm's registry config (the chart), never from a file of the
// repository.
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
	var err error
	switch os.Args[1] {
	case "build":
		var b builder
		fs := flag.NewFlagSet("build", flag.ExitOnError)
		fs.StringVar(&b.version, "version", "", "the release's version, x.y.z (no leading v)")
		fs.StringVar(&b.registry, "registry", "", "where publish will push: the image to <registry>/tally, the chart to oci://<registry>/charts/tally")
		fs.StringVar(&b.project, "project-url", "", "the project's home page: the image's source label, the krew manifest's homepage")
		fs.StringVar(&b.download, "download-url", "", "where the release's files will be downloaded from: the krew manifest's archives are <download-url>/<file>")
		fs.StringVar(&b.runbook, "runbook-url", "", "the released chart's default runbook URL of its alerts (metrics.prometheusRule.runbookURL; default: the chart's, none)")
		fs.StringVar(&b.root, "root", ".", "the repository's root")
		fs.StringVar(&b.staging, "staging", "bin/release", "a folder for the image and chart before goreleaser runs (emptied first)")
		fs.StringVar(&b.helm, "helm", "helm", "the helm command")
		fs.StringVar(&b.goreleaser, "goreleaser", "goreleaser", "the goreleaser command")
		fs.StringVar(&b.syft, "syft", "syft", "the syft command, which writes the SBOMs")
		_ = fs.Parse(os.Args[2:])
		err = b.build()
	case "publish":
		var p publisher
		fs := flag.NewFlagSet("publish", flag.ExitOnError)
		fs.StringVar(&p.dist, "dist", "dist", "the folder make release wrote")
		fs.StringVar(&p.registry, "registry", "", "the registry the release was built for (checked against release.json; default: that one)")
		fs.StringVar(&p.helm, "helm", "helm", "the helm command")
		fs.BoolVar(&p.plainHTTP, "plain-http", false, "talk to the registry over HTTP (a local test registry)")
		_ = fs.Parse(os.Args[2:])
		err = p.publish()
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: release build --version x.y.z --registry REGISTRY [flags]\n       release publish [--registry REGISTRY] [flags]")
	os.Exit(2)
}
