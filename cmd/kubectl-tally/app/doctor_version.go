package app

import (
	"context"

	"tally.dev/tally/internal/version"
)

// versionCheck checks that the API server is a Kubernetes version tally
// supports (version.MinKubernetes).
type versionCheck struct{}

func (versionCheck) name() string { return "Kubernetes version" }

func (c versionCheck) run(_ context.Context, d *doctor) Check {
	name := c.name()
	info, err := d.cs.Discovery().ServerVersion()
	if err != nil {
		return fail(name, "", "reading the API server's version: %v", err)
	}
	if err := version.CheckKubernetes(info.GitVersion); err != nil {
		return fail(name, "upgrade the cluster to Kubernetes "+version.MinKubernetes+" or later", "%v", err)
	}
	return ok(name, "%s (tally supports %s and later)", info.GitVersion, version.MinKubernetes)
}
