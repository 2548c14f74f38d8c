package demo

import (
	"strings"

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

// unkeptCount is a custom count tally cannot keep (config.CustomCount.Err):
// its field must stay unwritten.
type unkeptCount struct {
	path []string
	err  error
}

// customCounts returns the kind's custom counts, and apart those tally
// cannot keep whose path is a status field no other count maps.
func customCounts(p config.Parent) (kept []customCount, unkept []unkeptCount) {
	mapped := map[string]bool{}
	for _, f := range p.Fields() {
		mapped[strings.Join(f.Path, ".")] = true
	}
	programs, errs := p.Programs()
	for i, prg := range programs {
		c := p.CustomCounts[i]
		if errs[i] != nil {
			if strings.HasPrefix(c.Path, "status.") && !mapped[c.Path] {
				unkept = append(unkept, unkeptCount{path: strings.Split(c.Path, "."), err: errs[i]})
			}
			continue
		}
		kept = append(kept, customCount{name: config.Count(c.Name), program: prg})
	}
	return kept, unkept
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
