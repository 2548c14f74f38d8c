package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"tally.dev/tally/internal/process"
)

// StartProcess runs bin/name with args and a health probe address it
// appends, waits until the process is ready, and stops it when the test
// ends (logging its output if the test failed). It returns the process and
// its probe address.
func StartProcess(t testing.TB, bin, name string, args ...string) (*process.Process, string) {
	t.Helper()
	probe, err := process.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", probe)
	p, err := process.Start(name, filepath.Join(bin, name), t.TempDir(), append(args, "--health-probe-bind-address", addr)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(p.LogPath())
			t.Logf("%s's log:\n%s", name, log)
		}
	})
	if err := p.WaitReady(context.Background(), "http://"+addr+"/readyz"); err != nil {
		t.Fatal(err)
	}
	return p, addr
}

// ChartKinds are the kinds of object the chart creates, as lists.
var ChartKinds = []schema.GroupVersionKind{
	{Group: "apps", Version: "v1", Kind: "DeploymentList"},
	{Version: "v1", Kind: "ServiceList"},
	{Version: "v1", Kind: "ServiceAccountList"},
	{Version: "v1", Kind: "ConfigMapList"},
	{Version: "v1", Kind: "SecretList"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRoleList"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRoleBindingList"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "RoleList"},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "RoleBindingList"},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "MutatingWebhookConfigurationList"},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingAdmissionPolicyList"},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingAdmissionPolicyBindingList"},
	{Group: "policy", Version: "v1", Kind: "PodDisruptionBudgetList"},
	{Group: "networking.k8s.io", Version: "v1", Kind: "NetworkPolicyList"},
}
