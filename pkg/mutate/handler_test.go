package mutate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
)

func realisticPod() *corev1.Pod {
	return builder.RealisticPod(pod().ControlledBy(pool, "pool-a", uid))
}

func reviewBody(t testing.TB, op admissionv1.Operation, pod, old *corev1.Pod) []byte {
	t.Helper()
	req := &admissionv1.AdmissionRequest{
		UID:       "req-1",
		Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
		Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
		Namespace: "ns",
		Operation: op,
		UserInfo:  authenticationv1.UserInfo{Username: user},
		Object:    runtime.RawExtension{Object: pod},
	}
	if old != nil {
		req.OldObject = runtime.RawExtension{Object: old}
	}
	body, err := json.Marshal(admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request:  req,
	})
	require.NoError(t, err)
	return body
}

func serve(t testing.TB, h http.Handler, body []byte) *admissionv1.AdmissionResponse {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	require.Equal(t, http.StatusOK, w.Code)
	var rev admissionv1.AdmissionReview
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &rev), "response: %s", w.Body.String())
	require.Equal(t, "AdmissionReview", rev.Kind)
	require.Equal(t, "admission.k8s.io/v1", rev.APIVersion)
	require.NotNil(t, rev.Response)
	return rev.Response
}

func newTestHandler() *Handler {
	return NewHandler(NewMutator(parents, nil), logr.Discard())
}

func TestHandlerStampsAndDenies(t *testing.T) {
	h := newTestHandler()

	resp := serve(t, h, reviewBody(t, admissionv1.Create, realisticPod(), nil))
	assert.True(t, resp.Allowed)
	assert.Equal(t, "req-1", string(resp.UID))
	require.NotNil(t, resp.PatchType)
	assert.Equal(t, admissionv1.PatchTypeJSONPatch, *resp.PatchType)
	assert.JSONEq(t, `[
		{"op":"add","path":"/metadata/labels/tally.dev~1parent-uid","value":"`+string(uid)+`"},
		{"op":"add","path":"/metadata/labels/tally.dev~1parent-name","value":"pool-a"},
		{"op":"add","path":"/metadata/annotations/tally.dev~1parent","value":"WorkerPool.example.tally.dev/pool-a"}]`, string(resp.Patch))

	old := withIntent(stamped()).Build()
	resp = serve(t, h, reviewBody(t, admissionv1.Update, stamped().Build(), old))
	assert.False(t, resp.Allowed)
	require.NotNil(t, resp.Result)
	assert.Equal(t, int32(http.StatusForbidden), resp.Result.Code)
	assert.Contains(t, resp.Result.Message, "annotation tally.dev/completion-intent is sticky")

	// The same update from a stale copy: the API server's own 409.
	old = withIntent(stamped()).ResourceVersion("12").Build()
	resp = serve(t, h, reviewBody(t, admissionv1.Update, stamped().ResourceVersion("11").Build(), old))
	assert.False(t, resp.Allowed)
	require.NotNil(t, resp.Result)
	assert.Equal(t, int32(http.StatusConflict), resp.Result.Code)
	assert.Equal(t, metav1.StatusReasonConflict, resp.Result.Reason)
	assert.Contains(t, resp.Result.Message, "resourceVersion 11 was read (stored: 12)")
	assert.Contains(t, resp.Result.Message, "is sticky")

	resp = serve(t, h, reviewBody(t, admissionv1.Create, pod().Build(), nil))
	assert.True(t, resp.Allowed)
	assert.Empty(t, resp.Patch)
}

func TestHandlerBadInput(t *testing.T) {
	good := reviewBody(t, admissionv1.Create, realisticPod(), nil)
	replace := func(old, new string) []byte {
		require.Contains(t, string(good), old)
		return []byte(strings.Replace(string(good), old, new, 1))
	}
	tests := []struct {
		name        string
		method      string
		contentType string
		body        []byte
		wantAllowed bool
		wantMessage string
	}{
		{name: "empty body", body: []byte{}, wantMessage: "empty body: expected an AdmissionReview"},
		{name: "truncated body", body: good[:len(good)/2], wantMessage: "decoding AdmissionReview: jsontext: unexpected EOF within"},
		{name: "not JSON", body: []byte("<xml/>"), wantMessage: "decoding AdmissionReview: jsontext: invalid character '<' at start of value"},
		{name: "not an AdmissionReview", body: []byte(`{"apiVersion":"v1","kind":"Pod"}`), wantMessage: `kind "Pod": expected an AdmissionReview`},
		{name: "v1beta1 review", body: replace(`"apiVersion":"admission.k8s.io/v1"`, `"apiVersion":"admission.k8s.io/v1beta1"`), wantMessage: "only admission.k8s.io/v1 AdmissionReviews are served"},
		{name: "no request", body: []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}`), wantMessage: "AdmissionReview has no request"},
		{name: "no uid", body: replace(`"uid":"req-1"`, `"uid":""`), wantMessage: "request.uid is missing"},
		{name: "missing object", body: replace(`"object":{`, `"object":null,"x":{`), wantMessage: "request.object is missing on CREATE"},
		{name: "object is not a pod", body: replace(`"kind":"Pod","apiVersion":"v1"`, `"kind":"Deployment","apiVersion":"apps/v1"`), wantMessage: "request.object is a apps/v1 Deployment, not a v1 Pod"},
		{name: "labels of the wrong type", body: replace(`"labels":{`, `"labels":7,"x":{`), wantMessage: `unmarshal JSON number into Go map[string]string within "/request/object/metadata/labels"`},
		{name: "another kind is let through", body: replace(`"kind":{"group":"","version":"v1","kind":"Pod"}`, `"kind":{"group":"apps","version":"v1","kind":"Deployment"}`), wantAllowed: true, wantMessage: "tally handles pods only"},
		{name: "wrong content type", contentType: "text/plain", body: good, wantMessage: `Content-Type "text/plain"`},
		{name: "wrong method", method: http.MethodGet, body: good, wantMessage: "method GET"},
		{name: "oversized body", body: append(bytes.Repeat([]byte(" "), MaxBodyBytes), good...), wantMessage: "exceeds the limit"},
	}
	h := newTestHandler()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			method := tc.method
			if method == "" {
				method = http.MethodPost
			}
			r := httptest.NewRequest(method, Path, bytes.NewReader(tc.body))
			ct := tc.contentType
			if ct == "" {
				ct = "application/json"
			}
			r.Header.Set("Content-Type", ct)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			require.Equal(t, http.StatusOK, w.Code)
			var rev admissionv1.AdmissionReview
			require.NoError(t, json.Unmarshal(w.Body.Bytes(), &rev))
			require.NotNil(t, rev.Response)
			assert.Equal(t, tc.wantAllowed, rev.Response.Allowed)
			require.NotNil(t, rev.Response.Result)
			assert.Contains(t, rev.Response.Result.Message, tc.wantMessage)
			assert.Empty(t, rev.Response.Patch)
		})
	}
}

// FuzzHandler feeds the request path real and broken reviews: every answer
// must be a well-formed AdmissionReview, and a patch must be valid JSON.
func FuzzHandler(f *testing.F) {
	create := reviewBody(f, admissionv1.Create, realisticPod(), nil)
	update := reviewBody(f, admissionv1.Update, withIntent(stamped()).Build(), stamped().Build())
	for _, seed := range [][]byte{
		create, update, create[:len(create)/3], []byte(""), []byte("{}"), []byte("null"),
		[]byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x","kind":{"version":"v1","kind":"Pod"},"operation":"UPDATE","object":{"metadata":{}}}}`),
		[]byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x","kind":{"version":"v1","kind":"Pod"},"operation":"CREATE","object":{"metadata":{"ownerReferences":[{"apiVersion":"example.tally.dev/v1","kind":"WorkerPool","name":"a","uid":"u","controller":true}],"labels":null,"annotations":{"tally.dev/completion-intent":"x"}}}}}`),
	} {
		f.Add(seed)
	}
	h := newTestHandler()
	f.Fuzz(func(t *testing.T, body []byte) {
		resp := serve(t, h, body)
		if len(resp.Patch) > 0 {
			require.True(t, json.Valid(resp.Patch), "patch %q", resp.Patch)
			require.True(t, resp.Allowed)
		}
		if !resp.Allowed {
			require.NotNil(t, resp.Result)
			require.NotEmpty(t, resp.Result.Message)
		}
	})
}

func TestHandlerUpdateStampsIntent(t *testing.T) {
	h := newTestHandler()
	resp := serve(t, h, reviewBody(t, admissionv1.Update, stamped().Annotation(keys.CompletionIntent, "scale-down").Build(), stamped().Build()))
	require.True(t, resp.Allowed)
	assert.Contains(t, string(resp.Patch), `"path":"/metadata/annotations/tally.dev~1completion-intent-by","value":"`+user+`"`)
}

// TestHandlerReadsWhetherTheStoredPodFinished: the stored pod's phase and
// deletionTimestamp reach the decision, so an intent set on a pod that has
// finished is refused.
func TestHandlerReadsWhetherTheStoredPodFinished(t *testing.T) {
	h := newTestHandler()
	marked := stamped().Annotation(keys.CompletionIntent, "scale-down").Build()
	for name, old := range map[string]*corev1.Pod{
		"failed":   stamped().Phase(corev1.PodFailed).Build(),
		"deleting": stamped().Phase(corev1.PodRunning).Deleting(time.Now()).Build(),
	} {
		t.Run(name, func(t *testing.T) {
			resp := serve(t, h, reviewBody(t, admissionv1.Update, marked, old))
			assert.False(t, resp.Allowed)
			require.NotNil(t, resp.Result)
			assert.Equal(t, int32(http.StatusForbidden), resp.Result.Code)
			assert.Contains(t, resp.Result.Message, "cannot be set on a pod that has finished")
		})
	}
}

// TestLateMarksAreCountedApart: an intent refused because its pod had
// finished is counted as result "late", not "denied" (a client to fix).
func TestLateMarksAreCountedApart(t *testing.T) {
	h := newTestHandler()
	late := admissions.WithLabelValues("UPDATE", "late")
	denied := admissions.WithLabelValues("UPDATE", "denied")
	lateBefore, deniedBefore := testutil.ToFloat64(late), testutil.ToFloat64(denied)
	serve(t, h, reviewBody(t, admissionv1.Update, stamped().Annotation(keys.CompletionIntent, "scale-down").Build(), stamped().Phase(corev1.PodFailed).Build()))
	assert.Equal(t, lateBefore+1, testutil.ToFloat64(late))
	assert.Equal(t, deniedBefore, testutil.ToFloat64(denied))
	serve(t, h, reviewBody(t, admissionv1.Update, stamped().Build(), withIntent(stamped()).Build()))
	assert.Equal(t, deniedBefore+1, testutil.ToFloat64(denied), "a sticky intent removed is a denial")
}

// TestHandlerFailsTheCallWhenOwnersCannotBeChecked: with verifyOwner and the
// API server unreachable, the call fails (503, no AdmissionReview), so the
// webhook's failurePolicy decides; the pod is never admitted unstamped.
func TestHandlerFailsTheCallWhenOwnersCannotBeChecked(t *testing.T) {
	h := NewHandler(NewMutator(parents, failingChecker{}), logr.Discard())
	r := httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(reviewBody(t, admissionv1.Create, realisticPod(), nil)))
	r.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.Contains(t, w.Body.String(), "could not verify the owner WorkerPool.example.tally.dev/pool-a")
}

// TestReaderOwnerChecker: a missing owner or an unserved kind is a reason
// not to stamp; any other API error is an error, so that the call is
// retried.
func TestReaderOwnerChecker(t *testing.T) {
	owner := identity.Parent{GroupKind: pool.GroupKind(), Name: "pool-a", UID: uid}
	notFound := apierrors.NewNotFound(schema.GroupResource{Group: "example.tally.dev", Resource: "workerpools"}, "pool-a")
	tests := []struct {
		name       string
		live       error
		liveUID    types.UID
		wantOK     bool
		wantReason string
		wantErr    bool
	}{
		{name: "exists with that UID", liveUID: uid, wantOK: true},
		{name: "exists with another UID", liveUID: "other", wantReason: "has UID other, not " + string(uid)},
		{name: "not found", live: notFound, wantReason: "not found in namespace ns"},
		{name: "kind not served", live: &apimeta.NoKindMatchError{GroupKind: pool.GroupKind()}, wantReason: "the API server does not serve"},
		{name: "throttled", live: apierrors.NewTooManyRequests("slow down", 1), wantErr: true},
		{name: "server error", live: apierrors.NewInternalError(errors.New("etcd")), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			live := readerFunc(func(obj client.Object) error {
				obj.SetUID(tc.liveUID)
				return tc.live
			})
			miss := readerFunc(func(client.Object) error { return notFound })
			c := NewReaderOwnerChecker(parents, miss, PartialMetadata, live)
			ok, reason, err := c.CheckOwner(context.Background(), "ns", owner)
			assert.Equal(t, tc.wantOK, ok)
			assert.Equal(t, tc.wantErr, err != nil, "%v", err)
			if tc.wantReason != "" {
				assert.Contains(t, reason, tc.wantReason)
			}
		})
	}
}

// readerFunc is a client.Reader whose Get answers with f.
type readerFunc func(client.Object) error

func (f readerFunc) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	return f(obj)
}

func (f readerFunc) List(context.Context, client.ObjectList, ...client.ListOption) error { return nil }

// TestHandlerAnswersWhileLargeBodiesStall: clients that announce large
// bodies and stall hold the large share; the API server's reviews are still
// answered, a large body is refused at once with a message, and the handler
// stays healthy (its memory is busy, not stuck).
func TestHandlerAnswersWhileLargeBodiesStall(t *testing.T) {
	h := newTestHandler()
	var stalled []*io.PipeWriter
	reading := make(chan struct{}, 16)
	done := make(chan struct{}, 16)
	for range largeShare / MaxBodyBytes {
		pr, pw := io.Pipe()
		stalled = append(stalled, pw)
		r := httptest.NewRequest(http.MethodPost, Path, readSignal{pr, reading})
		r.ContentLength = MaxBodyBytes
		go func() {
			h.ServeHTTP(httptest.NewRecorder(), r)
			done <- struct{}{}
		}()
		<-reading
	}

	resp := serve(t, h, reviewBody(t, admissionv1.Create, realisticPod(), nil))
	assert.True(t, resp.Allowed)
	assert.NotEmpty(t, resp.Patch, "a review is answered while the large share is held")

	r := httptest.NewRequest(http.MethodPost, Path, strings.NewReader("{}"))
	r.ContentLength = 5 << 20
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.Contains(t, w.Body.String(), "no memory for a body of 5242880 bytes within 500ms: the large bodies' share")
	require.NoError(t, h.Healthy())

	for _, pw := range stalled {
		pw.CloseWithError(errors.New("client went away"))
		<-done
	}
	for _, s := range h.budget.classes {
		require.True(t, s.sem.TryAcquire(s.size), "the %s share is whole again", s.name)
		s.sem.Release(s.size)
	}
}

// readSignal reports its first read.
type readSignal struct {
	io.Reader
	first chan<- struct{}
}

func (r readSignal) Read(p []byte) (int, error) {
	if r.first != nil {
		r.first <- struct{}{}
	}
	return r.Reader.Read(p)
}

func TestHandlerHealthyUnlessReviewsWait(t *testing.T) {
	h := newTestHandler()
	now := time.Unix(1000, 0)
	h.now = func() time.Time { return now }
	require.NoError(t, h.Healthy())
	h.startDeciding()
	now = now.Add(WedgedAfter)
	require.NoError(t, h.Healthy(), "within the bound")
	h.startDeciding()
	now = now.Add(time.Second)
	require.EqualError(t, h.Healthy(), "2 admission reviews waiting and none answered for 31s")
	h.doneDeciding()
	require.NoError(t, h.Healthy(), "one answered: the path moves")
	now = now.Add(WedgedAfter + time.Second)
	require.Error(t, h.Healthy(), "the other still waits")
	h.doneDeciding()
	now = now.Add(time.Hour)
	require.NoError(t, h.Healthy(), "nothing waiting")
}
