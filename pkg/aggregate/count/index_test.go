package count

import (
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
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

// TestIndexes: the indexers of several namespaces read as one: an index
// lookup gathers every namespace's, a key goes to its namespace's, and a
// namespace not watched holds nothing.
func TestIndexes(t *testing.T) {
	ix := Indexes{}
	for _, ns := range []string{"a", "b"} {
		indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, Indexers)
		for _, name := range []string{"p1", "p2"} {
			pod := &Pod{Meta: Meta{Name: name, Namespace: ns, UID: types.UID(ns + name)}, ParentUID: "parent", Controller: Controller{UID: "parent"}}
			assert.NoError(t, indexer.Add(pod))
		}
		ix[ns] = indexer
	}
	pods, err := PodsOf(ix, "parent")
	assert.NoError(t, err)
	assert.Len(t, pods, 4)
	obj, ok, err := ix.GetByKey("b/p2")
	assert.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, types.UID("bp2"), obj.(*Pod).UID)
	_, ok, err = ix.GetByKey("c/p1")
	assert.NoError(t, err)
	assert.False(t, ok, "a namespace not watched")
	_, _, err = ix.GetByKey("a/b/c")
	assert.Error(t, err)
}
