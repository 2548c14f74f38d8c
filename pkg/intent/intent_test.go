package intent

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestValidReason(t *testing.T) {
	tests := map[string]bool{
		"scale-down": true, "a": true, "0": true, "evicted-by-timer-2": true, strings.Repeat("a", 63): true,
		"": false, "Scale-Down": false, "-scale": false, "scale-": false, "scale_down": false,
		"scale down": false, strings.Repeat("a", 64): false, "ünicode": false,
	}
	for reason, valid := range tests {
		t.Run(reason, func(t *testing.T) {
			err := ValidReason(reason)
			if valid {
				assert.NoError(t, err)
			} else {
				assert.ErrorContains(t, err, "is not a valid reason")
			}
		})
	}
}

func TestFinished(t *testing.T) {
	tests := []struct {
		phase    corev1.PodPhase
		deleting bool
		want     bool
	}{
		{corev1.PodPending, false, false},
		{corev1.PodRunning, false, false},
		{"", false, false},
		{corev1.PodSucceeded, false, true},
		{corev1.PodFailed, false, true},
		{corev1.PodPending, true, true},
		{corev1.PodRunning, true, true},
	}
	for _, tc := range tests {
		assert.Equal(t, tc.want, Finished(tc.phase, tc.deleting), "phase %q, deleting %v", tc.phase, tc.deleting)
	}
}

// TestMarkForCompletionRefusesAFinishedPod: a pod the caller sees finished
// is not marked, and no request is sent (the client is nil).
func TestMarkForCompletionRefusesAFinishedPod(t *testing.T) {
	failed := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}, Status: corev1.PodStatus{Phase: corev1.PodFailed}}
	err := MarkForCompletion(context.Background(), nil, failed, "scale-down")
	assert.ErrorIs(t, err, ErrFinished)
	assert.ErrorContains(t, err, "marking pod ns/p (phase Failed)")

	deleting := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "q", DeletionTimestamp: &metav1.Time{}}}
	assert.ErrorIs(t, MarkForCompletion(context.Background(), nil, deleting, "scale-down"), ErrFinished)
}
