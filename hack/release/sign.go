package main

import (
	"fmt"
	"os"
	"path/filepath"
)

// offlineSigningConfig is a Sigstore signing config that names no
// certificate authority, transparency log or timestamp authority: signing
// with a key then reaches no service (cosign's default config, fetched from
// Sigstore's TUF repository, would upload every signature to the public
// Rekor log).
const offlineSigningConfig = `{"mediaType":"application/vnd.dev.sigstore.signingconfig.v0.2+json","caUrls":[],"oidcUrls":[],"rekorTlogUrls":[],"tsaUrls":[],"rekorTlogConfig":{"selector":"ANY"},"tsaConfig":{"selector":"ANY"}}` + "\n"

// signer signs a release's files, image and chart with cosign, and attaches
// attestations to the image. With a key (a file, or a KMS URI cosign
// understands) nothing leaves the machine but what is pushed to the
// registry: no transparency log, so a verifier passes
// --insecure-ignore-tlog=true with the public key. Without one it signs
// keyless, cosign's default: a certificate from Sigstore's Fulcio for the
// OIDC identity of the run (the release workflow's), each signature
// recorded in Sigstore's Rekor log.
type signer struct {
	cosign, key string
	// plainHTTP: the registry speaks HTTP (a local test registry).
	plainHTTP bool
}

// signBlob signs file and writes a Sigstore bundle (signature, and the
// certificate and log entry when keyless) to bundle.
func (s signer) signBlob(file, bundle string) error {
	args, done, err := s.args("sign-blob", "--bundle", bundle)
	if err != nil {
		return err
	}
	defer done()
	return run(filepath.Dir(file), nil, s.cosign, append(args, file)...)
}

// signImage signs the manifest or index ref names (by digest), storing the
// signature in the registry as an OCI referrer of it.
func (s signer) signImage(ref string) error {
	args, done, err := s.args("sign")
	if err != nil {
		return err
	}
	defer done()
	return run(".", nil, s.cosign, append(s.registryArgs(args), ref)...)
}

// attest signs an in-toto statement whose subject is ref (by digest) and
// whose predicate, of predicateType (cosign's short names: spdxjson,
// slsaprovenance1), is the file predicate, and stores it as an OCI referrer
// of ref.
func (s signer) attest(ref, predicateType, predicate string) error {
	args, done, err := s.args("attest", "--type", predicateType, "--predicate", predicate)
	if err != nil {
		return err
	}
	defer done()
	return run(".", nil, s.cosign, append(s.registryArgs(args), ref)...)
}

// args returns cosign's arguments for a signing command: the key and an
// offline signing config, or nothing for keyless; done removes the config.
func (s signer) args(cmd string, extra ...string) (args []string, done func(), err error) {
	args = append([]string{cmd, "--yes"}, extra...)
	if s.key == "" {
		return args, func() {}, nil
	}
	f, err := os.CreateTemp("", "tally-signing-config-*.json")
	if err != nil {
		return nil, nil, err
	}
	done = func() { os.Remove(f.Name()) }
	if _, err := f.WriteString(offlineSigningConfig); err != nil {
		f.Close()
		done()
		return nil, nil, err
	}
	if err := f.Close(); err != nil {
		done()
		return nil, nil, err
	}
	return append(args, "--key", s.key, "--signing-config", f.Name()), done, nil
}

func (s signer) registryArgs(args []string) []string {
	if s.plainHTTP {
		return append(args, "--allow-http-registry")
	}
	return args
}

// describe says how the release is signed, for the summary.
func (s signer) describe() string {
	if s.key == "" {
		return "keyless (Sigstore: Fulcio certificate, Rekor log)"
	}
	return fmt.Sprintf("with the key %s (no transparency log)", s.key)
}
