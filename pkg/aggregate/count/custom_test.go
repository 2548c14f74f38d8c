package count

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

func TestTallyCustom(t *testing.T) {
	pools := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", CustomCounts: []config.CustomCount{
		{Name: "ready", Path: "status.ready", Expression: `has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")`},
		{Name: "restarted", Path: "status.restarted", Expression: `pod.status.containerStatuses.exists(s, s.restartCount > 0)`},
	}}
	r := NewReducer([]config.Parent{pools})
	pod := func(ready bool, restarts int32) *corev1.Pod {
		p := member().Phase(corev1.PodRunning).Build()
		if ready {
			p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		}
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "c", RestartCount: restarts}}
		return p
	}
	noStatuses := member().Phase(corev1.PodRunning).Build() // restarted fails on it: no match
	other := builder.Pod("ns", "q").ControlledBy(operator.GVK, "other", "uid-other").Label(keys.ParentUID, "uid-other").Build()
	other.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "c", RestartCount: 1}}

	var cached []*Pod
	for _, p := range []*corev1.Pod{pod(true, 0), pod(true, 3), pod(false, 1), pod(false, 0), noStatuses, other} {
		cached = append(cached, r.Pod(p))
	}
	assert.Equal(t, uint32(0b01), cached[0].Matches)
	assert.Equal(t, uint32(0b11), cached[1].Matches)
	assert.Equal(t, uint32(0b10), cached[2].Matches)
	assert.Equal(t, uint32(0), cached[4].Matches)

	counts, partial := TallyCustom("ns", uid, cached, 2)
	assert.Equal(t, []int64{2, 2}, counts, "the other parent's pod is not counted")
	assert.False(t, partial)

	swept := &Pod{Meta: Meta{Name: "s", Namespace: "ns"}, ParentUID: uid, Controller: Controller{UID: uid}, Unevaluated: true}
	_, partial = TallyCustom("ns", uid, append(cached, swept), 2)
	assert.True(t, partial, "a pod read by a sweep, without its status, leaves the custom counts unknown")

	c := Counts{Custom: []int64{2, 2}}
	v, known := c.Value(config.Field{Count: "restarted", Custom: true, Index: 1})
	assert.Equal(t, int64(2), v)
	assert.True(t, known)
	c.CustomPartial = true
	_, known = c.Value(config.Field{Count: "restarted", Custom: true, Index: 1})
	assert.False(t, known)
	v, known = c.Value(config.Field{Count: config.Active})
	assert.Equal(t, int64(0), v)
	assert.True(t, known, "the built-in counts are known whatever the custom ones")
}

// TestAnInvalidCustomCountMatchesNothing checks that a custom count that
// cannot be kept (one of them invalid, in a configuration edited by hand)
// leaves the others counted: it matches no pod, its bit stays clear.
func TestAnInvalidCustomCountMatchesNothing(t *testing.T) {
	cfg, err := config.Parse([]byte(`parents: [{group: example.tally.dev, version: v1, kind: WorkerPool, customCounts: [
  {name: ready, path: status.ready, expression: 'pod.status.ready'},
  {name: running, path: status.running, expression: 'pod.status.phase == "Running"'}]}]`))
	require.NoError(t, err)
	require.Error(t, cfg.Parents[0].CustomCounts[0].Err)
	r := NewReducer(cfg.Parents)
	pod := r.Pod(member().Phase(corev1.PodRunning).Build())
	assert.Equal(t, uint32(0b10), pod.Matches)
}
