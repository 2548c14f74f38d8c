// Package keys holds every label and annotation key that tally reads or
// writes on pods. The webhook, the aggregator's index, the operator helpers,
// the tests and the docs all refer to these names; they are part of the
// product's contract and never change.
package keys

const (
	// Prefix starts every key tally owns. A pod carrying any key with it is
	// one the webhook must see.
	Prefix = "tally.dev/"

	// ParentUID is the label that carries the UID of the pod's controller
	// owner, when that owner is of a tracked parent kind. The webhook writes
	// it; the aggregator's pod watch selects on it and indexes by it.
	ParentUID = "tally.dev/parent-uid"

	// ParentName is the label that carries the controller owner's name, set
	// only when the name is a valid label value (at most 63 characters).
	ParentName = "tally.dev/parent-name"

	// Parent is the annotation that carries the owner's full identity:
	// "<Kind>.<group>/<name>", or "<Kind>/<name>" for the core group.
	Parent = "tally.dev/parent"

	// CompletionIntent is the annotation through which the parent's operator
	// asks a pod to complete. Its value is a reason token such as
	// "scale-down". Once admitted it can be neither changed nor removed.
	CompletionIntent = "tally.dev/completion-intent"

	// CompletionIntentAt is the annotation holding the RFC 3339 UTC time at
	// which the webhook first admitted the intent. Only the webhook sets it.
	CompletionIntentAt = "tally.dev/completion-intent-at"

	// CompletionIntentBy is the annotation holding the username of the
	// requester that set the intent. Only the webhook sets it.
	CompletionIntentBy = "tally.dev/completion-intent-by"

	// TrackingFinalizer is the finalizer that keeps a pod of a kind with
	// cumulative totals until the aggregator has recorded how it finished.
	// The webhook adds it on CREATE; only the aggregator removes it.
	TrackingFinalizer = "tally.dev/tracking"
)
