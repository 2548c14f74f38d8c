package identity

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/keys"
)

func TestStamp(t *testing.T) {
	long := strings.Repeat("a", 64)
	ref := func(apiVersion, kind, name string, controller *bool) metav1.OwnerReference {
		return metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: "u-1", Controller: controller}
	}
	cases := []struct {
		name            string
		refs            []metav1.OwnerReference
		labels          map[string]string
		wantStamped     bool
		wantLabels      map[string]string
		wantAnnotations map[string]string
	}{
		{
			name:            "a custom kind",
			refs:            []metav1.OwnerReference{ref("example.tally.dev/v1", "WorkerPool", "pool-a", ptr.To(true))},
			wantStamped:     true,
			wantLabels:      map[string]string{keys.ParentUID: "u-1", keys.ParentName: "pool-a"},
			wantAnnotations: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-a"},
		},
		{
			name:            "the core group",
			refs:            []metav1.OwnerReference{ref("v1", "ReplicationController", "rc", ptr.To(true))},
			wantStamped:     true,
			wantLabels:      map[string]string{keys.ParentUID: "u-1", keys.ParentName: "rc"},
			wantAnnotations: map[string]string{keys.Parent: "ReplicationController/rc"},
		},
		{
			name:            "a name that is no label value: no name label, a stale one removed",
			refs:            []metav1.OwnerReference{ref("example.tally.dev/v1", "WorkerPool", long, ptr.To(true))},
			labels:          map[string]string{"app": "w", keys.ParentName: "stale"},
			wantStamped:     true,
			wantLabels:      map[string]string{"app": "w", keys.ParentUID: "u-1"},
			wantAnnotations: map[string]string{keys.Parent: "WorkerPool.example.tally.dev/" + long},
		},
		{
			name:            "the controller, not the first owner",
			refs:            []metav1.OwnerReference{ref("v1", "ConfigMap", "cm", nil), ref("batch/v1", "Job", "job", ptr.To(true))},
			wantStamped:     true,
			wantLabels:      map[string]string{keys.ParentUID: "u-1", keys.ParentName: "job"},
			wantAnnotations: map[string]string{keys.Parent: "Job.batch/job"},
		},
		{
			name:       "no controller: unchanged",
			refs:       []metav1.OwnerReference{ref("example.tally.dev/v1", "WorkerPool", "pool-a", ptr.To(false))},
			labels:     map[string]string{"app": "w"},
			wantLabels: map[string]string{"app": "w"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{OwnerReferences: tc.refs, Labels: tc.labels}}
			assert.Equal(t, tc.wantStamped, Stamp(pod))
			assert.Equal(t, tc.wantLabels, pod.Labels)
			assert.Equal(t, tc.wantAnnotations, pod.Annotations)
		})
	}
}

func TestOf(t *testing.T) {
	cases := []struct {
		apiVersion, want string
	}{
		{"example.tally.dev/v1", "WorkerPool.example.tally.dev/p"},
		{"v1", "WorkerPool/p"},
		{"a/b/v1", "WorkerPool.a/b/p"},
		{"/v1", "WorkerPool.//p"}, // no group: not the core group
	}
	for _, tc := range cases {
		assert.Equal(t, tc.want, Of(metav1.OwnerReference{APIVersion: tc.apiVersion, Kind: "WorkerPool", Name: "p"}).String(), tc.apiVersion)
	}
}
