// Command gen writes a development CA and a webhook serving certificate:
// ca.crt, tls.crt and tls.key in --dir. It needs no openssl.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"tally.dev/tally/certs/devcert"
)

func main() {
	dir := flag.String("dir", "", "Directory to write ca.crt, tls.crt and tls.key to (required).")
	hosts := flag.String("hosts", "localhost,127.0.0.1", "Comma-separated DNS names and IP addresses the certificate is valid for.")
	validity := flag.Duration("validity", 24*time.Hour, "How long the certificates are valid.")
	flag.Parse()
	if err := run(*dir, strings.Split(*hosts, ","), *validity); err != nil {
		fmt.Fprintln(os.Stderr, "gen:", err)
		os.Exit(1)
	}
}

func run(dir string, hosts []string, validity time.Duration) error {
	if dir == "" {
		return fmt.Errorf("--dir is required")
	}
	ca, err := devcert.NewCA("tally development CA", validity)
	if err != nil {
		return err
	}
	pair, err := ca.Issue(hosts, validity)
	if err != nil {
		return err
	}
	if err := pair.WriteDir(dir); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "ca.crt"), ca.CertPEM, 0o644)
}
