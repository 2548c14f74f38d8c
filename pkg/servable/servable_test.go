package servable

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"tally.dev/tally/pkg/config"
)

// doc is a group-version's OpenAPI v3 document as the API server serves it
// for a CRD, with status given by the case.
func doc(status string) []byte {
	return []byte(`{"openapi":"3.0.0","components":{"schemas":{
"dev.tally.example.v1.WorkerPool":{"type":"object","x-kubernetes-group-version-kind":[{"group":"example.tally.dev","kind":"WorkerPool","version":"v1"}],
 "properties":{"metadata":{"allOf":[{"$ref":"#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}]},"status":` + status + `}},
"io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta":{"type":"object"},
"dev.tally.example.v1.Status":{"type":"object","properties":{"restarts":{"type":"integer"},"ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"type":"array"}}}}}
}}}`)
}

func TestUnwritable(t *testing.T) {
	pool := config.Parent{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool",
		Counts: map[config.Count]string{config.Completing: "status.completing", config.UnexpectedTotal: "status.restarts"}, Ledger: "status.ledger"}
	full := `{"type":"object","properties":{"completing":{"type":"integer"},"restarts":{"type":"integer"},
 "ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"type":"array"}}}}}`
	tests := []struct {
		name, status string
		want         []string
	}{
		{"everything declared", full, nil},
		{"no ledger", `{"type":"object","properties":{"restarts":{"type":"integer"}}}`, []string{"status.ledger.completed", "status.ledger.unexpected"}},
		{"no total", `{"type":"object","properties":{"ledger":{"type":"object","properties":{"completed":{},"unexpected":{}}}}}`, []string{"status.restarts"}},
		{"a ledger without its lists", `{"type":"object","properties":{"restarts":{},"ledger":{"type":"object","properties":{"completed":{}}}}}`, []string{"status.ledger.unexpected"}},
		{"status keeps unknown fields", `{"type":"object","x-kubernetes-preserve-unknown-fields":true}`, nil},
		{"the ledger keeps unknown fields", `{"type":"object","properties":{"restarts":{},"ledger":{"type":"object","x-kubernetes-preserve-unknown-fields":true}}}`, nil},
		{"status by reference", `{"allOf":[{"$ref":"#/components/schemas/dev.tally.example.v1.Status"}]}`, nil},
		{"no status", `null`, []string{"status.restarts", "status.ledger.completed", "status.ledger.unexpected"}},
		{"a total declared as a string", `{"type":"object","properties":{"restarts":{"type":"string"},"ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"type":"array"}}}}}`,
			[]string{"status.restarts as an integer (it declares a string)"}},
		{"a ledger list declared as an object", `{"type":"object","properties":{"restarts":{"type":"integer"},"ledger":{"type":"object","properties":{"completed":{"type":"object"},"unexpected":{"type":"array"}}}}}`,
			[]string{"status.ledger.completed as an array of strings (it declares an object)"}},
		{"a total declared as a number", `{"type":"object","properties":{"restarts":{"type":"number"},"ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"type":"array"}}}}}`, nil},
		{"int-or-string: a total, not a ledger list", `{"type":"object","properties":{"restarts":{"x-kubernetes-int-or-string":true},"ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"x-kubernetes-int-or-string":true}}}}}`,
			[]string{"status.ledger.unexpected as an array of strings (it declares an int-or-string)"}},
		{"a ledger list of integers", `{"type":"object","properties":{"restarts":{"type":"integer"},"ledger":{"type":"object","properties":{"completed":{"type":"array","items":{"type":"integer"}},"unexpected":{"type":"array","items":{"type":"string"}}}}}}`,
			[]string{"status.ledger.completed as an array of strings (it declares an array of integer)"}},
		{"a total declared beside kept unknown fields", `{"type":"object","x-kubernetes-preserve-unknown-fields":true,"properties":{"restarts":{"type":"string"}}}`,
			[]string{"status.restarts as an integer (it declares a string)"}},
		{"a type beside an allOf of constraints", `{"type":"object","properties":{"restarts":{"type":"string","allOf":[{"minLength":1}]},"ledger":{"type":"object","x-kubernetes-preserve-unknown-fields":true,"allOf":[{"required":["completed"]}]}}}`,
			[]string{"status.restarts as an integer (it declares a string)"}},
		{"totals in a map", `{"type":"object","properties":{"restarts":{"type":"object","additionalProperties":{"type":"integer"}},"ledger":{"type":"object","additionalProperties":{"type":"array","items":{"type":"string"}}}}}`,
			[]string{"status.restarts as an integer (it declares an object)"}},
		{"a count's type is not the servable check's business", `{"type":"object","properties":{"completing":{"type":"string"},"restarts":{"type":"integer"},"ledger":{"type":"object","properties":{"completed":{"type":"array"},"unexpected":{"type":"array"}}}}}`, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Unwritable(doc(tt.status), pool)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}

	_, err := Unwritable(doc(full), config.Parent{Group: "example.tally.dev", Version: "v2", Kind: "WorkerPool"})
	assert.EqualError(t, err, "no schema for example.tally.dev/v2, Kind=WorkerPool")
	_, err = Unwritable([]byte(`{"components":`), pool)
	assert.Error(t, err)
}
