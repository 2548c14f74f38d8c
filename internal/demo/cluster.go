package demo

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
)

// The names a cluster installation uses.
const (
	// OperatorNamespace runs the example operator's Deployment.
	OperatorNamespace = "workerpool-system"
	operatorName      = "workerpool-operator"
	// OperatorImage and WorkerImage are the example's images as make
	// cluster-images tags them.
	OperatorImage = "tally.local/workerpool-operator:dev"
	WorkerImage   = "tally.local/worker:dev"
)

// Cluster is a real cluster (make cluster-up) on which Install puts tally's
// chart and the example operator, each as Deployments of images the node
// already holds.
type Cluster struct {
	// Kubeconfig reaches the cluster as an administrator; Client is built
	// from it.
	Kubeconfig string
	Client     client.Client
	// Values is the chart's values file.
	Values string
	// OperatorImage and WorkerImage are the example operator's and its
	// workers' images; WorkerEnv is passed to every worker.
	OperatorImage, WorkerImage string
	WorkerEnv                  []string
}

// Helm runs helm against the cluster.
func (c *Cluster) Helm(args ...string) (string, error) {
	return helm.Run(append(args, "--kubeconfig", c.Kubeconfig)...)
}

// Install applies the WorkerPool CRD, installs the chart (waiting until its
// Deployments are ready) and runs the example operator.
func (c *Cluster) Install(ctx context.Context) error {
	if err := c.ApplyCRD(ctx); err != nil {
		return err
	}
	if err := c.InstallChart(); err != nil {
		return err
	}
	return c.InstallOperator(ctx)
}

// ApplyCRD applies the WorkerPool CRD.
func (c *Cluster) ApplyCRD(ctx context.Context) error {
	crd, err := os.ReadFile(repo.Path("examples", "workerpool", "crd", "workerpools.yaml"))
	if err != nil {
		return err
	}
	objs, err := helm.Objects(string(crd))
	if err != nil {
		return err
	}
	for _, o := range objs {
		if err := c.Client.Apply(ctx, client.ApplyConfigurationFromUnstructured(o), client.FieldOwner("tally-demo"), client.ForceOwnership); err != nil {
			return fmt.Errorf("applying the WorkerPool CRD: %w", err)
		}
	}
	return nil
}

// InstallChart installs the chart with c.Values, waiting until its
// Deployments are ready.
func (c *Cluster) InstallChart() error {
	_, err := c.Helm("install", helm.Release, helm.Chart(), "--namespace", helm.Namespace,
		"--create-namespace", "-f", c.Values, "--wait", "--timeout", "3m")
	return err
}

// Uninstall removes the operator and the chart.
func (c *Cluster) Uninstall(ctx context.Context) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: OperatorNamespace}}
	if err := client.IgnoreNotFound(c.Client.Delete(ctx, ns)); err != nil {
		return err
	}
	_, err := c.Helm("uninstall", helm.Release, "--namespace", helm.Namespace, "--wait", "--timeout", "3m")
	return err
}

// InstallOperator runs the example operator as a Deployment with the
// permissions it needs: WorkerPools read, pods managed.
func (c *Cluster) InstallOperator(ctx context.Context) error {
	labels := map[string]string{"app.kubernetes.io/name": operatorName}
	args := []string{"--worker-image", c.WorkerImage}
	for _, e := range c.WorkerEnv {
		args = append(args, "--worker-env", e)
	}
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: OperatorNamespace}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: OperatorNamespace, Name: operatorName}},
		&rbacv1.ClusterRole{
			ObjectMeta: metav1.ObjectMeta{Name: operatorName},
			Rules: []rbacv1.PolicyRule{
				{APIGroups: []string{"example.tally.dev"}, Resources: []string{"workerpools"}, Verbs: []string{"get", "list", "watch"}},
				{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch", "create", "patch", "delete"}},
				{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
			},
		},
		&rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: operatorName},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: operatorName},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: OperatorNamespace, Name: operatorName}},
		},
		&appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Namespace: OperatorNamespace, Name: operatorName, Labels: labels},
			Spec: appsv1.DeploymentSpec{
				Replicas: ptr.To[int32](1),
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: labels},
					Spec: corev1.PodSpec{
						ServiceAccountName: operatorName,
						Containers: []corev1.Container{{
							Name: "operator", Image: c.OperatorImage, ImagePullPolicy: corev1.PullNever, Args: args,
							ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(8081)}}},
						}},
					},
				},
			},
		},
	}
	for _, o := range objs {
		if err := c.Client.Create(ctx, o); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating the operator's %T %s: %w", o, o.GetName(), err)
		}
	}
	return WaitDeploymentReady(ctx, c.Client, OperatorNamespace, operatorName, 2*time.Minute)
}

// WaitDeploymentReady waits until a Deployment's rollout is complete: every
// replica updated and available, and no old one left.
func WaitDeploymentReady(ctx context.Context, c client.Client, ns, name string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var d appsv1.Deployment
		err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &d)
		if err == nil {
			want := ptr.Deref(d.Spec.Replicas, 1)
			s := d.Status
			if s.ObservedGeneration >= d.Generation && s.UpdatedReplicas == want && s.AvailableReplicas == want && s.Replicas == want {
				return nil
			}
			err = fmt.Errorf("deployment %s/%s: %d/%d updated, %d available, %d in all", ns, name, s.UpdatedReplicas, want, s.AvailableReplicas, s.Replicas)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %s: %w", timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// WriteClusterValues writes to dir/values.yaml the chart values for the
// one-node cluster: the example WorkerPool with counts mapped (every count
// and both totals when counts is empty), two replicas of each component,
// the image the node imported (never pulled), and more merged over them. It
// returns the file's path.
func WriteClusterValues(dir string, counts []config.Count, more ...map[string]any) (string, error) {
	if len(counts) == 0 {
		counts = slices.Concat(config.Counts, config.Totals)
	}
	return WriteClusterParents(dir, []config.Parent{helm.WorkerPool(counts...)}, more...)
}

// WriteClusterParents is WriteClusterValues with the parents given.
func WriteClusterParents(dir string, parents []config.Parent, more ...map[string]any) (string, error) {
	cluster := map[string]any{
		"image":      map[string]any{"pullPolicy": "Never"},
		"webhook":    map[string]any{"replicas": 2},
		"aggregator": map[string]any{"replicas": 2},
	}
	return helm.WriteValues(dir, parents, append([]map[string]any{cluster}, more...)...)
}
