// Package helm runs the helm binary on tally's chart for the demo and the
// suites: the release they stand for, the values they install it with, and
// the chart's admission policies rendered for a bare control plane.
package helm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/internal/repo"
)

// The release the suites and the demo stand for: the chart installed as
// "tally" in "tally-system". The webhook registration and the chart's
// policy name the aggregator by its service account's username.
const (
	Release        = "tally"
	Namespace      = "tally-system"
	AggregatorUser = "system:serviceaccount:" + Namespace + ":tally-aggregator"
)

// Chart returns the path of the chart in the source tree.
func Chart() string { return repo.Path("charts", "tally") }

// Binary returns the path of the helm binary: $HELM (the Makefile builds
// helm into bin/ and exports it), else helm on the PATH.
func Binary() string {
	if h := os.Getenv("HELM"); h != "" {
		return h
	}
	return "helm"
}

// Run runs helm with args and returns its output.
func Run(args ...string) (string, error) {
	cmd := exec.Command(Binary(), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// Objects decodes a rendered manifest into its objects.
func Objects(manifest string) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(manifest), 4096)
	var objs []*unstructured.Unstructured
	for {
		u := &unstructured.Unstructured{}
		err := dec.Decode(&u.Object)
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("decoding manifest: %w", err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

// InstallPolicies creates the chart's ValidatingAdmissionPolicies and their
// bindings, rendered for Release: the fence on the aggregator's pod writes,
// and the guard of tally's keys on pods/status and pods/binding. It is how
// a control plane without the chart gets the policies the chart installs.
func InstallPolicies(ctx context.Context, c client.Client) error {
	manifest, err := Run("template", Release, Chart(), "--namespace", Namespace, "--show-only", "templates/policy.yaml")
	if err != nil {
		return err
	}
	objs, err := Objects(manifest)
	if err != nil {
		return err
	}
	for _, obj := range objs {
		if err := c.Create(ctx, obj); err != nil {
			return fmt.Errorf("creating %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}
