package podexpr

import (
	"testing"
	"time"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"tally.dev/tally/test/builder"
)

// BenchmarkMatch splits what two custom counts cost on a realistic running
// pod (five conditions, three container statuses): Match, as the aggregator
// calls it on each pod it watches, which reads the typed pod through
// reflection as the expression asks; the same evaluations on the pod
// converted beforehand into the map CEL reads directly (what is left is the
// evaluation alone), with the runtime cost tracking that bounds each
// evaluation (CostLimit) and without it; and that conversion, paid on each
// pod instead.
func BenchmarkMatch(b *testing.B) {
	env, err := newEnv()
	if err != nil {
		b.Fatal(err)
	}
	var programs []*Program
	var untracked []cel.Program
	for _, e := range []string{`has(pod.status.conditions) && ` + ready, `has(pod.status.containerStatuses) && ` + restarted} {
		p, err := Compile(e, "bench")
		if err != nil {
			b.Fatal(err)
		}
		programs = append(programs, p)
		ast, issues := env.Compile(e)
		if issues.Err() != nil {
			b.Fatal(issues.Err())
		}
		prg, err := env.Program(ast)
		if err != nil {
			b.Fatal(err)
		}
		untracked = append(untracked, prg)
	}
	pod := builder.RealisticPod(builder.Pod("ns", "pool-a-00001"))
	pod.Status.Phase = corev1.PodRunning
	since := metav1.NewTime(time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC))
	for _, t := range []corev1.PodConditionType{corev1.PodReadyToStartContainers, corev1.PodInitialized, corev1.PodReady, corev1.ContainersReady, corev1.PodScheduled} {
		pod.Status.Conditions = append(pod.Status.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: since})
	}
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, Ready: true,
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: since}}})
	}
	converted, err := runtime.DefaultUnstructuredConverter.ToUnstructured(pod)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("Match, the typed pod", func(b *testing.B) {
		for b.Loop() {
			for _, p := range programs {
				if _, err := p.Match(pod); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("evaluation alone, on a map built beforehand", func(b *testing.B) {
		for b.Loop() {
			for _, p := range programs {
				if _, _, err := p.prg.Eval(map[string]any{Var: types.DefaultTypeAdapter.NativeToValue(converted)}); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("evaluation alone, without cost tracking", func(b *testing.B) {
		for b.Loop() {
			for _, p := range untracked {
				if _, _, err := p.Eval(map[string]any{Var: types.DefaultTypeAdapter.NativeToValue(converted)}); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("conversion to that map", func(b *testing.B) {
		for b.Loop() {
			if _, err := runtime.DefaultUnstructuredConverter.ToUnstructured(pod); err != nil {
				b.Fatal(err)
			}
		}
	})
}
