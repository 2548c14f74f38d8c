package mutate

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"tally.dev/tally/pkg/keys"
)

// The benchmarks compare, on the same realistic ~4 KiB pod:
//   - BenchmarkAdmission: tally's handler (one-pass metadata decode, patch
//     built from the decision);
//   - BenchmarkConventional: the same decision answered the usual way, by
//     decoding the whole pod, mutating a copy, marshalling it and diffing with
//     admission.PatchResponseFromRaw;
//   - BenchmarkFloor: controller-runtime decoding the AdmissionReview and
//     answering allowed with no patch.
// docs/benchmarks.md records their ratios.

func init() {
	// controller-runtime's admission.Webhook, used by the baselines, logs.
	logf.SetLogger(logr.Discard())
}

func benchRequests(b *testing.B) map[string][]byte {
	intent := stamped().Build()
	intent.Spec = realisticPod().Spec
	withIntent := intent.DeepCopy()
	withIntent.Annotations[keys.CompletionIntent] = "scale-down"
	return map[string][]byte{
		"create":        reviewBody(b, admissionv1.Create, realisticPod(), nil),
		"intent-update": reviewBody(b, admissionv1.Update, withIntent, intent),
	}
}

// discard is a reusable http.ResponseWriter.
type discard struct{ h http.Header }

func (d *discard) Header() http.Header         { return d.h }
func (d *discard) Write(p []byte) (int, error) { return len(p), nil }
func (d *discard) WriteHeader(int)             {}

func run(b *testing.B, h http.Handler, body []byte) {
	r, err := http.NewRequest(http.MethodPost, Path, nil)
	if err != nil {
		b.Fatal(err)
	}
	r.Header.Set("Content-Type", "application/json")
	rd := bytes.NewReader(body)
	w := &discard{h: http.Header{}}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		rd.Reset(body)
		r.Body = io.NopCloser(rd)
		r.ContentLength = int64(len(body))
		h.ServeHTTP(w, r)
	}
}

func BenchmarkAdmission(b *testing.B) {
	h := newTestHandler()
	for name, body := range benchRequests(b) {
		b.Run(name, func(b *testing.B) { run(b, h, body) })
	}
}

func BenchmarkConventional(b *testing.B) {
	m := NewMutator(parents, nil)
	decoder := admission.NewDecoder(clientgoscheme.Scheme)
	wh := &admission.Webhook{Handler: admission.HandlerFunc(func(ctx context.Context, req admission.Request) admission.Response {
		pod := &corev1.Pod{}
		if err := decoder.Decode(req, pod); err != nil {
			return admission.Errored(http.StatusBadRequest, err)
		}
		in := Input{Operation: Operation(req.Operation), User: req.UserInfo.Username, Pod: podMeta(pod), Now: now}
		if len(req.OldObject.Raw) > 0 {
			old := &corev1.Pod{}
			if err := decoder.DecodeRaw(req.OldObject, old); err != nil {
				return admission.Errored(http.StatusBadRequest, err)
			}
			in.Old = podMeta(old)
		}
		d := m.Decide(ctx, in)
		if d.Denied != "" {
			return admission.Denied(d.Denied)
		}
		mutated := pod.DeepCopy()
		applyToPod(mutated, d.Patch)
		raw, err := json.Marshal(mutated)
		if err != nil {
			return admission.Errored(http.StatusInternalServerError, err)
		}
		return admission.PatchResponseFromRaw(req.Object.Raw, raw).WithWarnings(d.Warnings...)
	})}
	for name, body := range benchRequests(b) {
		b.Run(name, func(b *testing.B) { run(b, wh, body) })
	}
}

func BenchmarkFloor(b *testing.B) {
	wh := &admission.Webhook{Handler: admission.HandlerFunc(func(context.Context, admission.Request) admission.Response {
		return admission.Allowed("")
	})}
	for name, body := range benchRequests(b) {
		b.Run(name, func(b *testing.B) { run(b, wh, body) })
	}
}

func podMeta(p *corev1.Pod) *PodMeta {
	return &PodMeta{Namespace: p.Namespace, Labels: p.Labels, Annotations: p.Annotations, OwnerReferences: p.OwnerReferences}
}

// applyToPod sets on a typed pod what the decision's operations set, as a
// conventional defaulter mutating a Go object would.
func applyToPod(p *corev1.Pod, ops []PatchOp) {
	for _, op := range ops {
		m := &p.Annotations
		field, key := "/metadata/annotations", ""
		if len(op.Path) >= len("/metadata/labels") && op.Path[:len("/metadata/labels")] == "/metadata/labels" {
			m, field = &p.Labels, "/metadata/labels"
		}
		if len(op.Path) > len(field) {
			key = unescapePointer(op.Path[len(field)+1:])
		}
		if *m == nil {
			*m = map[string]string{}
		}
		switch {
		case op.Op == "remove":
			delete(*m, key)
		case op.MapKey != "":
			(*m)[op.MapKey] = op.Value
		default:
			(*m)[key] = op.Value
		}
	}
}

func unescapePointer(s string) string {
	var out []byte
	for i := 0; i < len(s); i++ {
		if s[i] == '~' && i+1 < len(s) {
			out = append(out, map[byte]byte{'0': '~', '1': '/'}[s[i+1]])
			i++
			continue
		}
		out = append(out, s[i])
	}
	return string(out)
}
