// Package ledger owns the totals' ledger protocol, as the Job controller
// keeps status.uncountedTerminatedPods: a parent's Book (its ledger of pods
// recorded as finished but not yet added to the totals, and the totals),
// read from its status (ReadBook), and Advance, which decides from the
// cached pods, the book and what the API server said of the pods just now
// which pods to record, which to fold into the totals and which to release.
// A pod is recorded before its finalizer is released, and folded once the
// release is certain, so that a crash at any point neither loses nor
// double-counts it. Everything here is pure: no request to the API server.
package ledger
