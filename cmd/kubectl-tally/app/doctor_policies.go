package app

import (
	"context"
	"slices"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// policiesCheck checks that the chart's ValidatingAdmissionPolicies are
// installed and bound.
type policiesCheck struct{}

func (policiesCheck) name() string { return "admission policies" }

func (c policiesCheck) run(ctx context.Context, d *doctor) Check {
	name := c.name()
	sel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + d.release}
	policies, err := d.cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().List(ctx, sel)
	if err != nil {
		return fail(name, "", "listing ValidatingAdmissionPolicies: %v", err)
	}
	bindings, err := d.cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().List(ctx, sel)
	if err != nil {
		return fail(name, "", "listing ValidatingAdmissionPolicyBindings: %v", err)
	}
	if len(policies.Items) == 0 {
		return fail(name, "helm upgrade to a chart version that installs them", "no ValidatingAdmissionPolicy of release %s: tally's keys on pods/status and the aggregator's pod writes are not guarded", d.release)
	}
	var names, unbound []string
	for _, p := range policies.Items {
		names = append(names, p.Name)
		if !slices.ContainsFunc(bindings.Items, func(b admissionregistrationv1.ValidatingAdmissionPolicyBinding) bool {
			return b.Spec.PolicyName == p.Name
		}) {
			unbound = append(unbound, p.Name)
		}
	}
	if len(unbound) > 0 {
		return fail(name, "helm upgrade the chart", "ValidatingAdmissionPolicy %s has no binding: it is not enforced", strings.Join(unbound, ", "))
	}
	return ok(name, "%s bound", strings.Join(names, ", "))
}
