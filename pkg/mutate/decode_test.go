package mutate

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// reviewWith is a CREATE review whose pod's metadata is meta (JSON members,
// without braces) and whose spec is spec.
func reviewWith(meta, spec string) []byte {
	return fmt.Appendf(nil, `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},
"namespace":"ns","operation":"CREATE","userInfo":{"username":"operator"},
"object":{"apiVersion":"v1","kind":"Pod","metadata":{%s},"spec":%s}}}`, meta, spec)
}

func TestDecodeKeepsWhatTheDecisionReads(t *testing.T) {
	body := reviewWith(`"namespace":"ns","labels":{"app":"w","tally.dev/parent-uid":"u-1","tally.dev/note":"x"},"annotations":{"note":"x","tally.dev/parent":"`+strings.Repeat("p", 100<<10)+`"},
"ownerReferences":[{"apiVersion":"apps/v1","kind":"ReplicaSet","name":"rs","uid":"u-0"},
  {"apiVersion":"example.tally.dev/v1","kind":"WorkerPool","name":"pool","uid":"u-1","controller":true},
  {"apiVersion":"batch/v1","kind":"Job","name":"j","uid":"u-2","controller":true}],
"finalizers":["example.com/a","tally.dev/tracking"],"deletionTimestamp":"2026-12-04T10:00:00Z"`, `{"containers":[{"name":"c"}]}`)
	var rev review
	require.NoError(t, decodeReview(body, &rev))
	pod := rev.Request.Object.Metadata
	assert.Equal(t, map[string]string{"tally.dev/parent-uid": "u-1"}, pod.Labels, "only the labels tally defines")
	assert.Regexp(t, `^tally:value-of-102402-bytes-[0-9a-f]{16}$`, pod.Annotations["tally.dev/parent"], "a value longer than any valid one")
	assert.Len(t, pod.Annotations, 1)
	require.Len(t, pod.OwnerReferences, 1, "the first controller only")
	assert.Equal(t, "pool", pod.OwnerReferences[0].Name)
	assert.Equal(t, []string{"", "tally.dev/tracking"}, pod.Finalizers, "where the tracking finalizer stands")

	// Labels or annotations that hold nothing tally defines: empty, not
	// nil, so that a patch adds into them rather than replacing them.
	require.NoError(t, decodeReview(reviewWith(`"labels":{"app":"w"},"annotations":{}`, `{}`), &rev))
	assert.Equal(t, map[string]string{}, rev.Request.Object.Metadata.Labels)
	assert.Equal(t, map[string]string{}, rev.Request.Object.Metadata.Annotations)
	assert.NotNil(t, pod.DeletionTimestamp)
	assert.Equal(t, "operator", rev.Request.UserInfo.Username)
}

// TestDecodeSkipsTheRequestedStatus: the API server drops a client's status
// on a pod CREATE or UPDATE, so the requested pod's is neither decoded nor
// charged; the stored pod's phase is.
func TestDecodeSkipsTheRequestedStatus(t *testing.T) {
	long := strings.Repeat("x", 2*DecodeAllowance)
	body := fmt.Appendf(nil, `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},
"namespace":"ns","operation":"UPDATE","userInfo":{"username":"operator"},
"object":{"apiVersion":"v1","kind":"Pod","metadata":{},"status":{"phase":"%s"}},
"oldObject":{"apiVersion":"v1","kind":"Pod","metadata":{},"status":{"phase":"Failed"}}}}`, long)
	var rev review
	require.NoError(t, decodeReview(body, &rev))
	assert.Equal(t, "Failed", string(rev.Request.OldObject.Status.Phase))

	stored := bytes.Replace(body, []byte(`"Failed"`), []byte(`"`+long+`"`), 1)
	assert.ErrorIs(t, decodeReview(stored, &rev), errOverAllowance, "the stored pod's phase is charged")
}

// TestHostileBodiesAreBoundedByTheAllowance: bodies built to make decoding
// allocate many times their size are refused, or decoded keeping nothing,
// and decoding each allocates a small part of its size.
func TestHostileBodiesAreBoundedByTheAllowance(t *testing.T) {
	const size = MaxBodyBytes - 64<<10
	fill := func(unit string) string { return strings.Repeat(unit, size/len(unit)) }
	tests := []struct {
		name    string
		body    []byte
		refused bool
	}{
		{"empty owner references", reviewWith(`"ownerReferences":[`+strings.TrimSuffix(fill(`{},`), ",")+`]`, `{}`), false},
		{"non-controller owner references", reviewWith(`"ownerReferences":[`+strings.TrimSuffix(fill(`{"apiVersion":"v1","kind":"K","name":"n","uid":"u"},`), ",")+`]`, `{}`), false},
		{"empty finalizers", reviewWith(`"finalizers":[`+strings.TrimSuffix(fill(`"",`), ",")+`]`, `{}`), true},
		{"a key tally defines, again and again", reviewWith(`"labels":{`+strings.TrimSuffix(fill(`"tally.dev/parent-uid":"",`), ",")+`}`, `{}`), false},
		{"other tally.dev/ keys", reviewWith(`"labels":{`+strings.TrimSuffix(strings.ReplaceAll(fill(`"tally.dev/%08d":"",`), "%08d", "x"), ",")+`}`, `{}`), false},
		{"other keys, each once", reviewWith(`"annotations":{`+keysOnce(size)+`}`, `{}`), false},
		{"a long value of a key tally defines", reviewWith(`"labels":{"tally.dev/parent-uid":"`+fill("a")+`"}`, `{}`), false},
		{"a long skipped string", reviewWith(`"labels":{"app":"`+fill("a")+`"}`, `{}`), false},
		{"a long uid, escaped", []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"` + fill(`\u0041`) + `"}}`), true},
		{"deep nesting", reviewWith(``, fill("[")), true},
		{"numbers", reviewWith(``, `[`+strings.TrimSuffix(fill(`1e308,`), ",")+`]`), false},
		{"a long deletion time", reviewWith(`"deletionTimestamp":"`+fill("1")+`"`, `{}`), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			var rev review
			err := decodeReview(tc.body, &rev)
			runtime.ReadMemStats(&after)
			allocated := after.TotalAlloc - before.TotalAlloc
			if tc.refused {
				require.Error(t, err)
			}
			if errors.Is(err, errOverAllowance) {
				assert.Contains(t, err.Error(), "no pod's review needs that much")
			}
			t.Logf("%d bytes: %d bytes allocated decoding, error: %v", len(tc.body), allocated, err)
			assert.Less(t, allocated, uint64(len(tc.body)/4+4*DecodeAllowance), "allocated decoding")
		})
	}
}

// TestRefusalAnswersTheRequest: a review refused for its decoding carries
// the request's uid, so that the API server takes it as the webhook's
// answer (a 400 refusal), not as a failed call its failure policy decides.
func TestRefusalAnswersTheRequest(t *testing.T) {
	body := reviewWith(`"finalizers":[`+strings.TrimSuffix(strings.Repeat(`"example.com/f",`, 5000), ",")+`]`, `{}`)
	resp := serve(t, newTestHandler(), body)
	assert.False(t, resp.Allowed)
	assert.Equal(t, "u", string(resp.UID))
	require.NotNil(t, resp.Result)
	assert.Equal(t, int32(400), resp.Result.Code)
	assert.Contains(t, resp.Result.Message, "no pod's review needs that much")
}

// keysOnce returns distinct object members filling about n bytes.
func keysOnce(n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n-32; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `"k%d":""`, i)
	}
	return b.String()
}
