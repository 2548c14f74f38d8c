package app

import (
	"net/http"
	"strings"
	"time"

	"k8s.io/client-go/rest"
	"tally.dev/tally/pkg/aggregate"
)

// sendAppliesOnce sends a status apply only until its aggregate.SendBy
// time, checked against the clock just before the request goes out: a
// process paused after its checks (SIGSTOP, a debugger, a stalled VM)
// resumes before its timers fire, and would otherwise send counts as old as
// the pause. It also keeps client-go from sending a status apply again by
// itself: answered 429 (or a 5xx) with Retry-After, client-go waits that
// long and resends the same body, up to ten times, so the counts it carries
// are as old as those waits (seconds under API Priority and Fairness) and
// land over newer ones that no precondition sees (the parent did not
// change). Without the header, the apply fails at once and the reconcile
// counts again: Reconciler.apply waits the delay the API server's answer
// gives before the next try.
func sendAppliesOnce(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
			if !statusApply(req) {
				return rt.RoundTrip(req)
			}
			if by, ok := aggregate.SendBy(req.Context()); ok && !time.Now().Before(by) {
				return nil, aggregate.ErrSentLate
			}
			resp, err := rt.RoundTrip(req)
			if err == nil && (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500) {
				resp.Header.Del("Retry-After")
			}
			return resp, err
		})
	})
}

// statusApply reports whether req is a server-side apply of a status.
func statusApply(req *http.Request) bool {
	return req.Method == http.MethodPatch && strings.HasSuffix(req.URL.Path, "/status") &&
		strings.HasPrefix(req.Header.Get("Content-Type"), "application/apply-patch")
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
