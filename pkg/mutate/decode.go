package mutate

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"tally.dev/tally/pkg/keys"
)

// DecodeAllowance bounds the memory that decoding one review keeps, beyond
// the buffer its body was read into. Decoding keeps only what the decision
// reads: the envelope's few strings, and of each pod's metadata the labels
// and annotations tally defines (tallyKeys), its controller
// ownerReference, where the tracking finalizer stands among its finalizers,
// its namespace, resourceVersion, deletion time and phase. Everything else
// of the body (the spec, the other labels, annotations, owners and
// finalizers' names, unknown fields) is read and skipped without being
// kept. What is kept is charged as it is decoded, at what the Go runtime
// holds for it (unquote and the costs below); a review whose charge passes
// the allowance is refused before the rest is decoded. An ordinary pod's
// review keeps a few hundred bytes; one from the API server passes the
// allowance only with more than a thousand finalizers in a pod, or an
// owner reference or an envelope string of tens of KiB. The allowance is
// reserved with the body's memory (budget.class).
const DecodeAllowance = 64 << 10

// What the Go runtime holds for a kept value, beyond its bytes.
const (
	// stringCost is a string header.
	stringCost = 16
	// entryCost is a map entry: its key and value headers, its share of
	// the table and of the table's growth.
	entryCost = 96
	// ownerCost is an OwnerReference (four strings, two pointers, two
	// bools).
	ownerCost = 96
)

// errOverAllowance is what a review whose decoding passes DecodeAllowance is
// refused with.
var errOverAllowance = fmt.Errorf("decoding it would keep more than %d bytes: no pod's review needs that much (thousands of tally.dev/ keys, owner references or finalizers)", DecodeAllowance)

// meter charges what decoding one review keeps against DecodeAllowance.
type meter struct {
	left    int64
	opts    jsonv2.Options
	strings [interned]string
}

// meters holds meters with their decoding options built once, so that a
// review builds none.
var meters = sync.Pool{New: func() any {
	m := &meter{}
	m.opts = jsonv2.JoinOptions(
		// Checking duplicate names keeps every member name of every
		// object, skipped or not: a body of a million keys would cost a
		// million names. The API server sends none; a client that does is
		// answered and nothing else.
		jsontext.AllowDuplicateNames(true),
		jsonv2.WithUnmarshalers(jsonv2.JoinUnmarshalers(
			jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, s *string) error { return m.string(dec, s) }),
			jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, s *types.UID) error { return m.string(dec, (*string)(s)) }),
			jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, s *Operation) error { return m.string(dec, (*string)(s)) }),
			jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, s *corev1.PodPhase) error { return m.string(dec, (*string)(s)) }),
			jsonv2.UnmarshalFromFunc(m.time),
			jsonv2.UnmarshalFromFunc(m.tallyKeys),
			jsonv2.UnmarshalFromFunc(m.controller),
			jsonv2.UnmarshalFromFunc(m.names),
		)),
	)
	return m
}}

// decodeReview decodes body into rev, keeping only what the decision reads
// and at most DecodeAllowance of it.
func decodeReview(body []byte, rev *review) error {
	m := meters.Get().(*meter)
	defer meters.Put(m)
	m.left = DecodeAllowance
	return jsonv2.Unmarshal(body, rev, m.opts)
}

func (m *meter) charge(n int) error {
	m.left -= int64(n)
	if m.left < 0 {
		return errOverAllowance
	}
	return nil
}

// string decodes a JSON string (or null) into s, charged before it is
// unquoted: what it keeps is at most its quoted length.
func (m *meter) string(dec *jsontext.Decoder, s *string) error {
	switch dec.PeekKind() {
	case 'n':
		_, err := dec.ReadToken()
		*s = ""
		return err
	case '"':
	default:
		return errors.ErrUnsupported // the default decoding reports the error
	}
	raw, err := dec.ReadValue()
	if err != nil {
		return err
	}
	*s, err = m.unquote(raw)
	return err
}

// unquote returns the string a quoted JSON string holds, charged before it
// is unquoted: it keeps at most its quoted length.
func (m *meter) unquote(raw jsontext.Value) (string, error) {
	if err := m.charge(stringCost + len(raw)); err != nil {
		return "", err
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		// Nothing escaped: the decoder has checked it, only the quotes go.
		return m.intern(raw[1 : len(raw)-1]), nil
	}
	b, err := jsontext.AppendUnquote(make([]byte, 0, len(raw)), raw)
	return string(b), err
}

// interned is how many short strings a meter keeps to reuse: reviews
// repeat most of theirs (apiVersions, kinds, operations, user and parent
// names), as the decoder's own string cache would.
const interned = 64

// intern returns b as a string, the one a review decoded before when it is
// short and was.
func (m *meter) intern(b []byte) string {
	if len(b) > 48 {
		return string(b)
	}
	h := uint32(2166136261)
	for _, c := range b {
		h = (h ^ uint32(c)) * 16777619
	}
	slot := &m.strings[h%interned]
	if *slot != string(b) {
		*slot = string(b)
	}
	return *slot
}

// maxTime bounds a quoted RFC 3339 time: longer is no time.
const maxTime = 64

// time decodes a deletion time, refusing a string too long to be one
// before any of it is copied.
func (m *meter) time(dec *jsontext.Decoder, t *metav1.Time) error {
	if dec.PeekKind() != '"' {
		return errors.ErrUnsupported
	}
	raw, err := dec.ReadValue()
	if err != nil {
		return err
	}
	if len(raw) > maxTime {
		return fmt.Errorf("a string of %d bytes is no RFC 3339 time", len(raw))
	}
	return t.UnmarshalJSON(raw)
}

// tallyKeys decodes labels or annotations, keeping only the keys tally
// defines: the decision reads no other (another tally.dev/ key changes
// nothing it decides). A map that was sent, even empty, is kept non-nil, so
// that a patch adds keys into it rather than replacing it. A value longer
// than maxKept is kept as longValue, which differs from every value the
// webhook writes and from every other long value: no key tally defines has
// a valid value that long, so the decision is the same, and a review from
// the API server never passes the allowance here, whatever its pod carries.
func (m *meter) tallyKeys(dec *jsontext.Decoder, out *map[string]string) error {
	if null, err := open(dec, '{'); err != nil || null {
		*out = nil
		return err
	}
	kept := map[string]string{}
	for dec.PeekKind() != '}' {
		name, err := dec.ReadValue()
		if err != nil {
			return err
		}
		key, ok := tallyKeyNames[string(name)]
		if !ok {
			if err := dec.SkipValue(); err != nil {
				return err
			}
			continue
		}
		if dec.PeekKind() != '"' {
			return fmt.Errorf("%s: a label or annotation value is a string", key)
		}
		raw, err := dec.ReadValue()
		if err != nil {
			return err
		}
		if _, again := kept[key]; !again {
			if err := m.charge(entryCost); err != nil {
				return err
			}
		}
		if len(raw) > maxKept {
			kept[key] = longValue(raw)
			continue
		}
		if kept[key], err = m.unquote(raw); err != nil {
			return err
		}
	}
	if _, err := dec.ReadToken(); err != nil {
		return err
	}
	*out = kept
	return nil
}

// open reads the start of the object or array (kind '{' or '[') that
// comes next, or the null that stands for none (null). Anything else is
// errors.ErrUnsupported, read not at all: the default decoding reports it.
func open(dec *jsontext.Decoder, kind jsontext.Kind) (null bool, err error) {
	switch dec.PeekKind() {
	case 'n':
		_, err := dec.ReadToken()
		return true, err
	case kind:
		_, err := dec.ReadToken()
		return false, err
	}
	return false, errors.ErrUnsupported
}

// tallyKeyNames are the keys tally defines, by their JSON form.
var tallyKeyNames = func() map[string]string {
	names := map[string]string{}
	for _, k := range []string{keys.ParentUID, keys.ParentName, keys.Parent, keys.CompletionIntent, keys.CompletionIntentAt, keys.CompletionIntentBy} {
		names[`"`+k+`"`] = k
	}
	return names
}()

// maxKept is the longest value of a key tally defines that decoding keeps:
// longer than any valid one (a label value is at most 63 characters, a
// reason token 63, a parent's identity a few hundred).
const maxKept = 1 << 10

// longValue stands for a quoted value longer than maxKept: its length and
// a hash of it, so that two long values differ when they do.
func longValue(raw jsontext.Value) string {
	h := fnv.New64a()
	_, _ = h.Write(raw)
	return fmt.Sprintf("tally:value-of-%d-bytes-%016x", len(raw), h.Sum64())
}

var controllerName = []byte(`"controller"`)

// trackingName is the tracking finalizer's JSON form.
const trackingName = `"` + keys.TrackingFinalizer + `"`

// controller decodes ownerReferences, keeping only the first controller
// reference: the only one the decision reads (identity.Controller).
func (m *meter) controller(dec *jsontext.Decoder, out *[]metav1.OwnerReference) error {
	if null, err := open(dec, '['); err != nil || null {
		*out = nil
		return err
	}
	var kept []metav1.OwnerReference
	for dec.PeekKind() != ']' {
		raw, err := dec.ReadValue()
		if err != nil {
			return err
		}
		if kept != nil || !bytes.Contains(raw, controllerName) {
			continue
		}
		// Whether it is the controller, read without copying its strings.
		var c struct {
			Controller bool `json:"controller"`
		}
		if err := jsonv2.Unmarshal(raw, &c, jsontext.AllowDuplicateNames(true)); err != nil {
			return err
		}
		if !c.Controller {
			continue
		}
		if err := m.charge(ownerCost); err != nil {
			return err
		}
		var ref metav1.OwnerReference
		if err := jsonv2.Unmarshal(raw, &ref, m.opts); err != nil {
			return err
		}
		kept = []metav1.OwnerReference{ref}
	}
	if _, err := dec.ReadToken(); err != nil {
		return err
	}
	if kept == nil {
		kept = []metav1.OwnerReference{}
	}
	*out = kept
	return nil
}

// names decodes a pod's finalizers: the decision reads only where
// tally.dev/tracking stands among them, so the others are kept as "",
// each charged for its place in the list.
func (m *meter) names(dec *jsontext.Decoder, out *[]string) error {
	if null, err := open(dec, '['); err != nil || null {
		*out = nil
		return err
	}
	kept := []string{}
	for dec.PeekKind() != ']' {
		raw, err := dec.ReadValue()
		if err != nil {
			return err
		}
		// The slice's growth: at most twice what it holds.
		if err := m.charge(2 * stringCost); err != nil {
			return err
		}
		name := ""
		if string(raw) == trackingName {
			name = keys.TrackingFinalizer
		}
		kept = append(kept, name)
	}
	if _, err := dec.ReadToken(); err != nil {
		return err
	}
	*out = kept
	return nil
}
