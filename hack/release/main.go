// Command release builds a tally release and publishes it (`make release`,
// `make publish`).
//
// build writes under dist/ everything a release publishes: the image
// archive (hack/image, tagged <registry>/tally:<version>), the chart
// packaged with its version, appVersion and default image repository set,
// and goreleaser's kubectl-tally archives, SBOMs, krew manifest and
// (.goreleaser.yaml), with the release's notes from CHANGELOG.md,
// release.json, which says where publish puts what, a static install
// manifest (the chart rendered with its defaults), a SLSA provenance
// predicate, and checksums.txt over every file, signed with cosign. The
// same commit and version give byte-identical archives and image. Unless
// told it is a snapshot, build refuses a tree that is not clean or a HEAD
// without the tag v<version>.
//
// publish pushes the image archive and the chart (helm push) to the
// registry release.json names, signs both with cosign, and attests the
// provenance to the image index and each platform's SBOM to its image.
// Credentials come from the Docker config (the image, cosign) and helm's
// registry config (the chart), never from a file of the repository.
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
		fs.BoolVar(&b.snapshot, "snapshot", false, "build what the tree holds: no clean-tree or v<version> tag check (a test or trial build, not a release)")
		fs.StringVar(&b.builderID, "builder-id", "make-release:local", "the provenance's builder.id: who ran the build (the release workflow passes its own URI)")
		fs.StringVar(&b.invocationID, "invocation-id", "", "the provenance's metadata.invocationId (the release workflow passes its run's URL)")
		signFlags(fs, &b.sign)
		_ = fs.Parse(os.Args[2:])
		err = b.build()
	case "publish":
		var p publisher
		fs := flag.NewFlagSet("publish", flag.ExitOnError)
		fs.StringVar(&p.dist, "dist", "dist", "the folder make release wrote")
		fs.StringVar(&p.registry, "registry", "", "the registry the release was built for (checked against release.json; default: that one)")
		fs.StringVar(&p.helm, "helm", "helm", "the helm command")
		fs.BoolVar(&p.plainHTTP, "plain-http", false, "talk to the registry over HTTP (a local test registry)")
		signFlags(fs, &p.sign)
		_ = fs.Parse(os.Args[2:])
		p.sign.plainHTTP = p.plainHTTP
		err = p.publish()
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

// signFlags adds the flags that say how a release is signed.
func signFlags(fs *flag.FlagSet, s *signer) {
	fs.StringVar(&s.cosign, "cosign", "cosign", "the cosign command")
	fs.StringVar(&s.key, "cosign-key", "", "cosign's private key (a file, or a KMS URI), its password in $COSIGN_PASSWORD; empty: keyless (Sigstore's Fulcio and Rekor, an OIDC identity such as the release workflow's)")
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: release build --version x.y.z --registry REGISTRY [flags]\n       release publish [--registry REGISTRY] [flags]")
	os.Exit(2)
}
