package app

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestFinishedAt(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	at := func(d time.Duration) metav1.Time { return metav1.NewTime(t0.Add(d)) }
	ended := func(d time.Duration) corev1.ContainerStatus {
		return corev1.ContainerStatus{State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{FinishedAt: at(d)}}}
	}
	tests := []struct {
		name   string
		pod    corev1.Pod
		want   time.Time
		wantOK bool
	}{
		{
			name: "running",
			pod:  corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{ended(0)}}},
		},
		{
			name: "being deleted: when the deletion was asked for",
			pod: corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: ptr.To(at(30 * time.Second)), DeletionGracePeriodSeconds: ptr.To[int64](30)},
				Status: corev1.PodStatus{Phase: corev1.PodRunning}},
			want: t0, wantOK: true,
		},
		{
			name: "succeeded: its last container's end",
			pod: corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodSucceeded,
				InitContainerStatuses: []corev1.ContainerStatus{ended(-time.Minute)},
				ContainerStatuses:     []corev1.ContainerStatus{ended(time.Second), ended(2 * time.Second), {}}}},
			want: t0.Add(2 * time.Second), wantOK: true,
		},
		{
			name: "failed without container states: its conditions' last change",
			pod: corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodFailed, Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, LastTransitionTime: at(-time.Hour)}, {Type: corev1.PodReady, LastTransitionTime: at(time.Minute)}}}},
			want: t0.Add(time.Minute), wantOK: true,
		},
		{
			name: "failed with nothing to date it",
			pod:  corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodFailed}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := finishedAt(&tt.pod)
			assert.Equal(t, tt.wantOK, ok)
			assert.True(t, tt.want.Equal(got), "finished at %v, want %v", got, tt.want)
		})
	}
}
