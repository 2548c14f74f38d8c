package mutate

import (
	"encoding/base64"
	"net/http"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// response is the webhook's answer to one request, encoded by appendReview
// as an admission.k8s.io/v1 AdmissionReview.
type response struct {
	uid     types.UID
	allowed bool
	// code, reason and message fill the response's status when message is
	// set; a refusal always carries one.
	code     int32
	reason   metav1.StatusReason
	message  string
	patch    []byte
	warnings []string
	// result labels the admissions metric.
	result string
	// unavailable fails the call itself (HTTP 503, no AdmissionReview), so
	// that the API server applies the webhook's failurePolicy.
	unavailable bool
}

func unavailable(message string) response {
	return response{message: message, result: "unavailable", unavailable: true}
}

func errored(uid types.UID, err error) response {
	return response{uid: uid, code: http.StatusBadRequest, reason: metav1.StatusReasonBadRequest, message: err.Error(), result: "error"}
}

func denied(uid types.UID, message string) response {
	return response{uid: uid, code: http.StatusForbidden, reason: metav1.StatusReasonForbidden, message: message, result: "denied"}
}

// conflicted refuses an update as the API server refuses a stale one, so
// that clients retry it from a fresh copy.
func conflicted(uid types.UID, message string) response {
	return response{uid: uid, code: http.StatusConflict, reason: metav1.StatusReasonConflict, message: message, result: "denied"}
}

// appendReview appends r as the JSON of an AdmissionReview, field for field
// what admissionv1.AdmissionReview marshals to, without reflection.
func appendReview(buf []byte, r *response) []byte {
	buf = append(buf, `{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","response":{"uid":`...)
	buf = appendString(buf, string(r.uid))
	buf = append(buf, `,"allowed":`...)
	buf = strconv.AppendBool(buf, r.allowed)
	if r.message != "" {
		buf = append(buf, `,"status":{"metadata":{}`...)
		if !r.allowed {
			buf = append(buf, `,"status":"Failure"`...)
		}
		buf = append(buf, `,"message":`...)
		buf = appendString(buf, r.message)
		if r.reason != "" {
			buf = append(buf, `,"reason":`...)
			buf = appendString(buf, string(r.reason))
		}
		if r.code != 0 {
			buf = append(buf, `,"code":`...)
			buf = strconv.AppendInt(buf, int64(r.code), 10)
		}
		buf = append(buf, '}')
	}
	if len(r.patch) > 0 {
		buf = append(buf, `,"patch":"`...)
		buf = base64.StdEncoding.AppendEncode(buf, r.patch)
		buf = append(buf, `","patchType":"JSONPatch"`...)
	}
	if len(r.warnings) > 0 {
		buf = append(buf, `,"warnings":[`...)
		for i, w := range r.warnings {
			if i > 0 {
				buf = append(buf, ',')
			}
			buf = appendString(buf, w)
		}
		buf = append(buf, ']')
	}
	return append(buf, "}}\n"...)
}
