package app

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/servable"
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

func TestSchemaType(t *testing.T) {
	crd := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{"versions": []any{
		map[string]any{"name": "v1", "schema": map[string]any{"openAPIV3Schema": map[string]any{
			"type": "object",
			"properties": map[string]any{"status": map[string]any{
				"type": "object",
				"properties": map[string]any{
					"completing": map[string]any{"type": "integer"},
					"ready":      map[string]any{"type": "string"},
					"ratio":      map[string]any{"type": "number"},
					"either":     map[string]any{"x-kubernetes-int-or-string": true},
					"ledger": map[string]any{"type": "object", "properties": map[string]any{
						"completed":  map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
						"unexpected": map[string]any{"type": "array", "items": map[string]any{"type": "integer"}},
					}},
					"free":  map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true, "properties": map[string]any{"typed": map[string]any{"type": "string"}}},
					"byKey": map[string]any{"type": "object", "additionalProperties": map[string]any{"type": "integer"}},
				},
			}},
		}}},
		map[string]any{"name": "v2", "schema": map[string]any{"openAPIV3Schema": map[string]any{"type": "object"}}},
	}}}}
	tests := []struct {
		version, path, want string
		declared            bool
		accepted            bool
	}{
		{"v1", "status.completing", "integer", true, true},
		{"v1", "status.ready", "integer", true, false},
		{"v1", "status.ratio", "integer", true, true},
		{"v1", "status.either", "integer", true, true},
		{"v1", "status.ledger.completed", servable.Strings, true, true},
		{"v1", "status.ledger.unexpected", servable.Strings, true, false},
		{"v1", "status.ledger.completed", "integer", true, false},
		{"v1", "status.free.anything.below", "integer", true, true},
		{"v1", "status.free.typed", "integer", true, false},
		{"v1", "status.byKey.anything", "integer", true, true},
		{"v1", "status.missing", "integer", false, false},
		{"v2", "status.completing", "integer", false, false},
		{"v3", "status.completing", "integer", false, false},
	}
	for _, tt := range tests {
		declaredAs, ok := schemaType(crd, tt.version, strings.Split(tt.path, "."))
		assert.Equal(t, tt.declared, ok, "%s %s declared", tt.version, tt.path)
		assert.Equal(t, tt.accepted, ok && servable.Mistyped(tt.path, declaredAs, tt.want) == "", "%s %s (%q) takes %s", tt.version, tt.path, declaredAs, tt.want)
	}
}

func TestTrackingGraceOf(t *testing.T) {
	tests := []struct {
		args  []string
		grace time.Duration
		ok    bool
		err   string
	}{
		{args: []string{"/aggregator", "--config=/etc/tally/config.yaml", "--tracking-grace=5m"}, grace: 5 * time.Minute, ok: true},
		{args: []string{"/aggregator", "-tracking-grace=90s"}, grace: 90 * time.Second, ok: true},
		{args: []string{"/aggregator", "--tracking-grace", "1h"}, grace: time.Hour, ok: true},
		{args: []string{"/aggregator", "--leader-elect=true"}},
		{args: []string{"/aggregator", "--", "--tracking-grace=5m"}},
		{args: []string{"/aggregator", "--tracking-grace-extra=5m"}},
		{args: []string{"/aggregator", "--tracking-grace=soon"}, err: `--tracking-grace "soon"`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			grace, ok, err := trackingGraceOf(tt.args)
			if tt.err != "" {
				assert.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.grace, grace)
		})
	}
}
