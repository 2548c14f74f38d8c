// Package kopf checks the Kopf example (examples/kopf) and the Kopf file in
// docs/frameworks.md: on every machine, that the operator compiles, that the
// docs show exactly that file, that the pods it creates carry the identity
// the webhook would stamp, and that the CRD it runs against declares every
// field tally maps; where Python can import kopf, it runs the
// operator against the demo's control plane (real webhook and aggregator).
package kopf

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/controlplane"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/framework"
)

var (
	operatorFile = repo.Path("examples", "kopf", "operator.py")
	env          *framework.Env
)

// TestMain starts the package's control plane, for the CRD check. Running
// the operator (only where kopf is importable) needs the whole demo, which
// starts its own.
func TestMain(m *testing.M) { os.Exit(framework.Main(m, controlplane.Options{}, &env)) }

// python returns the interpreter the example runs with: $KOPF_PYTHON, else
// python3 on PATH. $KOPF_PATH, when set, is added to its PYTHONPATH (a
// checkout of Kopf's source, as examples/kopf/README.md describes).
func python(args ...string) *exec.Cmd {
	interp := os.Getenv("KOPF_PYTHON")
	if interp == "" {
		interp = "python3"
	}
	cmd := exec.Command(interp, args...)
	cmd.Env = os.Environ()
	if p := os.Getenv("KOPF_PATH"); p != "" {
		cmd.Env = append(cmd.Env, "PYTHONPATH="+p)
	}
	return cmd
}

func TestOperatorCompiles(t *testing.T) {
	out, err := python("-c", "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)",
		operatorFile, filepath.Join(t.TempDir(), "operator.pyc")).CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// newPodScript loads the example with kopf and kubernetes stood in for
// (new_pod uses neither) and prints the pod new_pod builds for a pool named
// argv[1] with UID argv[2].
const newPodScript = `
import importlib.util, json, sys
from unittest import mock
sys.modules["kopf"] = mock.MagicMock()
sys.modules["kubernetes"] = mock.MagicMock()
spec = importlib.util.spec_from_file_location("operator_example", sys.argv[3])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
body = {"metadata": {"name": sys.argv[1], "namespace": "ns", "uid": sys.argv[2]}}
print(json.dumps(example.new_pod(body, sys.argv[1])))
`

// TestNewPodIsStampedAsTheWebhookWould: the pods the Kopf example creates
// carry exactly the identity the webhook derives, so the API server admits
// them without calling it (the webhook would change nothing).
func TestNewPodIsStampedAsTheWebhookWould(t *testing.T) {
	pools := []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool"}}
	for _, name := range []string{"pool-a", strings.Repeat("p", 70)} {
		out, err := python("-c", newPodScript, name, "0b6c7bba-7f07-4f5e-9a30-fb1e3b1e2f1a", operatorFile).Output()
		require.NoError(t, err, "%s", out)
		var pod corev1.Pod
		require.NoError(t, json.Unmarshal(out, &pod), "%s", out)
		meta := &mutate.PodMeta{Namespace: "ns", Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences}
		d := mutate.NewMutator(pools, nil).Decide(context.Background(), mutate.Input{Operation: mutate.Create, User: "kopf", Pod: meta, Now: time.Now()})
		assert.Empty(t, d.Patch, "pool %q: the webhook would patch the example's pod: %s", name, out)
		assert.Empty(t, d.Warnings)
		assert.Equal(t, pod.OwnerReferences[0].UID, d.Parent.UID, "the pod is not the pool's")
	}
}

// TestDocsShowTheExample: the Kopf file in docs/frameworks.md is the
// example, to the byte, so the docs' file runs as the example does.
func TestDocsShowTheExample(t *testing.T) {
	docs, err := os.ReadFile(repo.Path("docs", "frameworks.md"))
	require.NoError(t, err)
	block := regexp.MustCompile("(?s)```python\n(.*?)```").FindSubmatch(docs)
	require.NotNil(t, block, "no python block in docs/frameworks.md")
	file, err := os.ReadFile(operatorFile)
	require.NoError(t, err)
	assert.Equal(t, string(file), string(block[1]), "docs/frameworks.md must show examples/kopf/operator.py as it is")
}

// TestCRDDeclaresMappedFields: the WorkerPool CRD the example runs against
// installs, and its schema declares every status field tally's example
// configuration maps (else the API server prunes them).
func TestCRDDeclaresMappedFields(t *testing.T) {
	cfg, err := config.Load(repo.Path("examples", "workerpool", "config.yaml"))
	require.NoError(t, err)
	var crd apiextensionsv1.CustomResourceDefinition
	require.NoError(t, env.Client.Get(context.Background(), client.ObjectKey{Name: "workerpools.example.tally.dev"}, &crd))
	schema := crd.Spec.Versions[0].Schema.OpenAPIV3Schema
	require.NotNil(t, crd.Spec.Versions[0].Subresources.Status, "the status subresource is not enabled")
	for _, f := range cfg.Parents[0].Fields() {
		props := schema
		for _, part := range f.Path {
			next, ok := props.Properties[part]
			require.True(t, ok, "the CRD does not declare %s", strings.Join(f.Path, "."))
			props = &next
		}
		assert.Equal(t, "integer", props.Type, strings.Join(f.Path, "."))
	}
}

// TestOperatorRunsWithTally runs the example with Kopf against the demo's
// control plane, as the ServiceAccount of examples/kopf/rbac.yaml with
// nothing more: a pool of 4 is created, scaled to 1. The operator ends the
// 3 surplus pods itself: each is marked, then deleted, with no simulated
// kubelet finishing it (the demo's runs marked pods to their end only in
// its own namespace); tally counts them in completedTotal, none in
// unexpectedTotal. The pool's events are the operator's, not one per
// timer run.
func TestOperatorRunsWithTally(t *testing.T) {
	if out, err := python("-c", "import kopf, kubernetes").CombinedOutput(); err != nil {
		framework.Notice("NOT RUN: " + t.Name() + ": Python cannot import kopf and kubernetes: set KOPF_PYTHON and KOPF_PATH as examples/kopf/README.md says")
		t.Skipf("NOT RUN: Python cannot import kopf and kubernetes (%v: %s); set KOPF_PYTHON and KOPF_PATH as examples/kopf/README.md says to run the operator", err, bytes.TrimSpace(out))
	}
	ctx := context.Background()
	bin := t.TempDir()
	require.NoError(t, framework.BuildBinaries(bin, "webhook", "aggregator"))
	d, err := demo.Start(ctx, demo.Options{
		Dir: t.TempDir(), BinDir: bin, ConfigFile: repo.Path("examples", "workerpool", "config.yaml"),
		Duration: time.Minute, Seed: 1, Out: t.Output(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Stop() })
	restCfg, err := clientcmd.BuildConfigFromFlags("", d.Kubeconfig())
	require.NoError(t, err)
	c, err := client.New(restCfg, client.Options{})
	require.NoError(t, err)
	const ns = "kopf-demo" // rbac.yaml's
	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	kubeconfig := serviceAccountKubeconfig(t, c, restCfg, ns)

	// How each pod of the namespace ended.
	var mu sync.Mutex
	var succeeded, deletedUnmarked []string
	deletedMarked := 0
	cs, err := kubernetes.NewForConfig(restCfg)
	require.NoError(t, err)
	w, err := cs.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	go func() {
		for ev := range w.ResultChan() {
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			_, marked := pod.Annotations[keys.CompletionIntent]
			mu.Lock()
			switch {
			case ev.Type == watch.Deleted && marked:
				deletedMarked++
			case ev.Type == watch.Deleted:
				deletedUnmarked = append(deletedUnmarked, pod.Name)
			case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
				succeeded = append(succeeded, pod.Name)
			}
			mu.Unlock()
		}
	}()

	kopf := python("-m", "kopf", "run", "--standalone", "--namespace", ns, operatorFile)
	kopf.Env = append(kopf.Env, "KUBECONFIG="+kubeconfig)
	var log lockedBuffer // read while Kopf writes to it
	kopf.Stdout, kopf.Stderr = &log, &log
	kopf.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, kopf.Start())
	t.Cleanup(func() {
		// Kopf stops its handlers on SIGTERM; one that does not within
		// 20 s is killed.
		_ = kopf.Process.Signal(syscall.SIGTERM)
		stopped := time.AfterFunc(20*time.Second, func() { _ = kopf.Process.Kill() })
		_ = kopf.Wait()
		stopped.Stop()
		if t.Failed() {
			t.Logf("kopf's log:\n%s", log.String())
		}
	})

	pool := operator.Pool(ns, "pool", 4)
	require.NoError(t, c.Create(ctx, pool))
	counts := func() string {
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(operator.GVK)
		if err := c.Get(ctx, client.ObjectKeyFromObject(pool), u); err != nil {
			return err.Error()
		}
		st, _, _ := unstructured.NestedMap(u.Object, "status")
		return fmt.Sprintf("active=%v completing=%v completed=%v unexpected=%v completedTotal=%v unexpectedTotal=%v",
			st["active"], st["completing"], st["completed"], st["unexpected"], st["completedTotal"], st["unexpectedTotal"])
	}
	require.Eventually(t, func() bool { return strings.HasPrefix(counts(), "active=4 completing=0 completed=0 unexpected=0 ") }, 90*time.Second, 200*time.Millisecond,
		"the pool never showed 4 active pods: %s", counts)

	require.NoError(t, c.Patch(ctx, pool, client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"replicas":1}}`))))
	require.Eventually(t, func() bool {
		return counts() == "active=1 completing=0 completed=0 unexpected=0 completedTotal=3 unexpectedTotal=0"
	}, 90*time.Second, 50*time.Millisecond, "the pool never settled at 1 with 3 pods completed: %s", counts)

	var pods corev1.PodList
	require.NoError(t, c.List(ctx, &pods, client.InNamespace(ns)))
	require.Len(t, pods.Items, 1)
	assert.NotContains(t, pods.Items[0].Annotations, keys.CompletionIntent)
	mu.Lock()
	assert.Equal(t, 3, deletedMarked, "the operator deletes each pod it marks")
	assert.Empty(t, deletedUnmarked, "pods deleted without a mark")
	assert.Empty(t, succeeded, "pods a kubelet finished: the operator ends its marked pods itself")
	mu.Unlock()

	// The pool's events are what a person needs to see: the operator's
	// scaling, not Kopf's "Timer 'reconcile' succeeded." on every run.
	time.Sleep(12 * time.Second) // two more runs of the timer
	var events corev1.EventList
	require.NoError(t, c.List(ctx, &events, client.InNamespace(ns)))
	reasons := map[string]bool{}
	for _, e := range events.Items {
		if e.InvolvedObject.UID != pool.GetUID() {
			continue
		}
		reasons[e.Reason] = true
		assert.NotContains(t, e.Message, "succeeded", "Kopf posted a handler's success as an event: %s %s", e.Reason, e.Message)
	}
	assert.True(t, reasons["ScalingUp"] && reasons["ScalingDown"], "the operator's own events are missing: %v", reasons)
	assert.NotContains(t, log.String(), "403", "Kopf was refused a request: rbac.yaml lacks a permission")
}

// serviceAccountKubeconfig applies examples/kopf/rbac.yaml in ns and
// returns a kubeconfig that reaches the API server of restCfg with a token
// of its ServiceAccount, with nothing more.
func serviceAccountKubeconfig(t *testing.T, c client.Client, restCfg *rest.Config, ns string) string {
	t.Helper()
	ctx := context.Background()
	data, err := os.ReadFile(rbacFile)
	require.NoError(t, err)
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var sa string
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		require.NoError(t, c.Create(ctx, u), "%s %s", u.GetKind(), u.GetName())
		if u.GetKind() == "ServiceAccount" {
			require.Equal(t, ns, u.GetNamespace())
			sa = u.GetName()
		}
	}
	require.NotEmpty(t, sa, "rbac.yaml has no ServiceAccount")
	cs, err := kubernetes.NewForConfig(restCfg)
	require.NoError(t, err)
	token, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["demo"] = &clientcmdapi.Cluster{Server: restCfg.Host, CertificateAuthorityData: restCfg.CAData}
	cfg.AuthInfos[sa] = &clientcmdapi.AuthInfo{Token: token.Status.Token}
	cfg.Contexts["kopf"] = &clientcmdapi.Context{Cluster: "demo", AuthInfo: sa, Namespace: ns}
	cfg.CurrentContext = "kopf"
	path := filepath.Join(t.TempDir(), "kopf.kubeconfig")
	require.NoError(t, clientcmd.WriteToFile(*cfg, path))
	return path
}

// lockedBuffer is a bytes.Buffer that a process writes to while the test
// reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
