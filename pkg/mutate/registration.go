package mutate

import (
	"fmt"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// MatchConditionName names the CEL condition under which the API server
// calls the webhook.
const MatchConditionName = "tracked-owner-or-tally-metadata"

// MatchExpression returns the CEL expression that holds for a pod whose
// controller ownerReference names a tracked kind, or that (before or after
// the request) carries a tally.dev/ label or annotation. The API server calls
// the webhook only for such pods, so an outage of the webhook cannot block
// unrelated pods. The Helm chart renders the same expression.
func MatchExpression(parents []config.Parent) string {
	var kinds []string
	for _, p := range parents {
		if p.Group == "" {
			kinds = append(kinds, fmt.Sprintf("(r.apiVersion == 'v1' && r.kind == '%s')", p.Kind))
		} else {
			kinds = append(kinds, fmt.Sprintf("(r.apiVersion.startsWith('%s/') && r.kind == '%s')", p.Group, p.Kind))
		}
	}
	tallyKeys := func(obj string) string {
		return fmt.Sprintf("(has(%[1]s.metadata.labels) && %[1]s.metadata.labels.exists(k, k.startsWith('%[2]s'))) || "+
			"(has(%[1]s.metadata.annotations) && %[1]s.metadata.annotations.exists(k, k.startsWith('%[2]s')))", obj, keys.Prefix)
	}
	return fmt.Sprintf("(has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, has(r.controller) && r.controller && (%s))) || %s || (oldObject != null && (%s))",
		strings.Join(kinds, " || "), tallyKeys("object"), tallyKeys("oldObject"))
}

// AggregatorConditionName names the CEL condition that keeps the API
// server from calling the webhook for the aggregator's own requests.
const AggregatorConditionName = "not-tally-aggregator"

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

// Webhook returns the pod mutating webhook as it is registered in a cluster,
// calling the service or URL in clientConfig. aggregatorUser is the
// aggregator's username, whose requests the webhook is not called for.
func Webhook(parents []config.Parent, clientConfig admissionregistrationv1.WebhookClientConfig, aggregatorUser string) admissionregistrationv1.MutatingWebhook {
	failurePolicy := admissionregistrationv1.Fail
	sideEffects := admissionregistrationv1.SideEffectClassNone
	reinvocation := admissionregistrationv1.IfNeededReinvocationPolicy
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
		NamespaceSelector: config.DefaultNamespaceSelector(),
		MatchConditions: []admissionregistrationv1.MatchCondition{
			{Name: MatchConditionName, Expression: MatchExpression(parents)},
			{Name: AggregatorConditionName, Expression: AggregatorExpression(aggregatorUser)},
		},
	}
}
