package demo

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/podexpr"
)

// customCount is one of the pool's custom counts, as the demo counts it on
// a fresh List: the pool's pods for which its expression is true.
type customCount struct {
	name    config.Count
	program *podexpr.Program
}

func customCounts(p config.Parent) ([]customCount, error) {
	programs, err := p.Programs()
	if err != nil {
		return nil, err
	}
	out := make([]customCount, len(programs))
	for i, prg := range programs {
		out[i] = customCount{name: config.Count(p.CustomCounts[i].Name), program: prg}
	}
	return out, nil
}

// count counts the pods of the parent with UID uid that c matches (an
// expression that fails on a pod does not match it, as in tally).
func (c customCount) count(pods []corev1.Pod, uid types.UID) int64 {
	var n int64
	for i := range pods {
		if ref := metav1.GetControllerOf(&pods[i]); ref == nil || ref.UID != uid {
			continue
		}
		if ok, _ := c.program.Match(&pods[i]); ok {
			n++
		}
	}
	return n
}

// counts returns the counts the snapshot compares: the four, then the
// custom ones.
func (s Snapshot) counts() []config.Count {
	return append(append([]config.Count(nil), config.Counts...), s.Custom...)
}
