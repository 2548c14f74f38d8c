// Package mutate owns the pod metadata contract enforced by the admission
// webhook: which identity labels and annotations a pod carries, and how its
// completion intent may be set. Decide is a pure function of the request
// (and, with verifyOwner, of an owner checker); Handler is the thin HTTP
// adapter that decodes AdmissionReviews and answers with minimal JSON
// patches. The package never writes to the API server.
package mutate
