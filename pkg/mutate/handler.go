package mutate

import (
	"bytes"
	"errors"
	"fmt"
	jsonv2 "github.com/go-json-experiment/json"
	"io"
	"mime"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/semaphore"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// Path is where the webhook serves pod admission requests.
const Path = "/mutate-pods"

// MaxBodyBytes bounds an AdmissionReview body. The API server accepts a
// request body of at most 3 MiB, so the pod it sends is at most that large;
// a review carries the object and the old object, and an envelope (user
// info, options) of a few KiB.
const MaxBodyBytes = 2*(3<<20) + 256<<10

// BodyBudget bounds the memory all requests' bodies may hold at once. A
// body is read as its bytes arrive (an announced length reserves nothing),
// in chunks that reserve their share of the budget first: clients that send
// large bodies slowly wait for each other instead of exhausting memory.
const BodyBudget = 64 << 20

// bodyChunk is the unit a body is read and reserved in; a typical review
// (a few KiB) takes one.
const bodyChunk = 16 << 10

var admissions = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "tally_webhook_admissions_total",
	Help: "Pod admission requests answered by the tally webhook, by operation and result (unchanged, patched, denied, error, ignored, unavailable).",
}, []string{"operation", "result"})

func init() {
	metrics.Registry.MustRegister(admissions)
}

// Handler is the HTTP adapter around a Mutator: it decodes an AdmissionReview
// in one pass, reading only the pods' metadata, asks the Mutator, and
// answers with a minimal JSON patch.
type Handler struct {
	mutator *Mutator
	log     logr.Logger
	now     func() time.Time
	budget  *semaphore.Weighted
}

var _ http.Handler = (*Handler)(nil)

// NewHandler returns a Handler for m that logs to log.
func NewHandler(m *Mutator, log logr.Logger) *Handler {
	return &Handler{mutator: m, log: log, now: time.Now, budget: semaphore.NewWeighted(BodyBudget)}
}

// review is an AdmissionReview, decoded only as deep as the webhook reads.
type review struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Request    *request `json:"request"`
}

type request struct {
	UID         types.UID               `json:"uid"`
	Kind        metav1.GroupVersionKind `json:"kind"`
	SubResource string                  `json:"subResource"`
	Namespace   string                  `json:"namespace"`
	Operation   Operation               `json:"operation"`
	UserInfo    struct {
		Username string `json:"username"`
	} `json:"userInfo"`
	Object    *object `json:"object"`
	OldObject *object `json:"oldObject"`
}

type object struct {
	APIVersion string  `json:"apiVersion"`
	Kind       string  `json:"kind"`
	Metadata   PodMeta `json:"metadata"`
}

var bufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// ServeHTTP answers one AdmissionReview. Whatever the body, the answer is a
// well-formed AdmissionReview whose message says what was wrong.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	buf := bufs.Get().(*bytes.Buffer)
	buf.Reset()
	defer func() {
		// Keep typical buffers; let a rare huge one go.
		if buf.Cap() <= 1<<20 {
			bufs.Put(buf)
		}
	}()

	var rev review
	var reserved int64
	resp, op := h.answer(r, buf, &rev, &reserved)
	h.budget.Release(reserved)
	admissions.WithLabelValues(operationLabel(op), resp.result).Inc()

	if resp.unavailable {
		http.Error(w, resp.message, http.StatusServiceUnavailable)
		return
	}
	// The body is decoded: its buffer holds the answer.
	buf.Reset()
	out := appendReview(buf.AvailableBuffer(), &resp)
	w.Header()["Content-Type"] = jsonContentType
	if _, err := w.Write(out); err != nil {
		h.log.V(1).Info("Writing AdmissionReview response failed", "error", err.Error())
	}
}

var jsonContentType = []string{"application/json"}

// operationLabel bounds the metric's operation label to the operations the
// API server sends.
func operationLabel(op string) string {
	switch op {
	case "CREATE", "UPDATE", "DELETE", "CONNECT":
		return op
	}
	return "unknown"
}

func (h *Handler) answer(r *http.Request, buf *bytes.Buffer, rev *review, reserved *int64) (response, string) {
	if err := h.readBody(r, buf, reserved); err != nil {
		h.log.Info("Rejecting unreadable admission request", "error", err.Error())
		return errored("", err), ""
	}
	// One pass over the body that keeps only the pods' metadata: the rest of
	// each pod is skipped, not decoded.
	if err := jsonv2.Unmarshal(buf.Bytes(), rev); err != nil {
		h.log.Info("Rejecting malformed AdmissionReview", "error", err.Error())
		return errored("", fmt.Errorf("decoding AdmissionReview: %w", err)), ""
	}
	req := rev.Request
	if err := validate(rev); err != nil {
		var uid types.UID
		if req != nil {
			uid = req.UID
		}
		h.log.Info("Rejecting invalid AdmissionReview", "error", err.Error())
		return errored(uid, err), ""
	}
	op := string(req.Operation)
	allowed := response{uid: req.UID, allowed: true, result: "unchanged"}
	if req.Kind.Group != "" || req.Kind.Kind != "Pod" || req.SubResource != "" {
		allowed.result = "ignored"
		allowed.message = fmt.Sprintf("tally handles pods only; %s/%s %s (subresource %q) passes unchanged", req.Kind.Group, req.Kind.Version, req.Kind.Kind, req.SubResource)
		return allowed, op
	}
	if req.Operation != Create && req.Operation != Update {
		allowed.result = "ignored"
		return allowed, op
	}
	if err := checkObjects(req); err != nil {
		h.log.Info("Rejecting invalid AdmissionReview", "uid", req.UID, "error", err.Error())
		return errored(req.UID, err), op
	}

	in := Input{Operation: req.Operation, User: req.UserInfo.Username, Pod: &req.Object.Metadata, Now: h.now()}
	if in.Pod.Namespace == "" {
		in.Pod.Namespace = req.Namespace
	}
	if req.OldObject != nil {
		in.Old = &req.OldObject.Metadata
	}
	d := h.mutator.Decide(r.Context(), in)
	if d.Unavailable != "" {
		h.log.Info("Failing pod admission: the owner could not be verified", "uid", req.UID, "namespace", req.Namespace, "reason", d.Unavailable)
		return unavailable(d.Unavailable), op
	}
	if d.Denied != "" {
		h.log.Info("Denied pod admission", "uid", req.UID, "namespace", req.Namespace, "user", in.User, "reason", d.Denied)
		return denied(req.UID, d.Denied), op
	}
	allowed.warnings = d.Warnings
	if len(d.Patch) > 0 {
		allowed.patch = AppendPatch(nil, d.Patch)
		allowed.result = "patched"
		if log := h.log.V(1); log.Enabled() {
			log.Info("Patched pod", "uid", req.UID, "namespace", req.Namespace, "operations", len(d.Patch), "warnings", d.Warnings)
		}
	}
	return allowed, op
}

// readBody reads the request's body into buf as its bytes arrive,
// reserving each chunk from the handler's budget first (adding to
// *reserved, which the caller releases).
func (h *Handler) readBody(r *http.Request, buf *bytes.Buffer, reserved *int64) error {
	if r.Method != http.MethodPost {
		return fmt.Errorf("method %s: an AdmissionReview is sent with POST", r.Method)
	}
	if ct := r.Header.Get("Content-Type"); ct != "" && ct != "application/json" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			return fmt.Errorf("Content-Type %q: an AdmissionReview is sent as application/json", ct)
		}
	}
	if r.Body == nil {
		return errors.New("empty body: expected an AdmissionReview")
	}
	if r.ContentLength > MaxBodyBytes {
		return fmt.Errorf("body of %d bytes exceeds the limit of %d bytes", r.ContentLength, MaxBodyBytes)
	}
	body := io.LimitReader(r.Body, MaxBodyBytes+1)
	for {
		if err := h.budget.Acquire(r.Context(), bodyChunk); err != nil {
			return fmt.Errorf("waiting for memory to read the body: %w", err)
		}
		*reserved += bodyChunk
		buf.Grow(bodyChunk)
		chunk := buf.AvailableBuffer()[:bodyChunk]
		n, err := io.ReadFull(body, chunk)
		buf.Write(chunk[:n])
		switch {
		case buf.Len() > MaxBodyBytes:
			return fmt.Errorf("body exceeds the limit of %d bytes", MaxBodyBytes)
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			if buf.Len() == 0 {
				return errors.New("empty body: expected an AdmissionReview")
			}
			return nil
		case err != nil:
			return fmt.Errorf("reading body: %w", err)
		}
	}
}

func validate(rev *review) error {
	switch {
	case rev.Kind != "AdmissionReview":
		return fmt.Errorf("kind %q: expected an AdmissionReview", rev.Kind)
	case rev.APIVersion != "admission.k8s.io/v1":
		return fmt.Errorf("apiVersion %q: only admission.k8s.io/v1 AdmissionReviews are served", rev.APIVersion)
	case rev.Request == nil:
		return errors.New("AdmissionReview has no request")
	case rev.Request.UID == "":
		return errors.New("request.uid is missing")
	}
	return nil
}

func checkObjects(req *request) error {
	if req.Object == nil {
		return fmt.Errorf("request.object is missing on %s", req.Operation)
	}
	if req.Operation == Update && req.OldObject == nil {
		return errors.New("request.oldObject is missing on UPDATE")
	}
	if err := checkPod("object", req.Object); err != nil {
		return err
	}
	return checkPod("oldObject", req.OldObject)
}

func checkPod(name string, o *object) error {
	if o != nil && o.Kind != "" && (o.Kind != "Pod" || o.APIVersion != "v1") {
		return fmt.Errorf("request.%s is a %s %s, not a v1 Pod", name, o.APIVersion, o.Kind)
	}
	return nil
}
