package app

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/cli-runtime/pkg/printers"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/pkg/aggregate"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/explain"
	"tally.dev/tally/pkg/keys"
)

func newExplainCommand(o *options) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "explain KIND/NAME | KIND NAME",
		Short: "Show each pod of a parent with its class and why, and tally's counts beside a fresh count",
		Example: `  kubectl tally explain workerpool/workers -n demo
  kubectl tally explain workerpools.example.tally.dev workers -n demo -o json`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			report, err := o.explain(cmd.Context(), args)
			if err != nil {
				return err
			}
			if output == "table" {
				writeReport(o.streams.Out, report, time.Now())
			} else if err := printStructured(o, output, report); err != nil {
				return err
			}
			if !report.Equal {
				return errProblem
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func (o *options) explain(ctx context.Context, args []string) (explain.Report, error) {
	cs, dyn, err := o.clients()
	if err != nil {
		return explain.Report{}, err
	}
	cfg, err := o.config(ctx, cs)
	if err != nil {
		return explain.Report{}, err
	}
	ns, err := o.namespace()
	if err != nil {
		return explain.Report{}, err
	}
	typ, name, err := splitKindName(args)
	if err != nil {
		return explain.Report{}, err
	}
	// The kind as kubectl names it: kind, plural, short name or
	// resource.group.
	mapper, err := o.flags.ToRESTMapper()
	if err != nil {
		return explain.Report{}, err
	}
	gvk, err := kindFor(mapper, typ)
	if err != nil {
		return explain.Report{}, err
	}
	var parent *config.Parent
	var tracked []string
	for i, p := range cfg.Parents {
		if p.GroupKind() == gvk.GroupKind() {
			parent = &cfg.Parents[i]
		}
		tracked = append(tracked, p.GroupKind().String())
	}
	if parent == nil {
		return explain.Report{}, fmt.Errorf("%s is not a kind tally tracks (tracked: %s)", gvk.GroupKind(), strings.Join(tracked, ", "))
	}
	// The version the aggregator writes, which maps the status fields.
	mapping, err := mapper.RESTMapping(parent.GroupKind(), parent.Version)
	if err != nil {
		return explain.Report{}, err
	}
	obj, err := dyn.Resource(mapping.Resource).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return explain.Report{}, err
	}
	pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return explain.Report{}, fmt.Errorf("listing the pods of namespace %s: %w", ns, err)
	}
	report := explain.Explain(obj, *parent, pods.Items)
	if parent.Tracked() {
		if report.Uncounted, err = uncounted(ctx, cs, ns, "involvedObject.uid="+string(obj.GetUID())); err != nil {
			return explain.Report{}, err
		}
	}
	return report, nil
}

// uncountedReasons are the reasons of the Events the aggregator sends when
// it releases pods without counting them in the totals.
var uncountedReasons = []string{"TrackingLost", "TrackingReleasedUncounted"}

// uncounted returns the aggregator's Events of namespace ns (every
// namespace when empty) matching selector that report pods released without
// being counted, as "<time> <reason> <object>: <message>".
func uncounted(ctx context.Context, cs kubernetes.Interface, ns, selector string) ([]string, error) {
	var out []string
	for _, reason := range uncountedReasons {
		sel := "reason=" + reason
		if selector != "" {
			sel += "," + selector
		}
		list, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return nil, fmt.Errorf("listing the Events %s: %w", reason, err)
		}
		for _, e := range list.Items {
			at := e.EventTime.Time
			if at.IsZero() {
				at = e.LastTimestamp.Time
			}
			out = append(out, fmt.Sprintf("%s %s %s %s/%s: %s", at.UTC().Format(time.RFC3339), reason,
				strings.ToLower(e.InvolvedObject.Kind), e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Message))
		}
	}
	slices.Sort(out)
	return out, nil
}

// splitKindName reads KIND/NAME or KIND NAME.
func splitKindName(args []string) (string, string, error) {
	if len(args) == 2 {
		return args[0], args[1], nil
	}
	typ, name, ok := strings.Cut(args[0], "/")
	if !ok || typ == "" || name == "" {
		return "", "", fmt.Errorf("%q: name the parent as KIND/NAME or KIND NAME", args[0])
	}
	return typ, name, nil
}

// kindFor resolves a resource or kind argument as kubectl does.
func kindFor(mapper meta.RESTMapper, arg string) (schema.GroupVersionKind, error) {
	gvr, gr := schema.ParseResourceArg(arg)
	if gvr != nil {
		if gvk, err := mapper.KindFor(*gvr); err == nil {
			return gvk, nil
		}
	}
	gvk, err := mapper.KindFor(gr.WithVersion(""))
	if err != nil {
		return schema.GroupVersionKind{}, fmt.Errorf("the server doesn't have a resource type %q", arg)
	}
	return gvk, nil
}

// writeReport prints the report as kubectl prints tables.
func writeReport(out io.Writer, r explain.Report, now time.Time) {
	fmt.Fprintf(out, "%s %s/%s (%s, uid %s)\n", r.Parent.Kind, r.Parent.Namespace, r.Parent.Name, r.Parent.APIVersion, r.Parent.UID)
	if r.LastWrite != nil {
		fmt.Fprintf(out, "Status last applied by %s at %s (%s ago)\n", aggregate.FieldManager,
			r.LastWrite.UTC().Format(time.RFC3339), now.Sub(r.LastWrite.Time).Round(time.Second))
	} else {
		fmt.Fprintf(out, "Status never applied by %s\n", aggregate.FieldManager)
	}

	fmt.Fprintln(out)
	w := printers.GetNewTabWriter(out)
	fmt.Fprintln(w, "FIELD\tTALLY\tFRESH\t")
	for _, f := range r.Fields {
		tally, mark := "<none>", "≠"
		if f.Tally != nil {
			tally = fmt.Sprint(*f.Tally)
		}
		if f.Equal() {
			mark = "="
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\n", f.Path, tally, f.Fresh, mark)
	}
	w.Flush()
	writeCustom(out, r.Fields)
	for _, u := range r.Unkept {
		fmt.Fprintf(out, "\nCustom count %s (%s): not kept, its field left unwritten (fix the configuration; kubectl tally doctor):\n  %s\n",
			u.Count, u.Path, strings.ReplaceAll(u.Error, "\n", "\n  "))
	}
	if len(r.Compared) > 0 {
		fmt.Fprintln(out, "\nFields the operator keeps, compared with tally's counts (compare):")
		w = printers.GetNewTabWriter(out)
		fmt.Fprintln(w, "FIELD\tOPERATOR\tTALLY\tFRESH\t")
		for _, c := range r.Compared {
			operator, tally, mark := "<not an integer>", "<not written>", "≠"
			if c.Operator != nil {
				operator = fmt.Sprint(*c.Operator)
			}
			if c.TallyPath != "" {
				tally = c.TallyPath + " <none>"
				if c.Tally != nil {
					tally = fmt.Sprintf("%s %d", c.TallyPath, *c.Tally)
				}
			}
			if c.Equal() {
				mark = "="
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\n", c.Path, operator, tally, c.Fresh, mark)
		}
		w.Flush()
	}
	for _, e := range r.Uncompared {
		fmt.Fprintf(out, "\nComparison not made (fix the configuration; kubectl tally doctor):\n  %s\n", strings.ReplaceAll(e, "\n", "\n  "))
	}
	if len(r.Totals) > 0 {
		fmt.Fprintln(out)
		w = printers.GetNewTabWriter(out)
		fmt.Fprintln(w, "TOTAL\tTALLY")
		for _, t := range r.Totals {
			tally := "<none>"
			if t.Tally != nil {
				tally = fmt.Sprint(*t.Tally)
			}
			fmt.Fprintf(w, "%s\t%s\n", t.Path, tally)
		}
		w.Flush()
	}
	if l := r.Ledger; l != nil {
		if l.Error != "" {
			fmt.Fprintf(out, "Ledger %s cannot be read: %s\n", l.Path, l.Error)
		} else {
			fmt.Fprintf(out, "Ledger %s: %d completed and %d unexpected pod(s) recorded, not yet added to the totals.\n", l.Path, l.Completed, l.Unexpected)
		}
	}

	fmt.Fprintln(out)
	if len(r.Pods) == 0 {
		fmt.Fprintln(out, "No pods.")
	} else {
		w = printers.GetNewTabWriter(out)
		if r.Ledger != nil {
			fmt.Fprintln(w, "POD\tCLASS\tSTAMPED\tTRACKING\tWHY")
		} else {
			fmt.Fprintln(w, "POD\tCLASS\tSTAMPED\tWHY")
		}
		for _, p := range r.Pods {
			cols := []string{p.Name, string(p.Class), yesNo(p.Stamped)}
			if r.Ledger != nil {
				cols = append(cols, yesNo(p.Tracking))
			}
			fmt.Fprintln(w, strings.Join(append(cols, p.Reason), "\t"))
		}
		w.Flush()
	}
	if len(r.Uncounted) > 0 {
		fmt.Fprintln(out, "\nPods released without being counted in the totals (the aggregator's Events):")
		for _, line := range r.Uncounted {
			fmt.Fprintf(out, "  %s\n", line)
		}
	}
	if len(r.NotCounted) > 0 {
		fmt.Fprintf(out, "\nLabelled %s=%s but not counted:\n", keys.ParentUID, r.Parent.UID)
		for _, p := range r.NotCounted {
			fmt.Fprintf(out, "  %s: %s\n", p.Name, p.Reason)
		}
	}

	fmt.Fprintln(out)
	for _, c := range r.Compared {
		if !c.Equal() && c.Operator != nil {
			fmt.Fprintf(out, "The operator's %s shows %d, a fresh count of %s pods gives %d: it is %+d off.\n", c.Path, *c.Operator, c.Count, c.Fresh, *c.Operator-c.Fresh)
		}
	}
	if r.Equal {
		fmt.Fprintln(out, "Verdict: EQUAL. Every mapped field equals a fresh count of the parent's pods.")
		return
	}
	var differ []string
	for _, f := range r.Fields {
		switch {
		case f.Tally == nil:
			differ = append(differ, fmt.Sprintf("%s is not set (fresh count %d)", f.Path, f.Fresh))
		case !f.Equal():
			differ = append(differ, fmt.Sprintf("%s shows %d, a fresh count gives %d", f.Path, *f.Tally, f.Fresh))
		}
	}
	if r.Ledger != nil && r.Ledger.Error != "" {
		differ = append(differ, "the ledger cannot be read, so the totals stay as they are until it is fixed")
	}
	fmt.Fprintf(out, "Verdict: DIFFERS. %s.\n", strings.Join(differ, "; "))
	if len(r.Unstamped) > 0 {
		fmt.Fprintf(out, "  %d pod(s) of the parent are not stamped yet (%s): the aggregator's sweep stamps them at its next pass\n"+
			"  (--backfill-interval); until then the fresh count includes them, and tally's built-in counts only once\n"+
			"  the sweep has read them.\n", len(r.Unstamped), strings.Join(r.Unstamped, ", "))
	}
	if r.LastWrite != nil {
		fmt.Fprintf(out, "  tally last applied this status %s ago. A difference that lasts more than a few seconds means\n"+
			"  the aggregator is not writing: run `kubectl tally doctor`.\n", now.Sub(r.LastWrite.Time).Round(time.Second))
	} else {
		fmt.Fprintln(out, "  tally never applied this status: run `kubectl tally doctor`.")
	}
}

// writeCustom lists, for each custom count, the pods its expression
// matches and those it fails on, and whether the aggregator keeps its
// value while pods are unstamped.
func writeCustom(out io.Writer, fields []explain.Field) {
	for _, f := range fields {
		if f.Expression == "" {
			continue
		}
		fmt.Fprintf(out, "\nCustom count %s (%s): %s\n", f.Count, f.Path, f.Expression)
		if len(f.Matching) == 0 {
			fmt.Fprintln(out, "  matches no pod")
		} else {
			fmt.Fprintf(out, "  matches %d pod(s): %s\n", len(f.Matching), strings.Join(f.Matching, ", "))
		}
		if f.WaitsOnUnstamped {
			fmt.Fprintln(out, "  pods of the parent are not stamped: while they are not, the aggregator does not count them, or keeps\n"+
				"  the value shown once its sweep has read them (it cannot evaluate the expression on their metadata)")
		}
		if len(f.Failed) > 0 {
			fmt.Fprintf(out, "  fails on %d pod(s), which it does not count (guard a field a pod may lack with has()):\n", len(f.Failed))
			for i, line := range f.Failed {
				if i == maxFailedShown {
					fmt.Fprintf(out, "    and %d more\n", len(f.Failed)-i)
					break
				}
				fmt.Fprintf(out, "    %s\n", line)
			}
		}
	}
}

// maxFailedShown is how many of a custom count's failures explain prints.
const maxFailedShown = 5

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
