// Package aggregate owns the counts: it computes, from an indexed cache of
// tally-labelled pods, how many pods of each parent are completing,
// completed, active or unexpected, and writes the configured status fields
// with server-side apply under the field manager "tally-aggregator". It keeps
// no counter: every reconcile recomputes from the pods (level-triggered), so
// a restart or a missed event cannot make a value drift. The cumulative
// totals and their ledger (Advance, the ledger protocol) go under their own
// field manager, "tally-aggregator-totals", which keeps them through any
// change of the configuration (history.go).
//
// Counting (Tally) is a pure function; the cache layout (pod selector,
// transform, index) and the reconciler are the Kubernetes plumbing around it.
package aggregate
