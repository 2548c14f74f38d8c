// Package config loads and validates the configuration file shared by the
// webhook and the aggregator (--config). It owns the file's schema and its
// defaults; it knows nothing of Kubernetes clients.
package config

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"

	yamlv3 "go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/pkg/podexpr"
)

// Count names one of the counts the aggregator computes for a parent.
type Count string

// The counts a parent kind can map to status fields. See the product
// specification for their exact definitions.
const (
	Completing Count = "completing"
	Completed  Count = "completed"
	Active     Count = "active"
	Unexpected Count = "unexpected"
	// CompletedTotal and UnexpectedTotal count the pods that ever finished
	// with and without an intent, each once. Mapping either opts the kind in
	// to tracking: a finalizer on its pods and a ledger in its status.
	CompletedTotal  Count = "completedTotal"
	UnexpectedTotal Count = "unexpectedTotal"
)

// Counts lists the counts of the pods that exist, in a fixed order.
var Counts = []Count{Completing, Completed, Active, Unexpected}

// Totals lists the cumulative totals, in a fixed order.
var Totals = []Count{CompletedTotal, UnexpectedTotal}

// Total reports whether c is a cumulative total rather than a count of the
// pods that exist.
func (c Count) Total() bool { return c == CompletedTotal || c == UnexpectedTotal }

// DefaultCounts is the mapping used when a parent kind maps no counts.
var DefaultCounts = map[Count]string{Completing: "status.completing"}

// Config is the parsed configuration file.
type Config struct {
	// Parents are the parent kinds whose pods tally tracks.
	Parents []Parent `json:"parents"`
	// VerifyOwner makes the webhook confirm, from an informer cache, that a
	// pod's owner exists with the referenced UID before stamping the pod.
	VerifyOwner bool `json:"verifyOwner"`
	// NamespaceSelector is the webhook registration's namespaceSelector:
	// the namespaces whose pods tally stamps. The backfill sweep follows it
	// too. Absent, every namespace but kube-system
	// (DefaultNamespaceSelector).
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
}

// DefaultNamespaceSelector selects every namespace but kube-system.
func DefaultNamespaceSelector() *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
		Key: corev1.LabelMetadataName, Operator: metav1.LabelSelectorOpNotIn, Values: []string{metav1.NamespaceSystem},
	}}}
}

// Namespaces returns NamespaceSelector (DefaultNamespaceSelector when not
// set) as a selector of namespace labels.
func (c *Config) Namespaces() labels.Selector {
	sel := c.NamespaceSelector
	if sel == nil {
		sel = DefaultNamespaceSelector()
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return labels.Nothing() // validate rejected it
	}
	return s
}

// FixedNamespaces returns the namespaces NamespaceSelector lists by name,
// sorted, when it selects by nothing else: a single requirement
// kubernetes.io/metadata.name In (...). A value that is no namespace's name
// (such as "") selects nothing and is left out; nil when no name is left,
// or the selector is not such a list. The aggregator then watches, lists
// and sweeps pods and parents in those namespaces only, and needs no
// permission on pods or parents outside them (it still lists and watches
// namespaces).
func (c *Config) FixedNamespaces() []string {
	sel := c.NamespaceSelector
	if sel == nil || len(sel.MatchLabels) != 0 || len(sel.MatchExpressions) != 1 {
		return nil
	}
	req := sel.MatchExpressions[0]
	if req.Key != corev1.LabelMetadataName || req.Operator != metav1.LabelSelectorOpIn {
		return nil
	}
	var names []string
	for _, name := range req.Values {
		if len(validation.IsDNS1123Label(name)) == 0 {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// Parent is one tracked parent kind.
type Parent struct {
	// Group is the API group of the kind; empty for the core group.
	Group string `json:"group"`
	// Version is the API version the aggregator watches and writes.
	Version string `json:"version"`
	// Kind is the kind's name, e.g. WorkerPool.
	Kind string `json:"kind"`
	// Resource is the plural resource name; resolved through discovery when
	// empty.
	Resource string `json:"resource,omitempty"`
	// Counts maps count names to dotted status field paths. After Parse it
	// is never empty: DefaultCounts applies when the file maps none.
	Counts map[Count]string `json:"counts,omitempty"`
	// Ledger is the dotted status path of the pods recorded as finished but
	// not yet added to the totals. Required when a total is mapped.
	Ledger string `json:"ledger,omitempty"`
	// CustomCounts are the counts the user defines, at most
	// MaxCustomCounts.
	CustomCounts []CustomCount `json:"customCounts,omitempty"`
	// Compare maps counts to status fields that the parent's operator
	// keeps itself (shadow mode): the aggregator compares each with its
	// own count, reports where they differ, and never writes them. Keys
	// are the counts of the pods that exist and the kind's custom counts.
	// After Parse it holds only the comparisons that can be made.
	Compare map[Count]string `json:"compare,omitempty"`
	// CompareErrs are why the other comparisons cannot be made, by count
	// (the empty count: compare as a whole, not a map, given twice, or
	// past the bounds on its aliases), found by Parse. As
	// for custom counts, only the aggregator reads them: it makes the
	// comparisons it can, the webhook ignores them, and Check refuses
	// the configuration.
	CompareErrs map[Count]error `json:"-"`
}

// CustomCount is a count the user defines: the pods of the parent (the
// same pods as the built-in counts) for which Expression is true.
type CustomCount struct {
	// Name names the count, unique within its kind.
	Name string `json:"name"`
	// Path is the dotted status path it is written to.
	Path string `json:"path"`
	// Expression is a boolean CEL expression over the pod (package
	// podexpr), checked by Parse.
	Expression string `json:"expression"`
	// Err is why the count cannot be kept (it does not decode, or its
	// name, path or expression is not valid), found by Parse; nil for a
	// valid count. Only the
	// aggregator's counting reads custom counts: it leaves a count with an
	// Err unwritten and serves the others, the webhook ignores them, and
	// Check refuses the configuration.
	Err error `json:"-"`
}

// MaxCustomCounts is how many custom counts one kind may define.
const MaxCustomCounts = 32

// Tracked reports whether the kind keeps cumulative totals: its pods carry
// the keys.TrackingFinalizer until the aggregator has recorded them.
func (p Parent) Tracked() bool {
	return p.Counts[CompletedTotal] != "" || p.Counts[UnexpectedTotal] != ""
}

// LedgerPath returns the ledger's path split on dots; nil when the kind
// keeps no totals.
func (p Parent) LedgerPath() []string {
	if p.Ledger == "" {
		return nil
	}
	return strings.Split(p.Ledger, ".")
}

// GroupVersionKind returns the kind's GroupVersionKind.
func (p Parent) GroupVersionKind() schema.GroupVersionKind {
	return schema.GroupVersionKind{Group: p.Group, Version: p.Version, Kind: p.Kind}
}

// GroupKind returns the kind's GroupKind.
func (p Parent) GroupKind() schema.GroupKind {
	return schema.GroupKind{Group: p.Group, Kind: p.Kind}
}

// Field is one mapped status field: a count and the path it is written to.
type Field struct {
	// Count is the count's name: a custom count's own for a custom count.
	Count Count
	// Path is the field path split on dots, starting with "status".
	Path []string
	// Custom marks a custom count, Index its place in CustomCounts.
	Custom bool
	Index  int
}

// Fields returns the parent's mapped fields in the fixed order of Counts,
// then the custom counts in their order, then Totals.
func (p Parent) Fields() []Field {
	fields := make([]Field, 0, len(p.Counts)+len(p.CustomCounts))
	add := func(counts []Count) {
		for _, c := range counts {
			if path, ok := p.Counts[c]; ok {
				fields = append(fields, Field{Count: c, Path: strings.Split(path, ".")})
			}
		}
	}
	add(Counts)
	for i, c := range p.CustomCounts {
		if c.Err == nil {
			fields = append(fields, Field{Count: Count(c.Name), Path: strings.Split(c.Path, "."), Custom: true, Index: i})
		}
	}
	add(Totals)
	return fields
}

// CompareFields returns the kind's comparisons that can be made, in the
// fixed order of Counts, then the custom counts in their order: each
// Field's Path is the operator's field, not one tally writes.
func (p Parent) CompareFields() []Field {
	var fields []Field
	for _, c := range Counts {
		if path, ok := p.Compare[c]; ok {
			fields = append(fields, Field{Count: c, Path: strings.Split(path, ".")})
		}
	}
	for i, c := range p.CustomCounts {
		if path, ok := p.Compare[Count(c.Name)]; ok && c.Err == nil {
			fields = append(fields, Field{Count: Count(c.Name), Path: strings.Split(path, "."), Custom: true, Index: i})
		}
	}
	return fields
}

// Programs compiles the kind's custom counts, in their order. A count
// that cannot be kept has a nil program, and its error at the same place
// in errs: its Err, or its expression's compile error in a configuration
// that did not come from Parse.
func (p Parent) Programs() (programs []*podexpr.Program, errs []error) {
	programs = make([]*podexpr.Program, len(p.CustomCounts))
	errs = make([]error, len(p.CustomCounts))
	for i, c := range p.CustomCounts {
		if c.Err != nil {
			errs[i] = c.Err
			continue
		}
		prg, err := podexpr.Compile(c.Expression, c.Name)
		if err != nil {
			errs[i] = fmt.Errorf("%s custom count %q: expression %w", p.GroupKind(), c.Name, err)
			continue
		}
		programs[i] = prg
	}
	return programs, errs
}

// Broken returns the kind's custom counts that have an Err.
func (p Parent) Broken() []CustomCount {
	var out []CustomCount
	for _, c := range p.CustomCounts {
		if c.Err != nil {
			out = append(out, c)
		}
	}
	return out
}

// CustomCountErrors returns the errors of every custom count that has one
// (CustomCount.Err), joined; nil when there are none.
func (c *Config) CustomCountErrors() error {
	var errs []error
	for _, p := range c.Parents {
		for _, cc := range p.Broken() {
			errs = append(errs, cc.Err)
		}
	}
	return errors.Join(errs...)
}

// CompareErrors returns the errors of every comparison that cannot be made
// (Parent.CompareErrs), joined in the order of the parents and the counts;
// nil when there are none.
func (c *Config) CompareErrors() error {
	var errs []error
	for _, p := range c.Parents {
		for _, name := range slices.Sorted(maps.Keys(p.CompareErrs)) {
			errs = append(errs, p.CompareErrs[name])
		}
	}
	return errors.Join(errs...)
}

// Load reads and validates the configuration file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading config: %w", err)
	}
	cfg, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

// InvalidError is Parse's error: the document is not a valid
// configuration (as opposed to one that could not be read).
type InvalidError struct{ Err error }

func (e *InvalidError) Error() string { return e.Err.Error() }
func (e *InvalidError) Unwrap() error { return e.Err }

// Parse decodes a configuration document, rejecting unknown keys, validates
// it and applies defaults. Its error is an *InvalidError.
//
// A custom count's own problems (its keys and values, name, path or
// expression) do not make the document invalid: they are the count's Err,
// so that a mistake only the aggregator's counting reads cannot stop the
// webhook, nor the aggregator's other work. Nor do a comparison's
// (Parent.CompareErrs). Check refuses them too.
func Parse(data []byte) (*Config, error) {
	rest, custom, compare, err := takeAggregatorKeys(data)
	if err != nil {
		return nil, &InvalidError{fmt.Errorf("decoding: %w", err)}
	}
	if err := checkKeys(rest); err != nil {
		return nil, &InvalidError{err}
	}
	var cfg Config
	if err := yaml.UnmarshalStrict(rest, &cfg); err != nil {
		return nil, &InvalidError{fmt.Errorf("decoding: %w", err)}
	}
	for i, counts := range custom {
		if i >= len(cfg.Parents) {
			return nil, &InvalidError{fmt.Errorf("decoding: parents[%d]: not a parent kind", i)}
		}
		cfg.Parents[i].CustomCounts = counts
	}
	for i, c := range compare {
		if i >= len(cfg.Parents) {
			return nil, &InvalidError{fmt.Errorf("decoding: parents[%d]: not a parent kind", i)}
		}
		cfg.Parents[i].Compare, cfg.Parents[i].CompareErrs = c.paths, c.errs
	}
	if err := cfg.validate(); err != nil {
		return nil, &InvalidError{err}
	}
	if cfg.NamespaceSelector == nil {
		cfg.NamespaceSelector = DefaultNamespaceSelector()
	}
	for i := range cfg.Parents {
		if len(cfg.Parents[i].Counts) == 0 {
			cfg.Parents[i].Counts = maps.Clone(DefaultCounts)
		}
	}
	return &cfg, nil
}

// Check is Parse that refuses the custom counts' errors too: what the
// chart runs before helm install and upgrade change anything
// (--check-config), so that a configuration reaches the cluster only
// whole.
func Check(data []byte) (*Config, error) {
	cfg, err := Parse(data)
	if err != nil {
		return nil, err
	}
	if err := errors.Join(cfg.CustomCountErrors(), cfg.CompareErrors()); err != nil {
		return nil, &InvalidError{err}
	}
	return cfg, nil
}

var (
	topKeys    = []string{"parents", "verifyOwner", "namespaceSelector"}
	parentKeys = []string{"group", "version", "kind", "resource", "counts", "ledger", "customCounts", "compare"}
	customKeys = []string{"name", "path", "expression"}
)

// checkKeys rejects keys the schema does not know, naming each by its path.
func checkKeys(data []byte) error {
	var doc map[string]any
	if err := yaml.UnmarshalStrict(data, &doc); err != nil {
		return fmt.Errorf("decoding: %w", err)
	}
	var errs []error
	for _, k := range slices.Sorted(maps.Keys(doc)) {
		if !slices.Contains(topKeys, k) {
			errs = append(errs, fmt.Errorf("%s: unknown key", k))
		}
	}
	parents, _ := doc["parents"].([]any)
	for i, p := range parents {
		fields, _ := p.(map[string]any)
		for _, k := range slices.Sorted(maps.Keys(fields)) {
			if !slices.Contains(parentKeys, k) {
				errs = append(errs, fmt.Errorf("parents[%d].%s: unknown key", i, k))
			}
		}
	}
	return errors.Join(errs...)
}

// takeAggregatorKeys takes each parent's customCounts and compare out of the
// document data, the keys only the aggregator reads, and decodes each
// custom count and each comparison on its own: one that does not decode (a
// key twice, an unknown key, a value of the wrong type, an item that is not
// a map, aliases that expand past the bounds) gets the problem as its
// error, as does a customCounts that is not a list, a compare that is not
// a map, or either given twice. Their aliases are resolved, and an alias of
// the rest that names a node inside them gets a copy in its place. It
// returns the rest of the document, whose decoding is as strict as ever
// (keys a merge key (<<) brings into a parent are the strict decoding's
// too), and the custom counts and the comparisons by parent index.
func takeAggregatorKeys(data []byte) ([]byte, map[int][]CustomCount, map[int]comparisons, error) {
	var root yamlv3.Node
	if err := yamlv3.Unmarshal(data, &root); err != nil {
		return nil, nil, nil, err
	}
	if root.Kind != yamlv3.DocumentNode || len(root.Content) != 1 || root.Content[0].Kind != yamlv3.MappingNode {
		return data, nil, nil, nil // the strict decoding says what is wrong
	}
	parents := mappingValue(root.Content[0], "parents")
	if parents == nil || parents.Kind != yamlv3.SequenceNode {
		return data, nil, nil, nil
	}
	// A parent written as an alias gets a copy of its own, made before any
	// key is taken out of the node it names.
	for i, p := range parents.Content {
		if p.Kind == yamlv3.AliasNode && p.Alias.Kind == yamlv3.MappingNode {
			c, err := newExpansion().resolved(p, false)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("parents[%d]: %w", i, err)
			}
			parents.Content[i] = c
		}
	}
	custom := map[int][]CustomCount{}
	compare := map[int]comparisons{}
	var out []*yamlv3.Node
	for i, p := range parents.Content {
		if p.Kind != yamlv3.MappingNode {
			continue
		}
		var keep []*yamlv3.Node
		taken := map[string][]*yamlv3.Node{}
		for k := 0; k+1 < len(p.Content); k += 2 {
			if key := p.Content[k].Value; key == "customCounts" || key == "compare" {
				taken[key] = append(taken[key], p.Content[k+1])
				continue
			}
			keep = append(keep, p.Content[k], p.Content[k+1])
		}
		counts, comps := taken["customCounts"], taken["compare"]
		if len(counts)+len(comps) == 0 {
			continue
		}
		p.Content = keep
		out = append(out, counts...)
		out = append(out, comps...)
		// Each value on its own, its aliases resolved: what they name may
		// be anywhere, and what goes wrong (an anchor that contains
		// itself, aliases past the bound) is the value's problem.
		switch key := fmt.Sprintf("parents[%d].customCounts", i); len(counts) {
		case 0:
		case 1:
			if v, err := newExpansion().resolved(counts[0], false); err != nil {
				custom[i] = []CustomCount{{Err: fmt.Errorf("%s: %w", key, err)}}
			} else {
				custom[i] = decodeCustomCounts(key, v)
			}
		default:
			custom[i] = []CustomCount{{Err: fmt.Errorf("%s: given %d times", key, len(counts))}}
		}
		switch key := fmt.Sprintf("parents[%d].compare", i); len(comps) {
		case 0:
		case 1:
			if v, err := newExpansion().resolved(comps[0], false); err != nil {
				compare[i] = comparisons{errs: map[Count]error{"": fmt.Errorf("%s: %w", key, err)}}
			} else {
				compare[i] = decodeCompare(key, v)
			}
		default:
			compare[i] = comparisons{errs: map[Count]error{"": fmt.Errorf("%s: given %d times", key, len(comps))}}
		}
	}
	if len(custom)+len(compare) == 0 {
		return data, nil, nil, nil
	}
	// An alias left in the rest that names a node taken out gets a copy of
	// it in its place, so that the rest means what it meant.
	inside := map[*yamlv3.Node]bool{}
	for _, n := range out {
		within(n, inside)
	}
	if err := newExpansion().inline(root.Content[0], inside); err != nil {
		return nil, nil, nil, err
	}
	rest, err := yamlv3.Marshal(&root)
	return rest, custom, compare, err
}

// within adds n and the nodes under it (not those its aliases name) to set.
func within(n *yamlv3.Node, set map[*yamlv3.Node]bool) {
	set[n] = true
	for _, c := range n.Content {
		within(c, set)
	}
}

// Bounds on what resolving the aliases of one value adds (expansion): a few
// aliases can name each other into billions of nodes, or a long string
// into gigabytes.
const (
	maxExpandedNodes = 1 << 14
	maxExpandedBytes = 1 << 20
)

// expansion is what resolving aliases may still add.
type expansion struct{ nodes, bytes int }

func newExpansion() *expansion {
	return &expansion{nodes: maxExpandedNodes, bytes: maxExpandedBytes}
}

// resolved returns a copy of the node n with every alias replaced by a copy
// of the node it names, with no anchors left; what the aliases add (aliased:
// n is reached through one) counts against e's bounds.
func (e *expansion) resolved(n *yamlv3.Node, aliased bool) (*yamlv3.Node, error) {
	if n.Kind == yamlv3.AliasNode {
		return e.resolved(n.Alias, true)
	}
	if aliased {
		e.nodes--
		e.bytes -= len(n.Value) + len(n.HeadComment) + len(n.LineComment) + len(n.FootComment)
		if e.nodes < 0 || e.bytes < 0 {
			return nil, fmt.Errorf("line %d: aliases expand to more than %d nodes or %d bytes (an anchor that contains itself?)", n.Line, maxExpandedNodes, maxExpandedBytes)
		}
	}
	out := *n
	out.Anchor, out.Alias, out.Content = "", nil, make([]*yamlv3.Node, 0, len(n.Content))
	for _, c := range n.Content {
		rc, err := e.resolved(c, aliased)
		if err != nil {
			return nil, err
		}
		out.Content = append(out.Content, rc)
	}
	return &out, nil
}

// inline replaces each alias under n that names a node of set with a copy
// of it (resolved); it does not follow the other aliases.
func (e *expansion) inline(n *yamlv3.Node, set map[*yamlv3.Node]bool) error {
	for i, c := range n.Content {
		if c.Kind == yamlv3.AliasNode {
			if set[c.Alias] {
				rc, err := e.resolved(c, false)
				if err != nil {
					return err
				}
				n.Content[i] = rc
			}
			continue
		}
		if err := e.inline(c, set); err != nil {
			return err
		}
	}
	return nil
}

// comparisons are one parent's compare, decoded: the paths by count, and
// the entries that do not decode.
type comparisons struct {
	paths map[Count]string
	errs  map[Count]error
}

// decodeCompare decodes the compare map node m, at key: each entry whose
// value is a string is a path; the others are errors.
func decodeCompare(key string, m *yamlv3.Node) comparisons {
	c := comparisons{paths: map[Count]string{}, errs: map[Count]error{}}
	switch {
	case m.Kind == yamlv3.ScalarNode && m.Tag == "!!null":
		return comparisons{}
	case m.Kind != yamlv3.MappingNode:
		c.errs[""] = fmt.Errorf("%s: not a map of count names to the status paths the operator keeps (e.g. completing: status.completing)", key)
		return c
	}
	for k := 0; k+1 < len(m.Content); k += 2 {
		name, value := Count(m.Content[k].Value), m.Content[k+1]
		at := fmt.Sprintf("%s.%s", key, name)
		_, dup := c.paths[name]
		_, bad := c.errs[name]
		switch {
		case dup || bad:
			c.errs[name] = fmt.Errorf("%s: given twice", at)
			delete(c.paths, name)
		case m.Content[k].Tag == "!!merge":
			c.errs[name] = fmt.Errorf("%s: a merge key (<<) is not read here: write each comparison in compare itself", at)
		case value.Kind != yamlv3.ScalarNode || value.Tag != "!!str":
			c.errs[name] = fmt.Errorf("%s: not a status path (e.g. status.%s)", at, name)
		default:
			c.paths[name] = value.Value
		}
	}
	return c
}

// mappingValue returns the value of key in the mapping node m; nil if m has
// no such key.
func mappingValue(m *yamlv3.Node, key string) *yamlv3.Node {
	for k := 0; k+1 < len(m.Content); k += 2 {
		if m.Content[k].Value == key {
			return m.Content[k+1]
		}
	}
	return nil
}

// decodeCustomCounts decodes the custom counts of the node list, at key.
func decodeCustomCounts(key string, list *yamlv3.Node) []CustomCount {
	switch {
	case list.Kind == yamlv3.ScalarNode && list.Tag == "!!null":
		return nil
	case list.Kind != yamlv3.SequenceNode:
		return []CustomCount{{Err: fmt.Errorf("%s: not a list of custom counts", key)}}
	}
	out := make([]CustomCount, len(list.Content))
	for j, item := range list.Content {
		out[j] = decodeCustomCount(fmt.Sprintf("%s[%d]", key, j), item)
	}
	return out
}

// decodeCustomCount decodes one custom count, at key; what does not decode
// is its Err.
func decodeCustomCount(key string, item *yamlv3.Node) CustomCount {
	data, err := yamlv3.Marshal(item)
	if err != nil {
		return CustomCount{Err: fmt.Errorf("%s: %w", key, err)}
	}
	var fields map[string]any
	if err := yaml.UnmarshalStrict(data, &fields); err != nil {
		return CustomCount{Err: fmt.Errorf("%s: not a custom count (name, path, expression): %w", key, err)}
	}
	var c CustomCount
	var errs []error
	for _, k := range slices.Sorted(maps.Keys(fields)) {
		if !slices.Contains(customKeys, k) {
			errs = append(errs, fmt.Errorf("%s.%s: unknown key", key, k))
			delete(fields, k)
		}
	}
	known, err := json.Marshal(fields)
	if err == nil {
		err = yaml.UnmarshalStrict(known, &c)
	}
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", key, err))
		// What can be read of it, for the reports.
		c.Name, _ = fields["name"].(string)
		c.Path, _ = fields["path"].(string)
	}
	c.Err = errors.Join(errs...)
	return c
}

var (
	dnsLabel     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	countName    = regexp.MustCompile(`^[a-z][A-Za-z0-9]*$`)
	kindName     = regexp.MustCompile(`^[A-Z][A-Za-z0-9]*$`)
	fieldSegment = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// replicaSets is the kind refused as a parent: tally's own pods are a
// ReplicaSet's (its Deployments'), and a webhook with failurePolicy Fail
// that must admit its own replacement pods cannot come back from an outage.
var replicaSets = schema.GroupKind{Group: "apps", Kind: "ReplicaSet"}

func (c *Config) validate() error {
	if len(c.Parents) == 0 {
		return errors.New("parents: at least one parent kind is required")
	}
	var errs []error
	seen := map[schema.GroupKind]int{}
	for i, p := range c.Parents {
		at := fmt.Sprintf("parents[%d]", i)
		switch {
		case p.Kind == "":
			errs = append(errs, fmt.Errorf("%s.kind: required", at))
		case !kindName.MatchString(p.Kind):
			errs = append(errs, fmt.Errorf("%s.kind: %q is not a kind name (e.g. WorkerPool)", at, p.Kind))
		}
		if p.Version == "" {
			errs = append(errs, fmt.Errorf("%s.version: required", at))
		} else if !dnsLabel.MatchString(p.Version) {
			errs = append(errs, fmt.Errorf("%s.version: %q is not a valid API version", at, p.Version))
		}
		if p.Group != "" && !validGroup(p.Group) {
			errs = append(errs, fmt.Errorf("%s.group: %q is not a valid API group", at, p.Group))
		}
		if p.Resource != "" && !dnsLabel.MatchString(p.Resource) {
			errs = append(errs, fmt.Errorf("%s.resource: %q is not a valid resource name", at, p.Resource))
		}
		if p.GroupKind() == replicaSets {
			errs = append(errs, fmt.Errorf("%s: apps/ReplicaSet cannot be a parent kind: it controls tally's own pods, which the webhook would then have to admit before it runs", at))
		}
		if j, dup := seen[p.GroupKind()]; dup && p.Kind != "" {
			errs = append(errs, fmt.Errorf("%s: kind %s is already configured at parents[%d]", at, p.GroupKind(), j))
		}
		seen[p.GroupKind()] = i
		counts := p.Counts
		if len(counts) == 0 {
			counts = DefaultCounts // as Parse will map them
		}
		errs = append(errs, validateCounts(at, p.GroupKind().String(), counts, p.Ledger, c.Parents[i].CustomCounts)...)
		validateCompare(at, &c.Parents[i], counts)
		switch {
		case p.Tracked() && p.Ledger == "":
			errs = append(errs, fmt.Errorf("%s.ledger: required when completedTotal or unexpectedTotal is mapped (e.g. status.tallyLedger)", at))
		case p.Ledger != "" && !p.Tracked():
			errs = append(errs, fmt.Errorf("%s.ledger: set, but neither completedTotal nor unexpectedTotal is mapped", at))
		case p.Ledger != "":
			if err := validatePath(p.Ledger, "tallyLedger"); err != nil {
				errs = append(errs, fmt.Errorf("%s.ledger: %w", at, err))
			}
		}
	}
	if c.NamespaceSelector != nil {
		if _, err := metav1.LabelSelectorAsSelector(c.NamespaceSelector); err != nil {
			errs = append(errs, fmt.Errorf("namespaceSelector: %w", err))
		}
	}
	return errors.Join(errs...)
}

func validGroup(g string) bool {
	for _, part := range strings.Split(g, ".") {
		if !dnsLabel.MatchString(part) {
			return false
		}
	}
	return len(g) <= 253
}

func validateCounts(at, kind string, counts map[Count]string, ledger string, custom []CustomCount) []error {
	var errs []error
	paths := map[string]string{}
	if ledger != "" {
		paths[ledger] = "the ledger"
	}
	// mapPath checks path, the field of the count named name at key, and
	// that no other field overlaps it; it then takes the path, if valid.
	mapPath := func(key, name, path string) error {
		if err := validatePath(path, name); err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		for _, other := range slices.Sorted(maps.Keys(paths)) {
			if other == path || strings.HasPrefix(other, path+".") || strings.HasPrefix(path, other+".") {
				return fmt.Errorf("%s: field path %q overlaps %q, mapped by %s", key, path, other, paths[other])
			}
		}
		paths[path] = "count " + name
		return nil
	}
	for _, name := range slices.Sorted(maps.Keys(counts)) {
		key := fmt.Sprintf("%s.counts.%s", at, name)
		if !slices.Contains(Counts, name) && !slices.Contains(Totals, name) {
			errs = append(errs, fmt.Errorf("%s: unknown count %q, must be one of completing, completed, active, unexpected, completedTotal, unexpectedTotal "+
				"(define a count of your own in customCounts)", key, name))
			continue
		}
		if err := mapPath(key, string(name), counts[name]); err != nil {
			errs = append(errs, err)
		}
	}
	validateCustomCounts(at, kind, custom, mapPath)
	return errs
}

// validateCustomCounts sets the Err of each custom count whose name, path
// or expression is not valid, or that is past the MaxCustomCounts-th.
// mapPath checks a path as for a built-in count, and takes it.
func validateCustomCounts(at, kind string, custom []CustomCount, mapPath func(key, name, path string) error) {
	names := map[string]int{}
	for i := range custom {
		c := &custom[i]
		if c.Err != nil && c.Name == "" && c.Path == "" && c.Expression == "" {
			// Nothing of it decoded (customCounts is not a list, or an
			// item not a map): its decoding said what is wrong.
			continue
		}
		key := fmt.Sprintf("%s.customCounts[%d]", at, i)
		errs := []error{c.Err} // what its decoding found
		if i >= MaxCustomCounts {
			errs = append(errs, fmt.Errorf("%s: %s has more than %d custom counts, the most one kind may have", key, kind, MaxCustomCounts))
		}
		switch j, dup := names[c.Name]; {
		case c.Name == "":
			errs = append(errs, fmt.Errorf("%s.name: required", key))
		case !countName.MatchString(c.Name):
			errs = append(errs, fmt.Errorf("%s.name: %q is not a count name: a lowercase letter, then letters and digits (e.g. ready)", key, c.Name))
		case slices.Contains(Counts, Count(c.Name)) || slices.Contains(Totals, Count(c.Name)):
			errs = append(errs, fmt.Errorf("%s.name: %q is a built-in count: map it in counts", key, c.Name))
		case dup:
			errs = append(errs, fmt.Errorf("%s.name: %q is already the name of customCounts[%d]", key, c.Name, j))
		default:
			names[c.Name] = i
		}
		if c.Path == "" {
			errs = append(errs, fmt.Errorf("%s.path: required (e.g. status.%s)", key, cmp.Or(c.Name, "ready")))
		} else if errors.Join(errs...) == nil {
			// A count kept no further takes no path: the counts after
			// it may use it.
			errs = append(errs, mapPath(key+".path", cmp.Or(c.Name, "ready"), c.Path))
		}
		if _, err := podexpr.Compile(c.Expression, key+".expression"); err != nil {
			errs = append(errs, fmt.Errorf("%s.expression: the expression of %s's count %q %w", key, kind, c.Name, err))
		}
		c.Err = errors.Join(errs...)
	}
}

// validateCompare moves each comparison of p that cannot be made from
// p.Compare to p.CompareErrs: a count that is not one of the pods that
// exist (a total counts only the pods that finished since tally tracked
// the kind) nor a custom count of the kind that can be kept, or a path
// that is not valid or overlaps a field tally writes (its mapped counts,
// its custom counts that can be kept, the ledger). Called after the custom
// counts are validated.
func validateCompare(at string, p *Parent, counts map[Count]string) {
	if len(p.Compare) == 0 {
		return
	}
	written := map[string]string{}
	for name, path := range counts {
		written[path] = "count " + string(name)
	}
	if p.Ledger != "" {
		written[p.Ledger] = "the ledger"
	}
	custom := map[Count]*CustomCount{}
	for i := range p.CustomCounts {
		c := &p.CustomCounts[i]
		custom[Count(c.Name)] = c
		if c.Err == nil {
			written[c.Path] = "count " + c.Name
		}
	}
	if p.CompareErrs == nil {
		p.CompareErrs = map[Count]error{}
	}
	for _, name := range slices.Sorted(maps.Keys(p.Compare)) {
		path := p.Compare[name]
		var problem error
		c, isCustom := custom[name]
		switch {
		case slices.Contains(Counts, name) || isCustom && c.Err == nil:
			problem = validatePath(path, string(name))
		case name.Total():
			problem = errors.New("a total cannot be compared: tally's total counts only the pods that finished since it tracked the kind, so it differs from the operator's by what came before")
		case isCustom:
			problem = fmt.Errorf("custom count %q cannot be kept, so it cannot be compared", name)
		default:
			problem = fmt.Errorf("unknown count %q, must be one of completing, completed, active, unexpected, or a custom count of the kind", name)
		}
		for _, other := range slices.Sorted(maps.Keys(written)) {
			if problem == nil && (other == path || strings.HasPrefix(other, path+".") || strings.HasPrefix(path, other+".")) {
				problem = fmt.Errorf("field path %q overlaps %q, which tally writes (%s): shadow mode compares a field the operator keeps "+
					"with tally's count written to a field of its own (e.g. map %s to status.tally.%s)", path, other, written[other], name, name)
			}
		}
		if problem != nil {
			p.CompareErrs[name] = fmt.Errorf("%s.compare.%s: %w", at, name, problem)
			delete(p.Compare, name)
		}
	}
	if len(p.CompareErrs) == 0 {
		p.CompareErrs = nil
	}
}

// validatePath checks a dotted field path under status; example names the
// field in the message's example.
func validatePath(path, example string) error {
	segments := strings.Split(path, ".")
	if len(segments) < 2 || segments[0] != "status" {
		return fmt.Errorf("field path %q must be under status. (e.g. status.%s)", path, example)
	}
	for _, s := range segments[1:] {
		if !fieldSegment.MatchString(s) {
			return fmt.Errorf("field path %q has an invalid segment %q", path, s)
		}
	}
	return nil
}
