// Package aggregate owns the counts: it computes, from an indexed cache of
// tally-labelled pods, how many pods of each parent are completing,
// completed, active or unexpected, and writes the configured status fields
// with server-side apply under the field manager "tally-aggregator". It keeps
// no counter: every reconcile recomputes from the pods (level-triggered), so
// a restart or a missed event cannot make a value drift. The cumulative
// totals and their ledger (package ledger) go under their own field manager,
// "tally-aggregator-totals", which keeps them through any change of the
// configuration (history.go).
//
// Counting (package count) and the ledger protocol are pure; this package
// is the Kubernetes plumbing around them: the reconcilers, the backfill
// sweep, the parents' caches, and the release of pods whose finish cannot
// be recorded (Unrecorded).
package aggregate
