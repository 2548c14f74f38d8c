package mutate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
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

// WedgedAfter is how long reviews may wait with none answered, or a class of
// bodies refuse every request for memory while none of it is freed, before
// Healthy reports the admission path wedged. It is longer than any review
// takes: the server gives a request at most 20 s.
const WedgedAfter = 30 * time.Second

// wedgedAfter is WedgedAfter, except in builds with the tallyfault tag.
var wedgedAfter = WedgedAfter

// BodyDeadline is how long a body of n bytes may take to arrive: 2 s, plus
// a second per MiB. The API server sends a review it holds in memory at once;
// a client that trickles its body loses its connection, and its reservation,
// within seconds.
func BodyDeadline(n int64) time.Duration {
	return 2*time.Second + time.Duration(n)*time.Second/(1<<20)
}

var (
	admissions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_webhook_admissions_total",
		Help: "Pod admission requests answered by the tally webhook, by operation and result (unchanged, patched, denied, error, ignored, unavailable).",
	}, []string{"operation", "result"})
	memoryRefused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_webhook_memory_refused_total",
		Help: "Requests refused (HTTP 503) because their body's class of memory stayed full for the whole wait, by class (small, medium, large).",
	}, []string{"class"})
	decodeRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tally_webhook_decode_refused_total",
		Help: "Requests refused (HTTP 400) before their body was decoded whole, because decoding it would keep more than the decode allowance: no pod's review needs that much.",
	})
	memoryWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tally_webhook_memory_wait_seconds",
		Help:    "Time requests waited for their body's memory, by class; requests that got it at once are not observed.",
		Buckets: []float64{0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1},
	}, []string{"class"})
	admissionDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tally_webhook_admission_duration_seconds",
		Help:    "Time from a request's arrival to its answer, its body's read and any wait for memory included, by operation.",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
	}, []string{"operation"})
)

// admissionResults are the values of tally_webhook_admissions_total's result
// label.
var admissionResults = []string{"unchanged", "patched", "denied", "late", "error", "ignored", "unavailable"}

func init() {
	metrics.Registry.MustRegister(admissions, memoryRefused, decodeRefused, memoryWait, admissionDuration)
	// Every series an alert or the dashboard reads exists from the start, at
	// zero, so that a rate over it is defined before its first event.
	for _, op := range []string{"CREATE", "UPDATE"} {
		admissionDuration.WithLabelValues(op)
		for _, result := range admissionResults {
			admissions.WithLabelValues(op, result)
		}
	}
	for _, class := range []string{"small", "medium", "large"} {
		memoryRefused.WithLabelValues(class)
	}
}

// fault is nil, except in builds with the tallyfault tag (the hostile
// suite's), where it can hold reviews to wedge the admission path.
var fault func(context.Context)

// Handler is the HTTP adapter around a Mutator: it decodes an AdmissionReview
// in one pass, reading only the pods' metadata, asks the Mutator, and
// answers with a minimal JSON patch.
type Handler struct {
	mutator *Mutator
	log     logr.Logger
	now     func() time.Time
	budget  *budget

	mu sync.Mutex
	// deciding counts the reviews read whole and not yet answered; waitFrom
	// is when the last was answered, or when deciding became non-zero.
	deciding int
	waitFrom time.Time
}

var _ http.Handler = (*Handler)(nil)

// NewHandler returns a Handler for m that logs to log.
func NewHandler(m *Mutator, log logr.Logger) *Handler {
	return &Handler{mutator: m, log: log, now: time.Now, budget: newBudget(MemoryWait)}
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
	Object    *object       `json:"object"`
	OldObject *storedObject `json:"oldObject"`
}

// object is the pod a request asks for. Its status is not decoded: the API
// server drops a client's status on a pod CREATE or UPDATE, and the
// decision reads the stored pod's.
type object struct {
	APIVersion string  `json:"apiVersion"`
	Kind       string  `json:"kind"`
	Metadata   PodMeta `json:"metadata"`
}

// storedObject is the stored pod, on UPDATE: its phase says whether it has
// finished.
type storedObject struct {
	APIVersion string  `json:"apiVersion"`
	Kind       string  `json:"kind"`
	Metadata   PodMeta `json:"metadata"`
	Status     struct {
		Phase corev1.PodPhase `json:"phase"`
	} `json:"status"`
}

// ServeHTTP answers one AdmissionReview. Whatever the body, the answer is a
// well-formed AdmissionReview whose message says what was wrong.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	var rev review
	var held reservation
	var buf *bytes.Buffer
	resp, op := func() (response, string) {
		// Released even if answer panics (net/http recovers the handler's
		// panics): a reservation lost would be memory lost for good.
		defer func() { held.release() }()
		return h.answer(w, r, &buf, &rev, &held)
	}()
	if buf == nil {
		buf = reservation{}.buffer()
	}
	defer putBuffer(buf)
	admissions.WithLabelValues(operationLabel(op), resp.result).Inc()
	defer func() { admissionDuration.WithLabelValues(operationLabel(op)).Observe(time.Since(start).Seconds()) }()

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

// answer reads and decides one review. The body is read into *buf, a
// buffer its reservation (*held) covers; it returns the response and the
// operation.
func (h *Handler) answer(w http.ResponseWriter, r *http.Request, bufp **bytes.Buffer, rev *review, held *reservation) (response, string) {
	if err := h.checkRequest(r); err != nil {
		h.log.Info("Rejecting unreadable admission request", "error", err.Error())
		return errored("", err), ""
	}
	res, _, err := h.budget.reserve(r.Context(), r.ContentLength, h.now)
	if err != nil {
		h.log.Info("Refusing a request: no memory for its body", "remote", r.RemoteAddr, "contentLength", r.ContentLength, "error", err.Error())
		return unavailable(err.Error()), ""
	}
	*held = res
	buf := res.buffer()
	*bufp = buf
	// Errors mean the server cannot set deadlines (tests): its own
	// ReadTimeout still applies.
	_ = http.NewResponseController(w).SetReadDeadline(h.now().Add(BodyDeadline(res.limit)))
	if err := readBody(r, buf, res.limit); err != nil {
		h.log.Info("Rejecting unreadable admission request", "remote", r.RemoteAddr, "error", err.Error())
		return errored("", err), ""
	}
	h.startDeciding()
	defer h.doneDeciding()
	if fault != nil {
		fault(r.Context())
	}
	// One pass over the body that keeps only what the decision reads, and
	// at most DecodeAllowance of it: the rest is skipped, not decoded.
	if err := decodeReview(buf.Bytes(), rev); err != nil {
		if errors.Is(err, errOverAllowance) {
			// The API server sends the request's uid first: the refusal
			// answers that request, or the API server would take it for
			// a failed call and apply the failure policy.
			var uid types.UID
			if rev.Request != nil {
				uid = rev.Request.UID
			}
			decodeRefused.Inc()
			h.log.Info("Refusing an AdmissionReview before decoding it whole", "uid", uid, "remote", r.RemoteAddr, "bytes", buf.Len(), "error", err.Error())
			return errored(uid, fmt.Errorf("AdmissionReview refused: %w", err)), ""
		}
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
		in.Old, in.OldPhase = &req.OldObject.Metadata, req.OldObject.Status.Phase
	}
	d := h.mutator.Decide(r.Context(), in)
	if d.Unavailable != "" {
		h.log.Info("Failing pod admission: the owner could not be verified", "uid", req.UID, "namespace", req.Namespace, "reason", d.Unavailable)
		return unavailable(d.Unavailable), op
	}
	if d.Denied != "" {
		h.log.Info("Denied pod admission", "uid", req.UID, "namespace", req.Namespace, "user", in.User, "reason", d.Denied)
		resp := denied(req.UID, d.Denied)
		if d.Conflict {
			resp = conflicted(req.UID, fmt.Sprintf("the pod was modified since resourceVersion %s was read (stored: %s); read it again and retry. Against the stored pod: %s",
				in.Pod.ResourceVersion, in.Old.ResourceVersion, d.Denied))
		}
		if d.Late {
			resp.result = "late"
		}
		return resp, op
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

// checkRequest refuses what cannot be an AdmissionReview before any memory
// is reserved for its body.
func (h *Handler) checkRequest(r *http.Request) error {
	if r.Method != http.MethodPost {
		return fmt.Errorf("method %s: an AdmissionReview is sent with POST", r.Method)
	}
	if ct := r.Header.Get("Content-Type"); ct != "" && ct != "application/json" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			return fmt.Errorf("Content-Type %q: an AdmissionReview is sent as application/json", ct)
		}
	}
	if r.Body == nil || r.ContentLength == 0 {
		return errors.New("empty body: expected an AdmissionReview")
	}
	if r.ContentLength > MaxBodyBytes {
		return fmt.Errorf("body of %d bytes exceeds the limit of %d bytes", r.ContentLength, MaxBodyBytes)
	}
	return nil
}

// readBody reads the request's body, of at most limit bytes, into buf,
// whose capacity its reservation covers (limit and bytes.MinRead). It reads
// into that capacity only, whatever the transfer encoding: a body that goes
// past limit (only one of unknown length can: net/http ends a body at its
// Content-Length) is refused at its limit+1st byte, and buf never grows.
func readBody(r *http.Request, buf *bytes.Buffer, limit int64) error {
	room := buf.AvailableBuffer()[:limit+1]
	n, err := io.ReadFull(r.Body, room)
	switch {
	case err == nil:
		return fmt.Errorf("body exceeds the limit of %d bytes", MaxBodyBytes)
	case !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF):
		return fmt.Errorf("reading body: %w", err)
	case n == 0:
		return errors.New("empty body: expected an AdmissionReview")
	}
	buf.Write(room[:n])
	return nil
}

func (h *Handler) startDeciding() {
	h.mu.Lock()
	if h.deciding == 0 {
		h.waitFrom = h.now()
	}
	h.deciding++
	h.mu.Unlock()
}

func (h *Handler) doneDeciding() {
	h.mu.Lock()
	h.deciding--
	h.waitFrom = h.now()
	h.mu.Unlock()
}

// Healthy reports whether the handler can admit: it fails when reviews have
// waited with none answered, or a class of bodies has refused every request
// for memory while none of it was freed, for longer than WedgedAfter, so
// that the kubelet restarts a wedged replica. Clients
// that stall their bodies do not make it fail: their reservations are freed
// within BodyDeadline.
func (h *Handler) Healthy() error {
	now, bound := h.now(), wedgedAfter
	h.mu.Lock()
	deciding, since := h.deciding, now.Sub(h.waitFrom)
	h.mu.Unlock()
	if deciding > 0 && since > bound {
		return fmt.Errorf("%d admission reviews waiting and none answered for %s", deciding, since.Round(time.Second))
	}
	return h.budget.stuck(now, bound)
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
	if err := checkPod("object", req.Object.APIVersion, req.Object.Kind); err != nil {
		return err
	}
	if req.OldObject == nil {
		return nil
	}
	return checkPod("oldObject", req.OldObject.APIVersion, req.OldObject.Kind)
}

func checkPod(name, apiVersion, kind string) error {
	if kind != "" && (kind != "Pod" || apiVersion != "v1") {
		return fmt.Errorf("request.%s is a %s %s, not a v1 Pod", name, apiVersion, kind)
	}
	return nil
}
