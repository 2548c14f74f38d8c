package mutate

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAppendPatch(t *testing.T) {
	tests := map[string]struct {
		ops  []PatchOp
		want string
	}{
		"escaped keys": {
			ops: []PatchOp{
				{Op: "add", Path: "/metadata/labels/" + escapePointer("tally.dev/parent-uid"), Value: "u"},
				{Op: "remove", Path: "/metadata/annotations/" + escapePointer("a~b/c")},
			},
			want: `[{"op":"add","path":"/metadata/labels/tally.dev~1parent-uid","value":"u"},{"op":"remove","path":"/metadata/annotations/a~0b~1c"}]`,
		},
		"new map": {
			ops:  []PatchOp{{Op: "add", Path: "/metadata/labels", Value: "u", MapKey: "tally.dev/parent-uid"}},
			want: `[{"op":"add","path":"/metadata/labels","value":{"tally.dev/parent-uid":"u"}}]`,
		},
		"new list": {
			ops:  []PatchOp{{Op: "add", Path: "/metadata/finalizers", Value: "tally.dev/tracking", List: true}},
			want: `[{"op":"add","path":"/metadata/finalizers","value":["tally.dev/tracking"]}]`,
		},
		"string escaping": {
			ops:  []PatchOp{{Op: "replace", Path: "/p", Value: "q\"\\\n\t\x01é\xff"}},
			want: `[{"op":"replace","path":"/p","value":"q\"\\\n\t\u0001é\ufffd"}]`,
		},
		"no ops": {want: `[]`},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got := AppendPatch(nil, tc.ops)
			assert.Equal(t, tc.want, string(got))
			assert.True(t, json.Valid(got))
		})
	}
}

func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "plain", "q\"\\\n", "\x00\x1f\x7f", "é\xff\xfe", "\u2028"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := appendString(nil, s)
		want, err := json.Marshal(s)
		require.NoError(t, err)
		var a, b string
		require.NoError(t, json.Unmarshal(got, &a), "%q", got)
		require.NoError(t, json.Unmarshal(want, &b))
		assert.Equal(t, b, a)
	})
}
