package aggregate

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/config"
)

// podWriter records the pod patches in order, and fails those of the pods
// named in fail.
type podWriter struct {
	client.Client
	fail map[string]bool
	mu   sync.Mutex
	// patches are "track <name>" or "release <name>".
	patches []string
}

func (w *podWriter) Patch(_ context.Context, obj client.Object, patch client.Patch, _ ...client.PatchOption) error {
	data, err := patch.Data(obj)
	if err != nil {
		return err
	}
	op := "track"
	if strings.Contains(string(data), "deleteFromPrimitiveList") {
		op = "release"
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.patches = append(w.patches, op+" "+obj.GetName())
	if w.fail[obj.GetName()] {
		return errors.New("the API server is throttling")
	}
	return nil
}

// TestWriteFinalizersReleasesFirst: the pods a step releases are released
// before any finalizer is added, and a pod whose patch fails holds up no
// other pod, of either list.
func TestWriteFinalizersReleasesFirst(t *testing.T) {
	p := config.Parent{Group: operator.GVK.Group, Version: operator.GVK.Version, Kind: operator.GVK.Kind,
		Counts: map[config.Count]string{config.UnexpectedTotal: "status.unexpectedTotal"}, Ledger: "status.ledger"}
	pod := func(name string, phase corev1.PodPhase) *count.Pod {
		return &count.Pod{Meta: count.Meta{Namespace: "ns", Name: name, UID: types.UID(name), ResourceVersion: "1"}, Phase: phase}
	}
	step := ledger.Step{
		Track:   []*count.Pod{pod("run-bad", corev1.PodRunning), pod("run-1", corev1.PodRunning)},
		Release: []*count.Pod{pod("done-bad", corev1.PodFailed), pod("done-1", corev1.PodFailed), pod("done-2", corev1.PodFailed)},
	}
	w := &podWriter{fail: map[string]bool{"run-bad": true, "done-bad": true}}
	r := NewReconciler(p, Deps{Writer: w})
	parent := operator.Pool("ns", "pool", 0)
	parent.SetUID("pool-uid")
	_, err := r.writeFinalizers(context.Background(), parent, &step)
	require.Error(t, err)
	assert.ErrorContains(t, err, "run-bad")
	assert.ErrorContains(t, err, "done-bad")

	var releases, tracks []string
	lastRelease, firstTrack := -1, len(w.patches)
	for i, patch := range w.patches {
		op, name, _ := strings.Cut(patch, " ")
		if op == "release" {
			releases, lastRelease = append(releases, name), i
		} else {
			tracks, firstTrack = append(tracks, name), min(firstTrack, i)
		}
	}
	assert.ElementsMatch(t, []string{"done-bad", "done-1", "done-2"}, releases, "every release is tried")
	assert.ElementsMatch(t, []string{"run-bad", "run-1"}, tracks, "every track is tried")
	assert.Less(t, lastRelease, firstTrack, "a finalizer added before the releases: %v", w.patches)
	released := r.releases.of("pool-uid")
	assert.Contains(t, released, types.UID("done-1"))
	assert.NotContains(t, released, types.UID("done-bad"))
}
