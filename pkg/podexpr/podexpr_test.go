package podexpr

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const (
	ready     = `pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`
	restarted = `pod.status.containerStatuses.exists(s, s.restartCount > 0)`
)

func TestCompile(t *testing.T) {
	tests := []struct {
		name, expression string
		// err is a part of the error; "" for none.
		err string
	}{
		{name: "ready", expression: ready},
		{name: "restarted", expression: restarted},
		{name: "guarded", expression: `has(pod.status.conditions) && ` + ready},
		{name: "a label", expression: `pod.metadata.labels["app"] == "web"`},
		{name: "a reserved word as a field", expression: `pod.metadata.namespace == "ns"`},
		{name: "a time, as a string", expression: `has(pod.status.startTime) && timestamp(pod.status.startTime) > timestamp("2026-01-01T00:00:00Z")`},
		{name: "a time not set is null", expression: `pod.status.conditions.exists(c, c.lastProbeTime != null && timestamp(c.lastProbeTime) > timestamp("2026-01-01T00:00:00Z"))`},
		{name: "objects compared", expression: `pod.spec.containers[0] == pod.spec.containers[0]`},
		{name: "kind: a pod from a watch has none", expression: `pod.kind == "Pod"`, err: "undefined field 'kind'"},
		{name: "a quantity, as a string", expression: `pod.spec.containers.exists(c, has(c.resources.limits) && "cpu" in c.resources.limits && quantity(c.resources.limits["cpu"]).isGreaterThan(quantity("1")))`},
		{name: "a Kubernetes library", expression: `pod.metadata.name.matches("^web-")`},
		{name: "empty", expression: " ", err: "is empty"},
		{name: "a field the pod does not have, with its position", expression: `pod.stauts.phase == "Running"`,
			err: "ERROR: parents[0].customCounts[0].expression:1:4: undefined field 'stauts'"},
		{name: "a syntax error", expression: `pod.status.phase ==`, err: "does not compile"},
		{name: "not boolean", expression: `pod.status.phase`, err: "is of type string, not bool"},
		{name: "an int, not bool", expression: `size(pod.spec.containers)`, err: "is of type int, not bool"},
		{name: "too costly", expression: `pod.spec.containers.exists(c, c.env.exists(e, e.value.contains("x")))`, err: "over the limit of 1000000"},
		{name: "an unknown variable", expression: `object.status.phase == "Running"`, err: "undeclared reference to 'object'"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Compile(tt.expression, "parents[0].customCounts[0].expression")
			if tt.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.err)
				return
			}
			require.NoError(t, err)
			assert.LessOrEqual(t, p.Cost, uint64(CostLimit))
		})
	}
}

func TestMatch(t *testing.T) {
	pod := func(mutate func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "ns"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
		mutate(p)
		return p
	}
	readyPod := pod(func(p *corev1.Pod) {
		since := metav1.NewTime(time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC))
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: since},
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: since}}
	})
	notReady := pod(func(p *corev1.Pod) {
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
	})
	noConditions := pod(func(*corev1.Pod) {})
	restartedPod := pod(func(p *corev1.Pod) {
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "a"}, {Name: "b", RestartCount: 2}}
	})
	tests := []struct {
		name, expression string
		pod              *corev1.Pod
		want             bool
		err              bool
	}{
		{name: "ready", expression: ready, pod: readyPod, want: true},
		{name: "not ready", expression: ready, pod: notReady},
		{name: "no conditions: an error, not a match", expression: ready, pod: noConditions, err: true},
		{name: "no conditions, guarded", expression: `has(pod.status.conditions) && ` + ready, pod: noConditions},
		{name: "restarted", expression: restarted, pod: restartedPod, want: true},
		{name: "the namespace", expression: `pod.metadata.namespace == "ns"`, pod: noConditions, want: true},
		{name: "the phase", expression: `pod.status.phase == "Running"`, pod: noConditions, want: true},
		{name: "a time not set is null", pod: readyPod, want: false,
			expression: `pod.status.conditions.exists(c, c.lastProbeTime != null && timestamp(c.lastProbeTime) > timestamp("2026-01-01T00:00:00Z"))`},
		{name: "a time set", pod: readyPod, want: true,
			expression: `pod.status.conditions.exists(c, c.type == "Ready" && timestamp(c.lastTransitionTime) > timestamp("2026-01-01T00:00:00Z"))`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Compile(tt.expression, "test")
			require.NoError(t, err)
			got, err := p.Match(tt.pod)
			if tt.err {
				assert.Error(t, err)
			} else {
				assert.NoError(t, err)
			}
			assert.Equal(t, tt.want, got)
		})
	}
}
