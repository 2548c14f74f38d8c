package app

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"tally.dev/tally/pkg/config"
)

// Check is one doctor check's result.
type Check struct {
	Name string `json:"name"`
	// Result is OK, FAIL, or SKIP (a check that depends on a failed one).
	Result string `json:"result"`
	Detail string `json:"detail"`
	// Fix says what to do about a FAIL.
	Fix string `json:"fix,omitempty"`
}

// The check results.
const (
	OK   = "OK"
	FAIL = "FAIL"
	SKIP = "SKIP"
)

func newDoctorCommand(o *options) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check a tally installation end to end, with a fix for each problem",
		Long: `Check a tally installation end to end: the Kubernetes version, its configuration, the webhook's registration, certificate and
endpoints, the aggregator's lease, each parent kind (served, status subresource, every mapped field in the
CRD's schema with a type that takes what tally writes), finished pods held by the tracking finalizer, the admission policies, and the permissions of
both service accounts.`,
		Example: `  kubectl tally doctor
  kubectl tally doctor --release tally --tally-namespace tally-system -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			checks, err := o.doctor(cmd.Context())
			if err != nil {
				return err
			}
			if output == "table" {
				writeChecks(o.streams.Out, checks)
			} else if err := printStructured(o, output, checks); err != nil {
				return err
			}
			for _, c := range checks {
				if c.Result == FAIL {
					return errProblem
				}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func writeChecks(out io.Writer, checks []Check) {
	for _, c := range checks {
		fmt.Fprintf(out, "%-4s  %s: %s\n", c.Result, c.Name, c.Detail)
		if c.Fix != "" {
			fmt.Fprintf(out, "      fix: %s\n", c.Fix)
		}
	}
}

// doctor runs the checks in order; a check that needs what a failed one
// provides is skipped.
func (o *options) doctor(ctx context.Context) ([]Check, error) {
	cs, dyn, err := o.clients()
	if err != nil {
		return nil, err
	}
	d := &doctor{options: o, cs: cs, dyn: dyn}
	d.run(ctx, versionCheck{}, configCheck{}, registrationCheck{}, endpointsCheck{}, certificateCheck{}, leaseCheck{})
	if d.cfg != nil {
		for _, p := range d.cfg.Parents {
			d.run(ctx, kindCheck{parent: p})
		}
	}
	d.run(ctx, trackingCheck{}, policiesCheck{}, permissionsCheck{})
	return d.results, nil
}

// A check examines one concern of an installation and reports it as one
// result, with a fix when it fails. It reads what the checks before it
// learned from the doctor, and records there what the checks after it need.
type check interface {
	// name names the result.
	name() string
	run(ctx context.Context, d *doctor) Check
}

// doctor is one run of the checks against a cluster.
type doctor struct {
	*options
	cs  kubernetes.Interface
	dyn dynamic.Interface
	// cfg is tally's configuration, once the config check has read it.
	cfg *config.Config
	// webhook is tally's webhook as registered, once the registration check
	// has found it.
	webhook *admissionregistrationv1.MutatingWebhook
	results []Check
}

func (d *doctor) run(ctx context.Context, checks ...check) {
	for _, c := range checks {
		d.results = append(d.results, c.run(ctx, d))
	}
}

func ok(name, format string, args ...any) Check {
	return Check{Name: name, Result: OK, Detail: fmt.Sprintf(format, args...)}
}

func fail(name, fix, format string, args ...any) Check {
	return Check{Name: name, Result: FAIL, Detail: fmt.Sprintf(format, args...), Fix: fix}
}

func skip(name, why string) Check { return Check{Name: name, Result: SKIP, Detail: why} }
