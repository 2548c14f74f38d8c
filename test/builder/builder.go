// Package builder builds the pods and parents that tally's unit and
// integration tests create. It holds no Kubernetes client.
package builder

import (
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/keys"
)

// PodBuilder builds pods.
type PodBuilder struct{ pod corev1.Pod }

// Pod starts a pod with one container.
func Pod(namespace, name string) *PodBuilder {
	return &PodBuilder{pod: corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "registry.example/worker:1"}}},
	}}
}

// ControlledBy adds a controller ownerReference.
func (b *PodBuilder) ControlledBy(gvk schema.GroupVersionKind, name string, uid types.UID) *PodBuilder {
	b.pod.OwnerReferences = append(b.pod.OwnerReferences, metav1.OwnerReference{
		APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind, Name: name, UID: uid, Controller: ptr.To(true),
	})
	return b
}

// OwnedBy adds an ownerReference that is not the controller.
func (b *PodBuilder) OwnedBy(gvk schema.GroupVersionKind, name string, uid types.UID) *PodBuilder {
	b.pod.OwnerReferences = append(b.pod.OwnerReferences, metav1.OwnerReference{
		APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind, Name: name, UID: uid,
	})
	return b
}

// Label sets a label.
func (b *PodBuilder) Label(k, v string) *PodBuilder {
	if b.pod.Labels == nil {
		b.pod.Labels = map[string]string{}
	}
	b.pod.Labels[k] = v
	return b
}

// Annotation sets an annotation.
func (b *PodBuilder) Annotation(k, v string) *PodBuilder {
	if b.pod.Annotations == nil {
		b.pod.Annotations = map[string]string{}
	}
	b.pod.Annotations[k] = v
	return b
}

// Finalizer adds a finalizer, which keeps a deleted pod terminating.
func (b *PodBuilder) Finalizer(f string) *PodBuilder {
	b.pod.Finalizers = append(b.pod.Finalizers, f)
	return b
}

// Mixed gives the i-th pod of a parent one of the states the counts tell
// apart: every third carries a completion intent, every seventh has
// succeeded (a phase the kubelet sets, through the status).
func (b *PodBuilder) Mixed(i int) *PodBuilder {
	if i%3 == 0 {
		b = b.Annotation(keys.CompletionIntent, "scale-down")
	}
	if i%7 == 0 {
		b = b.Phase(corev1.PodSucceeded)
	}
	return b
}

// ResourceVersion sets the pod's resourceVersion.
func (b *PodBuilder) ResourceVersion(rv string) *PodBuilder {
	b.pod.ResourceVersion = rv
	return b
}

// Phase sets the pod's phase.
func (b *PodBuilder) Phase(p corev1.PodPhase) *PodBuilder {
	b.pod.Status.Phase = p
	return b
}

// Deleting marks the pod's deletion as requested at t.
func (b *PodBuilder) Deleting(t time.Time) *PodBuilder {
	b.pod.DeletionTimestamp = &metav1.Time{Time: t}
	return b
}

// Build returns the pod.
func (b *PodBuilder) Build() *corev1.Pod { return b.pod.DeepCopy() }

// RealisticPod completes b into a pod of about 4 KiB of JSON, as a worker
// pool's pods look: three containers with env, resources, probes and
// volume mounts, volumes, tolerations.
func RealisticPod(b *PodBuilder) *corev1.Pod {
	p := b.Label("app.kubernetes.io/name", "worker").Label("app.kubernetes.io/instance", "pool-a").
		Annotation("prometheus.io/scrape", "true").Build()
	p.APIVersion, p.Kind = "v1", "Pod"
	p.GenerateName = "pool-a-"
	p.Spec.Containers = nil
	for i := range 3 {
		c := corev1.Container{
			Name:    fmt.Sprintf("worker-%d", i),
			Image:   "registry.example/team/worker:v1.42.0@sha256:" + strings.Repeat("ab", 32),
			Command: []string{"/bin/worker", "--queue=jobs", "--concurrency=8"},
			Resources: corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("256Mi")},
				Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
			},
			VolumeMounts:   []corev1.VolumeMount{{Name: "data", MountPath: "/data"}, {Name: "config", MountPath: "/etc/worker", ReadOnly: true}},
			ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(8080)}}},
		}
		for j := range 6 {
			c.Env = append(c.Env, corev1.EnvVar{Name: fmt.Sprintf("WORKER_SETTING_%d", j), Value: fmt.Sprintf("value-%d-%d", i, j)})
		}
		p.Spec.Containers = append(p.Spec.Containers, c)
	}
	p.Spec.Volumes = []corev1.Volume{
		{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "worker-config"}}}},
	}
	p.Spec.ServiceAccountName = "worker"
	p.Spec.NodeSelector = map[string]string{"kubernetes.io/os": "linux"}
	p.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "workers", Effect: corev1.TaintEffectNoSchedule}}
	return p
}
