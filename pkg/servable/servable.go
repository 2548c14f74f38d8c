// Package servable decides whether the API server serves a parent kind the
// way tally needs it: namespaced, with a status subresource, and, for a kind
// with cumulative totals, a served schema that declares the ledger and every
// mapped total, with types that take what tally writes there. The webhook
// and the aggregator run the same checks, so that the webhook gives the
// tracking finalizer only to pods whose kind the aggregator can record, and
// the aggregator releases the pods of a kind it cannot.
package servable

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"

	"tally.dev/tally/pkg/config"
)

// Problem is why a parent kind cannot be served.
type Problem struct {
	// Name labels the problem in metrics: not-served, cluster-scoped,
	// resource-mismatch, no-status-subresource, totals-not-in-schema.
	Name string
	Err  error
	// Unknown reports that the API server could not tell (an error, or a
	// schema not published yet): nothing may be concluded from it but that
	// the kind is not known to be served.
	Unknown bool
}

func unknown(name string, err error) *Problem { return &Problem{Name: name, Err: err, Unknown: true} }

func (p *Problem) Error() string { return p.Err.Error() }

// Checker runs the checks against an API server.
type Checker struct {
	mapper meta.RESTMapper
	disco  discovery.DiscoveryInterface
}

// NewChecker returns a Checker that resolves kinds with mapper and reads
// resources and schemas through disco.
func NewChecker(mapper meta.RESTMapper, disco discovery.DiscoveryInterface) *Checker {
	return &Checker{mapper: mapper, disco: disco}
}

// Kind confirms that the API server serves the parent kind namespaced, as
// configured, with a status subresource.
func (c *Checker) Kind(p config.Parent) *Problem {
	mapping, err := c.mapper.RESTMapping(p.GroupKind(), p.Version)
	if err != nil {
		problem := &Problem{Name: "not-served", Err: fmt.Errorf("the API server does not serve %s: %w", p.GroupVersionKind(), err)}
		problem.Unknown = !meta.IsNoMatchError(err)
		return problem
	}
	if mapping.Scope.Name() == meta.RESTScopeNameRoot {
		return &Problem{Name: "cluster-scoped", Err: fmt.Errorf("%s is cluster-scoped; a parent kind must be namespaced", p.GroupVersionKind())}
	}
	resource := mapping.Resource.Resource
	if p.Resource != "" && p.Resource != resource {
		return &Problem{Name: "resource-mismatch", Err: fmt.Errorf("%s is served as resource %q, not %q as configured", p.GroupVersionKind(), resource, p.Resource)}
	}
	list, err := c.disco.ServerResourcesForGroupVersion(p.GroupVersionKind().GroupVersion().String())
	if err != nil {
		problem := &Problem{Name: "not-served", Err: fmt.Errorf("discovering %s: %w", p.GroupVersionKind().GroupVersion(), err)}
		problem.Unknown = !apierrors.IsNotFound(err)
		return problem
	}
	if !slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource+"/status" }) {
		return &Problem{Name: "no-status-subresource", Err: fmt.Errorf("%s has no status subresource: enable it in the CRD (subresources: {status: {}})", p.GroupVersionKind())}
	}
	return nil
}

// Totals confirms that the kind is served (Kind) and that, when it maps a
// total, the schema the API server serves for its version declares the
// ledger (with its lists completed and unexpected, arrays of strings) and
// every mapped total (an integer): the API server would drop what it does not declare,
// and refuse what its type does not take.
func (c *Checker) Totals(p config.Parent) *Problem {
	if problem := c.Kind(p); problem != nil || !p.Tracked() {
		return problem
	}
	gv := p.GroupVersionKind().GroupVersion()
	path := "apis/" + gv.String()
	if gv.Group == "" {
		path = "api/" + gv.Version
	}
	// The API server publishes a kind's schema a moment after it serves
	// the kind: until it does, nothing is known.
	paths, err := c.disco.OpenAPIV3().Paths()
	if err != nil {
		return unknown("schema-unknown", fmt.Errorf("reading the API server's schemas: %w", err))
	}
	doc, ok := paths[path]
	if !ok {
		return unknown("schema-unknown", fmt.Errorf("the API server publishes no schema for %s yet", gv))
	}
	data, err := doc.Schema("application/json")
	if err != nil {
		return unknown("schema-unknown", fmt.Errorf("reading the schema of %s: %w", gv, err))
	}
	missing, err := Unwritable(data, p)
	if err != nil {
		return unknown("schema-unknown", fmt.Errorf("reading the schema of %s: %w", gv, err))
	}
	if len(missing) > 0 {
		return &Problem{Name: "totals-not-in-schema", Err: fmt.Errorf("the schema of %s does not declare %s: its totals cannot be kept", p.GroupVersionKind(), strings.Join(missing, ", "))}
	}
	return nil
}

// node is the part of an OpenAPI v3 schema the walk reads.
type node struct {
	Ref        string           `json:"$ref"`
	AllOf      []*node          `json:"allOf"`
	Properties map[string]*node `json:"properties"`
	// Additional is additionalProperties: the schema of a map's values
	// (JSON true or false, which a structural schema does not use, read
	// as none).
	Additional json.RawMessage `json:"additionalProperties"`
	Items      *node           `json:"items"`
	Preserve   bool            `json:"x-kubernetes-preserve-unknown-fields"`
	Type       string          `json:"type"`
	IntOrStr   bool            `json:"x-kubernetes-int-or-string"`
	GVK        []struct {
		Group, Version, Kind string
	} `json:"x-kubernetes-group-version-kind"`
}

// values returns the schema of a map's values, or nil.
func (n *node) values() *node {
	var v *node
	if len(n.Additional) == 0 || n.Additional[0] != '{' || json.Unmarshal(n.Additional, &v) != nil {
		return nil
	}
	return v
}

// Unwritable returns the paths of the kind's totals and ledger that the
// OpenAPI v3 document data (one group-version's, as /openapi/v3 serves it)
// does not declare, or declares with a type that does not take what tally
// writes there (a total an integer, the ledger's lists arrays of strings):
// those as "status.restarts as an integer (it declares a string)". A field
// a map declares (additionalProperties) is declared; so is one the schema
// does not name under an object that keeps unknown fields
// (x-kubernetes-preserve-unknown-fields), and it takes anything, as does a
// field without a type (Mistyped).
func Unwritable(data []byte, p config.Parent) ([]string, error) {
	var doc struct {
		Components struct {
			Schemas map[string]*node `json:"schemas"`
		} `json:"components"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	schemas := doc.Components.Schemas
	var root *node
	for _, s := range schemas {
		if slices.ContainsFunc(s.GVK, func(g struct{ Group, Version, Kind string }) bool {
			return g.Group == p.Group && g.Version == p.Version && g.Kind == p.Kind
		}) {
			root = s
			break
		}
	}
	if root == nil {
		return nil, fmt.Errorf("no schema for %s", p.GroupVersionKind())
	}
	resolve := func(n *node) *node {
		for range 8 { // a chain of references, bounded
			switch {
			case n == nil:
				return nil
			case n.Ref != "":
				n = schemas[strings.TrimPrefix(n.Ref, "#/components/schemas/")]
			case len(n.AllOf) == 1 && n.AllOf[0].Ref != "" && n.Properties == nil && n.Type == "" && !n.Preserve:
				// A reference with a description beside it, as the API
				// server publishes one; an allOf of constraints is not.
				n = n.AllOf[0]
			default:
				return n
			}
		}
		return n
	}
	// unwritable returns what keeps a value of type want from path: "" when
	// nothing.
	unwritable := func(path []string, want string) string {
		n := resolve(root)
		for _, seg := range path {
			if n == nil {
				break
			}
			next, ok := n.Properties[seg]
			if !ok {
				if next = n.values(); next == nil && n.Preserve {
					return ""
				}
			}
			n = resolve(next)
		}
		if n == nil {
			return strings.Join(path, ".")
		}
		return Mistyped(strings.Join(path, "."), typeOf(n, resolve), want)
	}
	var out []string
	for _, f := range p.Fields() {
		if slices.Contains(config.Totals, f.Count) {
			if problem := unwritable(f.Path, Integer); problem != "" {
				out = append(out, problem)
			}
		}
	}
	ledger := p.LedgerPath()
	for _, list := range []string{"completed", "unexpected"} {
		if problem := unwritable(append(slices.Clone(ledger), list), Strings); problem != "" {
			out = append(out, problem)
		}
	}
	return out, nil
}

// The types Mistyped is given: OpenAPI's, with an array's items after "of"
// when they are typed, and IntOrString for x-kubernetes-int-or-string.
const (
	Integer     = "integer"
	Strings     = "array of string"
	IntOrString = "int-or-string"
)

// typeOf returns n's type as Mistyped takes it.
func typeOf(n *node, resolve func(*node) *node) string {
	switch {
	case n.IntOrStr:
		return IntOrString
	case n.Type == "array":
		if items := resolve(n.Items); items != nil && (items.Type != "" || items.IntOrStr) {
			return "array of " + typeOf(items, resolve)
		}
	}
	return n.Type
}

// Mistyped returns what keeps a field at path, of the type declared, from
// taking a value of type want (Integer or Strings), as "status.restarts as
// an integer (it declares a string)"; "" when it takes it. A field without
// a type takes anything, a number or an int-or-string an integer, an array
// whose items have no type or are int-or-strings a list of strings.
func Mistyped(path, declared, want string) string {
	if slices.Contains(takes[want], declared) {
		return ""
	}
	return fmt.Sprintf("%s as %s (it declares %s %s)", path, wanted[want], article(declared), declared)
}

// takes lists, for each type Mistyped is asked for, the declared types that
// take it; wanted names it in a message.
var (
	takes = map[string][]string{
		Integer: {"", Integer, "number", IntOrString},
		Strings: {"", Strings, "array", "array of " + IntOrString},
	}
	wanted = map[string]string{Integer: "an integer", Strings: "an array of strings"}
)

func article(word string) string {
	if word != "" && strings.ContainsRune("aeiou", rune(word[0])) {
		return "an"
	}
	return "a"
}
