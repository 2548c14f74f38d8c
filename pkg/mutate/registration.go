package mutate

import (
	"fmt"
	"strconv"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/utils/ptr"

	"tally.dev/tally/charts"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// The names of the registration's match conditions. The API server calls the
// webhook for a pod only when every condition holds.
const (
	// MatchConditionName holds for the pods tally is concerned with: a
	// tracked controller owner, or tally.dev/ metadata before or after the
	// request.
	MatchConditionName = "tracked-owner-or-tally-metadata"
	// ChangeConditionName holds unless the webhook would allow the request
	// with no patch and no warning: a pod its operator stamped (identity.Stamp),
	// an update that leaves tally's keys as they were admitted.
	ChangeConditionName = "would-change-or-refuse"
	// AggregatorConditionName holds for every requester but the aggregator.
	AggregatorConditionName = "not-tally-aggregator"
)

// MatchConditions returns the conditions under which the API server calls
// the webhook for a pod, for the parent kinds and owner verification of cfg:
// MatchConditionName then ChangeConditionName. Their CEL is in the chart
// (charts/tally/files/match-conditions), which renders the same text from
// the same values.
func MatchConditions(cfg *config.Config) []admissionregistrationv1.MatchCondition {
	fill := strings.NewReplacer("@parents@", parentsLiteral(cfg.Parents), "@verifyOwner@", strconv.FormatBool(cfg.VerifyOwner))
	conds := make([]admissionregistrationv1.MatchCondition, 0, 2)
	for _, name := range []string{MatchConditionName, ChangeConditionName} {
		src, err := charts.MatchConditions.ReadFile("tally/files/match-conditions/" + name + ".cel")
		if err != nil {
			panic(fmt.Sprintf("match condition %s is not embedded: %v", name, err))
		}
		conds = append(conds, admissionregistrationv1.MatchCondition{Name: name, Expression: fill.Replace(strings.TrimSpace(string(src)))})
	}
	return conds
}

// parentsLiteral returns the CEL list that the match conditions read the
// parent kinds from: group, kind, and the finalizer their pods carry (empty
// for kinds without totals). The chart's tally.parentsLiteral renders the
// same list.
func parentsLiteral(parents []config.Parent) string {
	items := make([]string, len(parents))
	for i, p := range parents {
		finalizer := ""
		if p.Tracked() {
			finalizer = keys.TrackingFinalizer
		}
		items[i] = fmt.Sprintf("{'group': %s, 'kind': %s, 'finalizer': %s}", celString(p.Group), celString(p.Kind), celString(finalizer))
	}
	return "[" + strings.Join(items, ", ") + "]"
}

// AggregatorExpression returns the CEL expression that holds for every
// requester but the aggregator, user. The aggregator's backfill stamps pods
// with the webhook's own rules (so the webhook would change nothing), and
// must be able to do so while the webhook is down under failurePolicy Fail.
// What the aggregator may change on a pod is fenced by the chart's
// ValidatingAdmissionPolicy, which the API server evaluates itself.
func AggregatorExpression(user string) string {
	return fmt.Sprintf("request.userInfo.username != %s", celString(user))
}

// celString quotes s as a CEL string literal.
func celString(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}

// Webhook returns the pod mutating webhook as it is registered in a cluster
// for cfg, calling the service or URL in clientConfig. aggregatorUser is the
// aggregator's username, whose requests the webhook is not called for.
func Webhook(cfg *config.Config, clientConfig admissionregistrationv1.WebhookClientConfig, aggregatorUser string) admissionregistrationv1.MutatingWebhook {
	failurePolicy := admissionregistrationv1.Fail
	sideEffects := admissionregistrationv1.SideEffectClassNone
	reinvocation := admissionregistrationv1.IfNeededReinvocationPolicy
	selector := cfg.NamespaceSelector
	if selector == nil {
		selector = config.DefaultNamespaceSelector()
	}
	return admissionregistrationv1.MutatingWebhook{
		Name:                    "pods.tally.dev",
		ClientConfig:            clientConfig,
		AdmissionReviewVersions: []string{"v1"},
		SideEffects:             &sideEffects,
		FailurePolicy:           &failurePolicy,
		ReinvocationPolicy:      &reinvocation,
		TimeoutSeconds:          ptr.To[int32](5),
		Rules: []admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
			Rule: admissionregistrationv1.Rule{
				APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"},
				Scope: ptr.To(admissionregistrationv1.NamespacedScope),
			},
		}},
		NamespaceSelector: selector,
		MatchConditions: append(MatchConditions(cfg),
			admissionregistrationv1.MatchCondition{Name: AggregatorConditionName, Expression: AggregatorExpression(aggregatorUser)}),
	}
}
