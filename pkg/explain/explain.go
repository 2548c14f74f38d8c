// Package explain says why a parent shows the counts it shows: each pod of
// the parent with its class and the reason, the values tally wrote beside a
// fresh count, pods of the parent tally has not stamped yet, and pods
// labelled for the parent that do not count. It is pure: `kubectl tally
// explain` reads the objects and prints the Report.
package explain

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/aggregate/ledger"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/pkg/podexpr"
)

// Report is what explain found for one parent.
type Report struct {
	Parent Parent `json:"parent"`
	// LastWrite is when the aggregator last applied the parent's status, from
	// its managedFields entry; nil if it never did.
	LastWrite *metav1.Time `json:"lastWrite,omitempty"`
	// Fields are the mapped status fields of the counts of the pods that
	// exist, in the fixed order of the counts.
	Fields []Field `json:"fields"`
	// Totals are the mapped cumulative totals: they count pods that may be
	// gone, so no fresh count stands beside them.
	Totals []Total `json:"totals,omitempty"`
	// Ledger, for a kind with totals, is how many finished pods tally has
	// recorded and not yet added to the totals.
	Ledger *Ledger `json:"ledger,omitempty"`
	// Equal reports that every mapped field equals the fresh count.
	Equal bool `json:"equal"`
	// Pods are the parent's pods (S(P): in its namespace, with a controller
	// ownerReference carrying its UID), by name.
	Pods []Pod `json:"pods"`
	// Unstamped names the parent's pods without tally's parent-uid label:
	// the fresh count includes them; tally's built-in counts do once its
	// sweep has read them, and its custom counts wait (WaitsOnUnstamped).
	Unstamped []string `json:"unstamped,omitempty"`
	// NotCounted are pods labelled for the parent that are not its pods.
	NotCounted []NotCounted `json:"notCounted,omitempty"`
	// Uncounted are the aggregator's reports (Warning Events, while the API
	// server keeps them) of the parent's finished pods it released without
	// counting them in the totals.
	Uncounted []string `json:"uncounted,omitempty"`
	// Unkept are the kind's custom counts the aggregator cannot keep
	// (config.CustomCount.Err): it leaves their fields unwritten.
	Unkept []Unkept `json:"unkept,omitempty"`
	// Compared are the fields the parent's operator keeps that tally
	// compares with its counts (shadow mode: the kind's compare), in the
	// order of the counts.
	Compared []Compared `json:"compared,omitempty"`
	// Uncompared are the kind's comparisons the aggregator cannot make
	// (config.Parent.CompareErrs): it leaves them out.
	Uncompared []string `json:"uncompared,omitempty"`
}

// Compared is a field the parent's operator keeps beside tally's count and
// a fresh count.
type Compared struct {
	Count config.Count `json:"count"`
	// Path is the operator's field; Operator its value (absent is 0), nil
	// when it is not an integer.
	Path     string `json:"path"`
	Operator *int64 `json:"operator"`
	// TallyPath is where tally writes the count, empty when it does not;
	// Tally the value it shows, nil if absent.
	TallyPath string `json:"tallyPath,omitempty"`
	Tally     *int64 `json:"tally"`
	Fresh     int64  `json:"fresh"`
}

// Equal reports whether the operator's field holds the fresh count.
func (c Compared) Equal() bool { return c.Operator != nil && *c.Operator == c.Fresh }

// Unkept is a custom count the aggregator cannot keep, and why.
type Unkept struct {
	Count config.Count `json:"count"`
	Path  string       `json:"path"`
	Error string       `json:"error"`
}

// Parent identifies the parent.
type Parent struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Namespace  string    `json:"namespace"`
	Name       string    `json:"name"`
	UID        types.UID `json:"uid"`
}

// Field is one mapped status field beside a fresh count.
type Field struct {
	Count config.Count `json:"count"`
	Path  string       `json:"path"`
	// Tally is the value the parent shows; nil if the field is absent.
	Tally *int64 `json:"tally"`
	Fresh int64  `json:"fresh"`
	// Expression is a custom count's; Matching names the pods it matches,
	// Failed the pods it fails on ("pod: error"), which it does not count.
	Expression string   `json:"expression,omitempty"`
	Matching   []string `json:"matching,omitempty"`
	Failed     []string `json:"failed,omitempty"`
	// WaitsOnUnstamped reports, for a custom count, that the parent has
	// pods tally has not stamped. While they are unstamped, the aggregator
	// does not count them, as for every count, or, once its sweep has read
	// them, keeps the value the parent shows: it cannot evaluate the
	// expression on the metadata the sweep read.
	WaitsOnUnstamped bool `json:"waitsOnUnstamped,omitempty"`
}

// Equal reports whether the parent shows the fresh count.
func (f Field) Equal() bool { return f.Tally != nil && *f.Tally == f.Fresh }

// Total is one mapped cumulative total.
type Total struct {
	Count config.Count `json:"count"`
	Path  string       `json:"path"`
	// Tally is the value the parent shows; nil if the field is absent.
	Tally *int64 `json:"tally"`
}

// Ledger is what the parent's ledger holds, or why it cannot be read.
type Ledger struct {
	Path       string `json:"path"`
	Completed  int    `json:"completed"`
	Unexpected int    `json:"unexpected"`
	Error      string `json:"error,omitempty"`
}

// Pod is one pod of the parent and why it counts where it does.
type Pod struct {
	Name    string       `json:"name"`
	Class   config.Count `json:"class"`
	Reason  string       `json:"reason"`
	Stamped bool         `json:"stamped"`
	// Tracking reports that the pod carries the tracking finalizer: tally
	// has not recorded how it finished yet (or it has not finished).
	Tracking bool `json:"tracking,omitempty"`
}

// NotCounted is a pod labelled for the parent that is not one of its pods.
type NotCounted struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// Explain builds the report for parent, of the tracked kind p, from the pods
// of its namespace (pods elsewhere are ignored).
func Explain(parent *unstructured.Unstructured, p config.Parent, pods []corev1.Pod) Report {
	uid := parent.GetUID()
	r := Report{Parent: Parent{
		APIVersion: parent.GetAPIVersion(), Kind: parent.GetKind(),
		Namespace: parent.GetNamespace(), Name: parent.GetName(), UID: uid,
	}}
	for _, mf := range parent.GetManagedFields() {
		if mf.Manager == aggregate.FieldManager && mf.Operation == metav1.ManagedFieldsOperationApply && mf.Subresource == "status" && mf.Time != nil {
			r.LastWrite = mf.Time
		}
	}
	fresh := map[config.Count]int64{}
	custom := customFields(p)
	rules := mutate.NewMutator([]config.Parent{p}, nil)
	for i := range pods {
		pod := &pods[i]
		if pod.Namespace != parent.GetNamespace() {
			continue
		}
		labelled := pod.Labels[keys.ParentUID] == string(uid)
		ref := metav1.GetControllerOf(pod)
		if ref == nil || ref.UID != uid {
			if labelled {
				r.NotCounted = append(r.NotCounted, NotCounted{Name: pod.Name, Reason: notCountedReason(ref)})
			}
			continue
		}
		class, reason := Classify(pod, rules)
		fresh[class]++
		for _, c := range custom {
			c.match(pod)
		}
		r.Pods = append(r.Pods, Pod{Name: pod.Name, Class: class, Reason: reason, Stamped: labelled,
			Tracking: slices.Contains(pod.Finalizers, keys.TrackingFinalizer)})
		if !labelled {
			r.Unstamped = append(r.Unstamped, pod.Name)
		}
	}
	slices.SortFunc(r.Pods, func(a, b Pod) int { return strings.Compare(a.Name, b.Name) })
	slices.Sort(r.Unstamped)
	slices.SortFunc(r.NotCounted, func(a, b NotCounted) int { return strings.Compare(a.Name, b.Name) })

	r.Equal = true
	for _, f := range p.Fields() {
		var shown *int64
		if v, found, err := unstructured.NestedFieldNoCopy(parent.Object, f.Path...); found && err == nil {
			if n, ok := toInt64(v); ok {
				shown = &n
			}
		}
		if f.Count.Total() {
			r.Totals = append(r.Totals, Total{Count: f.Count, Path: strings.Join(f.Path, "."), Tally: shown})
			continue
		}
		field := Field{Count: f.Count, Path: strings.Join(f.Path, "."), Tally: shown, Fresh: fresh[f.Count]}
		if f.Custom {
			field = custom[f.Index].field
			field.Tally, field.Fresh, field.WaitsOnUnstamped = shown, int64(len(field.Matching)), len(r.Unstamped) > 0
			slices.Sort(field.Matching)
			slices.Sort(field.Failed)
		}
		r.Equal = r.Equal && field.Equal()
		r.Fields = append(r.Fields, field)
	}
	for _, c := range p.Broken() {
		r.Unkept = append(r.Unkept, Unkept{Count: config.Count(c.Name), Path: c.Path, Error: c.Err.Error()})
	}
	r.Compared = compared(parent, p, fresh, custom, r.Fields)
	for _, name := range slices.Sorted(maps.Keys(p.CompareErrs)) {
		r.Uncompared = append(r.Uncompared, p.CompareErrs[name].Error())
	}
	if p.Tracked() {
		r.Ledger = &Ledger{Path: p.Ledger}
		book, err := ledger.ReadBook(parent.Object, p.LedgerPath(), p.Fields())
		if err != nil {
			r.Ledger.Error = err.Error()
			r.Equal = false
		}
		r.Ledger.Completed, r.Ledger.Unexpected = len(book.Completed), len(book.Unexpected)
	}
	return r
}

// compared returns the fields of parent its operator keeps, beside tally's
// fields and the fresh counts: fresh by built-in count, custom the custom
// counts evaluated.
func compared(parent *unstructured.Unstructured, p config.Parent, fresh map[config.Count]int64, custom []*customField, fields []Field) []Compared {
	var out []Compared
	for _, f := range p.CompareFields() {
		c := Compared{Count: f.Count, Path: strings.Join(f.Path, "."), Fresh: fresh[f.Count]}
		if f.Custom {
			c.Fresh = int64(len(custom[f.Index].field.Matching))
		}
		if v, ok := aggregate.OperatorValue(parent, f.Path); ok {
			c.Operator = &v
		}
		for _, shown := range fields {
			if shown.Count == f.Count {
				c.TallyPath, c.Tally = shown.Path, shown.Tally
			}
		}
		out = append(out, c)
	}
	return out
}

// customField is a custom count being evaluated on the parent's pods.
type customField struct {
	field   Field
	program *podexpr.Program
}

// customFields compiles p's custom counts; a count that cannot be kept
// has no program, and no field either (config.Parent.Fields).
func customFields(p config.Parent) []*customField {
	programs, _ := p.Programs()
	out := make([]*customField, len(p.CustomCounts))
	for i, c := range p.CustomCounts {
		out[i] = &customField{field: Field{Count: config.Count(c.Name), Path: c.Path, Expression: c.Expression}, program: programs[i]}
	}
	return out
}

func (c *customField) match(pod *corev1.Pod) {
	if c.program == nil {
		return
	}
	switch ok, err := c.program.Match(pod); {
	case err != nil:
		c.field.Failed = append(c.field.Failed, pod.Name+": "+err.Error())
	case ok:
		c.field.Matching = append(c.field.Matching, pod.Name)
	}
}

func toInt64(v any) (int64, bool) {
	switch n := v.(type) {
	case int64:
		return n, true
	case float64:
		return int64(n), float64(int64(n)) == n
	}
	return 0, false
}

// Classify returns a pod's class, by the aggregator's rule, and why. rules
// are the webhook's, for the pod's parent kind: an intent tally did not
// admit, and will not when it first sees the pod (mutate.Decision.Dropped),
// counts as none.
func Classify(pod *corev1.Pod, rules *mutate.Mutator) (config.Count, string) {
	var why []string
	reason, intent := pod.Annotations[keys.CompletionIntent]
	if intent {
		s := fmt.Sprintf("intent %q", reason)
		if by := pod.Annotations[keys.CompletionIntentBy]; by != "" {
			s += " by " + by
		}
		if at := pod.Annotations[keys.CompletionIntentAt]; at != "" {
			s += " at " + at
		}
		meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, DeletionTimestamp: pod.DeletionTimestamp}
		if d := rules.Decide(context.Background(), mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, OldPhase: pod.Status.Phase}); d.Dropped != "" {
			intent = false
			s += ", not admitted: tally did not admit it on this pod, and " + d.Dropped + " (the sweep removes it)"
		}
		why = append(why, s)
	} else {
		why = append(why, "no intent")
	}
	phase := pod.Status.Phase
	if phase == "" {
		phase = "no phase yet"
	}
	why = append(why, string(phase))
	terminal := pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
	terminating := pod.DeletionTimestamp != nil
	if terminating {
		why = append(why, "terminating since "+pod.DeletionTimestamp.UTC().Format(time.RFC3339))
	}
	return count.Class(intent, terminal, terminating), strings.Join(why, ", ")
}

func notCountedReason(ref *metav1.OwnerReference) string {
	if ref == nil {
		return "the label names this parent but the pod has no controller: a forged or stale label (the webhook resets it on the pod's next update, the aggregator's sweep at its next pass)"
	}
	return fmt.Sprintf("the label names this parent but the pod's controller is %s %s (uid %s): a forged or stale label (the webhook resets it on the pod's next update, the aggregator's sweep at its next pass)", ref.Kind, ref.Name, ref.UID)
}
