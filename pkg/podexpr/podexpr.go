// Package podexpr compiles the expressions of custom counts: CEL over a
// pod, in the Kubernetes CEL environment (the libraries and the checks a
// ValidatingAdmissionPolicy's expressions get), with `pod` typed as the
// core/v1 Pod as it reads in JSON. An expression is refused unless it
// compiles, is boolean, and its estimated cost stays within CostLimit; the
// same limit stops an evaluation whose actual cost exceeds it.
package podexpr

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/checker"
	"github.com/google/cel-go/common"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/version"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	apiservercel "k8s.io/apiserver/pkg/cel"
	celcommon "k8s.io/apiserver/pkg/cel/common"
	"k8s.io/apiserver/pkg/cel/environment"
	"k8s.io/apiserver/pkg/cel/library"
)

// Var is the name the pod goes by in an expression.
const Var = "pod"

// CostLimit bounds an expression's cost, in the CEL cost units of the API
// server (celconfig.PerCallLimit, which bounds one expression of a
// ValidatingAdmissionPolicy): its estimate at compile time, and each
// evaluation.
const CostLimit = celconfig.PerCallLimit

// The sizes the cost estimate assumes of a pod: every list and map in it
// holds at most maxEntries entries, every string at most maxString
// characters. An evaluation on a larger pod is still bounded by CostLimit.
const (
	maxEntries = 1024
	maxString  = 4096
)

// Program is one compiled expression.
type Program struct {
	prg cel.Program
	// Cost is the expression's estimated cost, at most CostLimit.
	Cost uint64
}

// Compile compiles expression; source names it in the errors, with the
// line and column of each problem.
func Compile(expression, source string) (*Program, error) {
	if strings.TrimSpace(expression) == "" {
		return nil, errors.New("is empty")
	}
	env, err := newEnv()
	if err != nil {
		return nil, fmt.Errorf("building the CEL environment: %w", err)
	}
	ast, issues := env.CompileSource(common.NewStringSource(expression, source))
	if issues.Err() != nil {
		return nil, fmt.Errorf("does not compile:\n%s", issues.String())
	}
	if !ast.OutputType().IsExactType(cel.BoolType) {
		return nil, fmt.Errorf("is of type %s, not bool: a custom count counts the pods for which it is true", ast.OutputType())
	}
	estimator := &library.CostEstimator{SizeEstimator: sizes{}}
	est, err := env.EstimateCost(ast, estimator)
	if err != nil {
		return nil, fmt.Errorf("has a cost that cannot be estimated: %w", err)
	}
	if est.Max > CostLimit {
		return nil, fmt.Errorf("has an estimated cost of %d, over the limit of %d (assuming lists and maps of up to %d entries and strings of up to %d characters in the pod): "+
			"iterate over fewer or smaller fields", est.Max, CostLimit, maxEntries, maxString)
	}
	prg, err := env.Program(ast, cel.CostLimit(CostLimit), cel.CostTracking(estimator), cel.InterruptCheckFrequency(celconfig.CheckFrequency))
	if err != nil {
		return nil, fmt.Errorf("cannot be made a program: %w", err)
	}
	return &Program{prg: prg, Cost: est.Max}, nil
}

// Match evaluates the expression on pod. An error (a field the pod does
// not have, which has() guards against; the cost limit) is not a match.
func (p *Program) Match(pod *corev1.Pod) (bool, error) {
	out, _, err := p.prg.Eval(map[string]any{Var: celcommon.SchemalessTypedToVal(pod)})
	if err != nil {
		return false, err
	}
	b, ok := out.Value().(bool)
	if !ok {
		return false, fmt.Errorf("evaluated to %v, not a bool", out.Value())
	}
	return b, nil
}

// newEnv returns the environment expressions compile in: the Kubernetes
// base environment of this library's version, and `pod`.
var newEnv = sync.OnceValues(func() (*cel.Env, error) {
	pod := podType()
	set, err := environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion()).Extend(environment.VersionedOptions{
		IntroducedVersion: version.MajorMinor(1, 0),
		EnvOptions:        []cel.EnvOption{cel.Variable(Var, pod.CelType())},
		DeclTypes:         []*apiservercel.DeclType{pod},
	})
	if err != nil {
		return nil, err
	}
	return set.Env(environment.NewExpressions)
})

// sizes is the cost estimate's model of a pod's sizes.
type sizes struct{}

func (sizes) EstimateSize(node checker.AstNode) *checker.SizeEstimate {
	switch node.Type().Kind() {
	case cel.ListKind, cel.MapKind, cel.StructKind:
		return &checker.SizeEstimate{Min: 0, Max: maxEntries}
	case cel.StringKind, cel.BytesKind:
		return &checker.SizeEstimate{Min: 0, Max: maxString}
	}
	return nil
}

func (sizes) EstimateCallCost(string, string, *checker.AstNode, []checker.AstNode) *checker.CallEstimate {
	return nil
}
