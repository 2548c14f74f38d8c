package count

import (
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestIndexHeld(t *testing.T) {
	kind := Controller{Kind: schema.GroupKind{Group: "example.tally.dev", Kind: "WorkerPool"}}
	tests := []struct {
		name        string
		pod         *Pod
		held, track bool
	}{
		{"running, tracked", &Pod{Tracking: true, Phase: corev1.PodRunning, Controller: kind}, false, true},
		{"finished, tracked", &Pod{Tracking: true, Phase: corev1.PodFailed, Controller: kind}, true, true},
		{"being deleted, tracked", &Pod{Tracking: true, Phase: corev1.PodRunning, Controller: kind, Meta: Meta{DeletionTimestamp: &metav1.Time{}}}, true, true},
		{"finished, released", &Pod{Phase: corev1.PodSucceeded, Controller: kind}, false, false},
		{"tracked, of no tracked kind", &Pod{Tracking: true, Phase: corev1.PodSucceeded}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			keys, err := indexHeld(tt.pod)
			assert.NoError(t, err)
			assert.Equal(t, tt.held, len(keys) == 1, "held index")
			keys, err = indexTrackingKind(tt.pod)
			assert.NoError(t, err)
			assert.Equal(t, tt.track, len(keys) == 1, "tracking-kind index")
		})
	}
}
