package app

import (
	"context"
	"fmt"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/servable"
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// kindCheck checks that a parent kind is served, has a status subresource,
// and (for a custom resource) declares every mapped field with a type that
// takes what tally writes there.
type kindCheck struct{ parent config.Parent }

func (c kindCheck) name() string { return "parent kind " + c.parent.GroupKind().String() }

func (c kindCheck) run(ctx context.Context, d *doctor) Check {
	name, p := c.name(), c.parent
	gv := schema.GroupVersion{Group: p.Group, Version: p.Version}.String()
	resources, err := d.cs.Discovery().ServerResourcesForGroupVersion(gv)
	if err != nil {
		return fail(name, "install the kind's CRD", "%s is not served: %v", gv, err)
	}
	var resource string
	status := false
	for _, r := range resources.APIResources {
		if r.Kind == p.Kind && !strings.Contains(r.Name, "/") {
			resource = r.Name
		}
	}
	for _, r := range resources.APIResources {
		if resource != "" && r.Name == resource+"/status" {
			status = true
		}
	}
	switch {
	case resource == "":
		return fail(name, "install the kind's CRD, or fix parents in the chart's values", "%s serves no kind %s", gv, p.Kind)
	case !status:
		return fail(name, "add `subresources: {status: {}}` to the CRD's version "+p.Version, "%s has no status subresource: tally writes counts only there", resource)
	}
	crd, err := d.dyn.Resource(crdGVR).Get(ctx, resource+"."+p.Group, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return ok(name, "%s served with a status subresource (built in: no CRD schema to check)", resource)
	}
	if err != nil {
		return fail(name, "", "reading CRD %s.%s: %v", resource, p.Group, err)
	}
	var missing, mistyped []string
	check := func(path []string, want string) {
		declaredAs, ok := schemaType(crd, p.Version, path)
		if !ok {
			missing = append(missing, strings.Join(path, "."))
		} else if problem := servable.Mistyped(strings.Join(path, "."), declaredAs, want); problem != "" {
			mistyped = append(mistyped, problem)
		}
	}
	for _, f := range p.Fields() {
		check(f.Path, servable.Integer)
	}
	if p.Tracked() {
		for _, list := range []string{"completed", "unexpected"} {
			check(append(p.LedgerPath(), list), servable.Strings)
		}
	}
	var problems []string
	if len(missing) > 0 {
		problems = append(problems, fmt.Sprintf("the CRD does not declare %s: the API server prunes what tally writes there", strings.Join(missing, ", ")))
	}
	if len(mistyped) > 0 {
		problems = append(problems, fmt.Sprintf("the CRD does not declare %s: the API server refuses what tally writes there", strings.Join(mistyped, ", ")))
	}
	if len(problems) > 0 {
		return fail(name, "declare them in the CRD's openAPIV3Schema for version "+p.Version+" (counts and totals as integers, the ledger's lists as arrays of strings), or unmap them",
			"%s", strings.Join(problems, "; "))
	}
	return ok(name, "%s served with a status subresource; the CRD declares every mapped field with its type", resource)
}

// schemaType returns the type the CRD's schema for version declares at
// path, as servable.Mistyped takes it, and whether it declares path at all.
// A field a map declares (additionalProperties) is declared; so is one the
// schema does not name under an object that keeps unknown fields
// (x-kubernetes-preserve-unknown-fields), with no type: it takes anything.
func schemaType(crd *unstructured.Unstructured, version string, path []string) (string, bool) {
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	for _, v := range versions {
		vm, _ := v.(map[string]any)
		if vm["name"] != version {
			continue
		}
		schemaAt, _, _ := unstructured.NestedMap(vm, "schema", "openAPIV3Schema")
		for _, step := range path {
			props, _ := schemaAt["properties"].(map[string]any)
			next, found := props[step].(map[string]any)
			if !found {
				next, found = schemaAt["additionalProperties"].(map[string]any)
			}
			if !found {
				keep, _ := schemaAt["x-kubernetes-preserve-unknown-fields"].(bool)
				return "", keep
			}
			schemaAt = next
		}
		return typeOf(schemaAt), true
	}
	return "", false
}

// typeOf returns the type a CRD schema node declares, as servable.Mistyped
// takes it.
func typeOf(schema map[string]any) string {
	if intOrString, _ := schema["x-kubernetes-int-or-string"].(bool); intOrString {
		return servable.IntOrString
	}
	t, _ := schema["type"].(string)
	if items, ok := schema["items"].(map[string]any); ok && t == "array" {
		if of := typeOf(items); of != "" {
			return "array of " + of
		}
	}
	return t
}
