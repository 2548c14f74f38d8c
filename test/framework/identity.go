package framework

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
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// The release the suites and the demo stand for: the chart installed as
// "tally" in "tally-system". The webhook registration and the chart's
// policy name the aggregator by its service account's username.
const (
	Release          = "tally"
	ReleaseNamespace = "tally-system"
	AggregatorUser   = "system:serviceaccount:" + ReleaseNamespace + ":tally-aggregator"
)

// AggregatorIdentity provisions a client certificate for AggregatorUser, so
// that an aggregator run with it is the one the webhook registration exempts
// and the chart's policy fences.
func (e *Env) AggregatorIdentity() (*envtest.AuthenticatedUser, error) {
	user, err := e.AddUser(envtest.User{Name: AggregatorUser, Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return nil, fmt.Errorf("provisioning the aggregator's identity: %w", err)
	}
	return user, nil
}

// WriteKubeconfig writes user's kubeconfig to path.
func WriteKubeconfig(user *envtest.AuthenticatedUser, path string) error {
	data, err := user.KubeConfig()
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}

// KubeconfigAs writes to path a copy of the kubeconfig admin that
// impersonates the service account ns/sa, as a component of the chart runs.
func KubeconfigAs(admin []byte, ns, sa, path string) error {
	cfg, err := clientcmd.Load(admin)
	if err != nil {
		return err
	}
	for _, auth := range cfg.AuthInfos {
		auth.Impersonate = "system:serviceaccount:" + ns + ":" + sa
		auth.ImpersonateGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	}
	return clientcmd.WriteToFile(*cfg, path)
}

// InstallPolicies installs the chart's ValidatingAdmissionPolicies and
// their bindings, rendered for Release: the fence on the aggregator's pod
// writes, and the guard of tally's keys on pods/status and pods/binding.
func (e *Env) InstallPolicies(ctx context.Context) error {
	manifest, err := Helm("template", Release, Path("charts", "tally"), "--namespace", ReleaseNamespace, "--show-only", "templates/policy.yaml")
	if err != nil {
		return err
	}
	objs, err := Objects(manifest)
	if err != nil {
		return err
	}
	for _, obj := range objs {
		if err := e.Client.Create(ctx, obj); err != nil {
			return fmt.Errorf("creating %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}

// Helm runs the helm binary (HelmBinary) and returns its output.
func Helm(args ...string) (string, error) {
	cmd := exec.Command(HelmBinary(), args...)
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
