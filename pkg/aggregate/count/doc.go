// Package count owns counting: the pod as the aggregator's cache keeps it
// (Pod, a few hundred bytes instead of the whole object), the informer's
// transform that reduces each watched pod to one (Reducer, which also
// evaluates the custom counts' expressions on the whole pod), the indexes
// the reconcilers read (Indexers), and the counts of a parent's pods
// (Tally, TallyCustom). Everything here is pure: no request to the API
// server.
package count
