package mutate

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"tally.dev/tally/pkg/keys"
)

// PatchOp is one RFC 6902 JSON patch operation on a pod's metadata.
type PatchOp struct {
	Op   string
	Path string
	// Value is the string the operation sets; unused by "remove".
	Value string
	// MapKey, when set, makes the value the object {MapKey: Value}: the
	// operation creates the labels or annotations map itself.
	MapKey string
	// List makes the value the array [Value]: the operation creates the
	// finalizers list itself.
	List bool
}

// patcher collects the operations that bring each key of one request to
// the value it must have, with a warning for each value a client supplied
// that had to be set back.
type patcher struct {
	in Input
	d  *Decision
	// created records that an earlier operation created the map, so later
	// keys are added into it rather than creating it again.
	createdLabels, createdAnnotations bool
}

func (p *patcher) label(key, want string, present bool) {
	p.set("labels", "label", p.in.Pod.Labels, oldMap(p.in.Old, true), &p.createdLabels, key, want, present)
}

func (p *patcher) annotation(key, want string, present bool) {
	p.set("annotations", "annotation", p.in.Pod.Annotations, oldMap(p.in.Old, false), &p.createdAnnotations, key, want, present)
}

// finalizer adds f to the pod's finalizers when it does not carry it. Only
// CREATE adds it: the aggregator removes it once the pod is recorded, and no
// later update may bring it back.
func (p *patcher) finalizer(f string) {
	if slices.Contains(p.in.Pod.Finalizers, f) {
		return
	}
	if p.in.Pod.Finalizers == nil {
		p.d.Patch = append(p.d.Patch, PatchOp{Op: "add", Path: "/metadata/finalizers", Value: f, List: true})
		return
	}
	p.d.Patch = append(p.d.Patch, PatchOp{Op: "add", Path: "/metadata/finalizers/-", Value: f})
}

// noFinalizer removes every f from the pod's finalizers, with a warning:
// on CREATE, a client may not add the tracking finalizer, which tally adds
// only to the pods of kinds it records.
func (p *patcher) noFinalizer(f string) {
	removed := false
	for i := len(p.in.Pod.Finalizers) - 1; i >= 0; i-- {
		if p.in.Pod.Finalizers[i] == f {
			p.d.Patch = append(p.d.Patch, PatchOp{Op: "remove", Path: "/metadata/finalizers/" + strconv.Itoa(i)})
			removed = true
		}
	}
	if removed {
		p.d.Warnings = append(p.d.Warnings, fmt.Sprintf("tally: finalizer %s removed: only tally adds it, to the pods of the kinds whose totals it records", f))
	}
}

// drop removes the annotation key, which the request carries, with a
// warning saying why it is not admitted.
func (p *patcher) drop(key, why string) {
	p.d.Patch = append(p.d.Patch, PatchOp{Op: "remove", Path: keyPath("annotations", key)})
	p.d.Warnings = append(p.d.Warnings, fmt.Sprintf("tally: annotation %s=%q removed: tally did not admit it on this pod (set while tally did not see the pod, or while the pod was not tracked), and it is not admitted now: %s; the pod's end counts as unexpected",
		key, p.in.Pod.Annotations[key], why))
}

func oldMap(old *PodMeta, labels bool) map[string]string {
	switch {
	case old == nil:
		return nil
	case labels:
		return old.Labels
	default:
		return old.Annotations
	}
}

func (p *patcher) set(field, noun string, current, old map[string]string, created *bool, key, want string, present bool) {
	got, has := current[key]
	if has == present && got == want {
		return
	}
	if p.d.Patch == nil {
		p.d.Patch = make([]PatchOp, 0, 6)
	}
	path := keyPath(field, key)
	switch {
	case !present:
		p.d.Patch = append(p.d.Patch, PatchOp{Op: "remove", Path: path})
		p.d.Warnings = append(p.d.Warnings, fmt.Sprintf("tally: %s %s removed: only the tally webhook sets it, and this pod must not carry it", noun, key))
		return
	case has:
		p.d.Patch = append(p.d.Patch, PatchOp{Op: "replace", Path: path, Value: want})
		p.d.Warnings = append(p.d.Warnings, fmt.Sprintf("tally: %s %s set back to %q: only the tally webhook sets it", noun, key, want))
		return
	case current == nil && !*created:
		p.d.Patch = append(p.d.Patch, PatchOp{Op: "add", Path: "/metadata/" + field, Value: want, MapKey: key})
		*created = true
	default:
		p.d.Patch = append(p.d.Patch, PatchOp{Op: "add", Path: path, Value: want})
	}
	if _, had := old[key]; had {
		p.d.Warnings = append(p.d.Warnings, fmt.Sprintf("tally: %s %s restored to %q: only the tally webhook sets or removes it", noun, key, want))
	}
}

// keyPaths holds the JSON pointers of the keys the webhook writes, so that
// the admission path does not build them per request.
var keyPaths = func() map[string]string {
	paths := map[string]string{}
	for _, field := range []string{"labels", "annotations"} {
		for _, key := range []string{keys.ParentUID, keys.ParentName, keys.Parent, keys.CompletionIntentAt, keys.CompletionIntentBy} {
			paths[field+"\x00"+key] = "/metadata/" + field + "/" + escapePointer(key)
		}
	}
	return paths
}()

// keyPath returns the JSON pointer of key in the pod's labels or
// annotations.
func keyPath(field, key string) string {
	if path, ok := keyPaths[field+"\x00"+key]; ok {
		return path
	}
	return "/metadata/" + field + "/" + escapePointer(key)
}

// escapePointer escapes a map key for use as an RFC 6901 JSON pointer token.
func escapePointer(key string) string {
	if !strings.ContainsAny(key, "~/") {
		return key
	}
	return strings.ReplaceAll(strings.ReplaceAll(key, "~", "~0"), "/", "~1")
}

// AppendPatch appends the JSON encoding of ops to buf.
func AppendPatch(buf []byte, ops []PatchOp) []byte {
	size := 2
	for _, op := range ops {
		size += 40 + len(op.Op) + len(op.Path) + len(op.Value) + len(op.MapKey)
	}
	buf = slices.Grow(buf, size)
	buf = append(buf, '[')
	for i, op := range ops {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, `{"op":`...)
		buf = appendString(buf, op.Op)
		buf = append(buf, `,"path":`...)
		buf = appendString(buf, op.Path)
		switch {
		case op.Op == "remove":
		case op.List:
			buf = append(buf, `,"value":[`...)
			buf = appendString(buf, op.Value)
			buf = append(buf, ']')
		case op.MapKey != "":
			buf = append(buf, `,"value":{`...)
			buf = appendString(buf, op.MapKey)
			buf = append(buf, ':')
			buf = appendString(buf, op.Value)
			buf = append(buf, '}')
		default:
			buf = append(buf, `,"value":`...)
			buf = appendString(buf, op.Value)
		}
		buf = append(buf, '}')
	}
	return append(buf, ']')
}

const hex = "0123456789abcdef"

// appendString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD, as
// encoding/json does.
func appendString(buf []byte, s string) []byte {
	buf = append(buf, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			buf = append(buf, s[start:i]...)
			switch c {
			case '"', '\\':
				buf = append(buf, '\\', c)
			case '\n':
				buf = append(buf, '\\', 'n')
			case '\r':
				buf = append(buf, '\\', 'r')
			case '\t':
				buf = append(buf, '\\', 't')
			default:
				buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			buf = append(buf, s[start:i]...)
			buf = append(buf, `\ufffd`...)
			i += size
			start = i
			continue
		}
		i += size
	}
	buf = append(buf, s[start:]...)
	return append(buf, '"')
}
