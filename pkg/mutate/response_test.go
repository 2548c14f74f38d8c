package mutate

import (
	"encoding/json"
	"errors"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// TestAppendReviewMatchesAPITypes: the hand-written encoding is what the
// API types marshal to.
func TestAppendReviewMatchesAPITypes(t *testing.T) {
	tests := map[string]struct {
		resp response
		want admissionv1.AdmissionResponse
	}{
		"allowed": {
			response{uid: "u1", allowed: true},
			admissionv1.AdmissionResponse{UID: "u1", Allowed: true},
		},
		"patched with warnings": {
			response{uid: "u2", allowed: true, patch: []byte(`[{"op":"add","path":"/a","value":"\u00e9"}]`), warnings: []string{`w "1"`, "w\n2"}},
			admissionv1.AdmissionResponse{UID: "u2", Allowed: true, Patch: []byte(`[{"op":"add","path":"/a","value":"\u00e9"}]`),
				PatchType: ptr.To(admissionv1.PatchTypeJSONPatch), Warnings: []string{`w "1"`, "w\n2"}},
		},
		"denied": {
			denied("u3", `annotation "x" is sticky`),
			admissionv1.AdmissionResponse{UID: "u3", Result: &metav1.Status{
				Status: metav1.StatusFailure, Message: `annotation "x" is sticky`, Reason: metav1.StatusReasonForbidden, Code: http.StatusForbidden}},
		},
		"errored": {
			errored("", errors.New("empty body")),
			admissionv1.AdmissionResponse{Result: &metav1.Status{
				Status: metav1.StatusFailure, Message: "empty body", Reason: metav1.StatusReasonBadRequest, Code: http.StatusBadRequest}},
		},
		"allowed with a message": {
			response{uid: "u4", allowed: true, message: "tally handles pods only"},
			admissionv1.AdmissionResponse{UID: "u4", Allowed: true, Result: &metav1.Status{Message: "tally handles pods only"}},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			want, err := json.Marshal(admissionv1.AdmissionReview{
				TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
				Response: &tc.want,
			})
			require.NoError(t, err)
			assert.JSONEq(t, string(want), string(appendReview(nil, &tc.resp)))
		})
	}
}
