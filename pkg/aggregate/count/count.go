package count

import (
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/config"
)

// Counts are the counts of one parent's pods, and its totals.
type Counts struct {
	Completing, Completed, Active, Unexpected int64
	CompletedTotal, UnexpectedTotal           int64
	// Custom are the kind's custom counts, in their order (TallyCustom);
	// CustomPartial reports that they are not known: some pod of the
	// parent could not be evaluated.
	Custom        []int64
	CustomPartial bool
}

// Value returns the value of field f, and whether it is known.
func (c Counts) Value(f config.Field) (int64, bool) {
	if !f.Custom {
		return c.Get(f.Count), true
	}
	if c.CustomPartial || f.Index >= len(c.Custom) {
		return 0, false
	}
	return c.Custom[f.Index], true
}

// Get returns the count named c.
func (c Counts) Get(name config.Count) int64 {
	switch name {
	case config.Completing:
		return c.Completing
	case config.Completed:
		return c.Completed
	case config.Active:
		return c.Active
	case config.Unexpected:
		return c.Unexpected
	case config.CompletedTotal:
		return c.CompletedTotal
	case config.UnexpectedTotal:
		return c.UnexpectedTotal
	}
	return 0
}

// Tally counts the pods of the parent with UID uid in namespace ns. A pod
// belongs to the parent only when it lives in ns and its controller
// ownerReference carries uid; it is found through the keys.ParentUID label,
// so it must carry uid there too. Other pods are ignored.
func Tally(ns string, uid types.UID, pods []*Pod) Counts {
	var c Counts
	for _, pod := range pods {
		if !inParent(pod, ns, uid) {
			continue
		}
		switch Class(pod.Intent, pod.Terminal(), pod.DeletionTimestamp != nil) {
		case config.Completing:
			c.Completing++
		case config.Completed:
			c.Completed++
		case config.Unexpected:
			c.Unexpected++
		default:
			c.Active++
		}
	}
	return c
}

// Members returns the pods of the parent with UID uid in namespace ns: S(P),
// as Tally counts it.
func Members(ns string, uid types.UID, pods []*Pod) []*Pod {
	out := make([]*Pod, 0, len(pods))
	for _, p := range pods {
		if inParent(p, ns, uid) {
			out = append(out, p)
		}
	}
	return out
}

func inParent(pod *Pod, ns string, uid types.UID) bool {
	return pod.Namespace == ns && pod.Controller.UID == uid && pod.ParentUID == uid
}

// Class is the count a pod falls in (SPEC "Counts"): by whether it carries
// a completion intent, has a terminal phase, and is being deleted.
func Class(intent, terminal, terminating bool) config.Count {
	switch {
	case intent && !terminal:
		return config.Completing
	case intent:
		return config.Completed
	case terminal || terminating:
		return config.Unexpected
	}
	return config.Active
}
