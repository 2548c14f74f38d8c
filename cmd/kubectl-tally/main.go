// Command kubectl-tally is tally's kubectl plugin: put it on PATH and run
// `kubectl tally explain KIND/NAME` or `kubectl tally doctor`.
package main

import (
	"os"

	"k8s.io/cli-runtime/pkg/genericiooptions"

	"tally.dev/tally/cmd/kubectl-tally/app"
)

func main() {
	os.Exit(app.Main(os.Args[1:], genericiooptions.IOStreams{In: os.Stdin, Out: os.Stdout, ErrOut: os.Stderr}))
}
