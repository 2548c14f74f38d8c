package app

import (
	"context"
	"fmt"
	"strings"

	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// permissionsCheck asks the API server (SubjectAccessReview) whether each
// service account may do what its component needs: on pods and parents in
// every namespace, or, with a fixed list of namespaces
// (config.Config.FixedNamespaces), in each of those.
type permissionsCheck struct{}

func (permissionsCheck) name() string { return "permissions" }

// permission is one thing a service account must be allowed to do.
type permission struct {
	sa   string
	attr authorizationv1.ResourceAttributes
}

func (c permissionsCheck) run(ctx context.Context, d *doctor) Check {
	name, cfg := c.name(), d.cfg
	if cfg == nil {
		return skip(name, "no configuration")
	}
	agg, wh := d.release+"-aggregator", d.release+"-webhook"
	within := cfg.FixedNamespaces()
	if within == nil {
		within = []string{metav1.NamespaceAll}
	}
	var need []permission
	for _, ns := range within {
		for _, verb := range []string{"get", "list", "watch", "patch"} {
			need = append(need, permission{agg, authorizationv1.ResourceAttributes{Namespace: ns, Verb: verb, Resource: "pods"}})
		}
	}
	for _, verb := range []string{"get", "update"} {
		need = append(need, permission{agg, authorizationv1.ResourceAttributes{Namespace: d.tallyNamespace, Verb: verb, Group: "coordination.k8s.io", Resource: "leases", Name: agg}})
	}
	mapper, err := d.flags.ToRESTMapper()
	if err != nil {
		return fail(name, "", "reading the API's resources: %v", err)
	}
	for _, p := range cfg.Parents {
		resource := p.Resource
		if resource == "" {
			// Resolved through discovery, as the aggregator does; a kind
			// that is not served is the parent kind check's failure.
			mapping, err := mapper.RESTMapping(p.GroupKind(), p.Version)
			if err != nil {
				continue
			}
			resource = mapping.Resource.Resource
		}
		for _, ns := range within {
			for _, verb := range []string{"get", "list", "watch"} {
				need = append(need, permission{agg, authorizationv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: p.Group, Resource: resource}})
				if cfg.VerifyOwner {
					need = append(need, permission{wh, authorizationv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: p.Group, Resource: resource}})
				}
			}
			need = append(need, permission{agg, authorizationv1.ResourceAttributes{Namespace: ns, Verb: "patch", Group: p.Group, Resource: resource, Subresource: "status"}})
		}
	}
	var denied []string
	for _, n := range need {
		attr := n.attr
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:               "system:serviceaccount:" + d.tallyNamespace + ":" + n.sa,
			Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:" + d.tallyNamespace, "system:authenticated"},
			ResourceAttributes: &attr,
		}}
		res, err := d.cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			return fail(name, "run doctor as a user who may create SubjectAccessReviews", "asking the API server: %v", err)
		}
		if !res.Status.Allowed {
			what := attr.Resource
			if attr.Subresource != "" {
				what += "/" + attr.Subresource
			}
			if attr.Group != "" {
				what += "." + attr.Group
			}
			if attr.Namespace != "" && attr.Resource != "leases" {
				what += " in namespace " + attr.Namespace
			}
			denied = append(denied, fmt.Sprintf("%s may not %s %s", n.sa, attr.Verb, what))
		}
	}
	if len(denied) > 0 {
		return fail(name, "helm upgrade the chart: its RBAC is generated from parents (each needs its resource) and namespaces (a Role in each)", "%s", strings.Join(denied, "; "))
	}
	return ok(name, "%s and %s may do what they need (%d checks)", agg, wh, len(need))
}
