package demo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
)

var (
	errMismatch = errors.New("tally's counts do not equal the truth")
	errLateMark = errors.New("an intent set after its pod finished was admitted")
)

// Snapshot is what tally shows on the pool beside the truth.
type Snapshot struct {
	Desired int64
	// Tally holds -1, as Totals does, for a value the parent's status does
	// not show yet: the aggregator has not written it (the totals, until
	// the first pod finishes).
	Tally map[config.Count]int64
	Truth map[config.Count]int64
	// Totals are the totals tally shows, Finished the pods the demo saw
	// finish; both nil when the configuration maps no totals.
	Totals, Finished map[config.Count]int64
	// Custom names the pool's custom counts, whose values Tally and Truth
	// hold beside the others.
	Custom []config.Count
	// Written are the fields of the custom counts tally cannot keep that
	// the pool's status shows nonetheless: none, when tally is right.
	Written []string
	// Legacy is what the counter kept the old way shows (0 before its
	// first write), when the demo runs one (legacyCounter).
	Legacy   int64
	LegacyOn bool
	// Settled reports that no pod is starting (not running yet, or not
	// reported Ready yet) or completing and the pool runs as many pods as
	// it wants.
	Settled bool
}

// Match reports whether tally's values equal the truth.
func (s Snapshot) Match() bool {
	for _, c := range s.counts() {
		if s.Tally[c] != s.Truth[c] {
			return false
		}
	}
	for _, c := range config.Totals {
		if s.Totals != nil && s.Totals[c] != s.Finished[c] {
			return false
		}
	}
	return len(s.Written) == 0
}

// Snapshot reads the pool and its pods.
func (d *Demo) Snapshot(ctx context.Context) (Snapshot, error) {
	pool := operator.Pool(Namespace, Pool, 0)
	if err := d.client.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
		return Snapshot{}, err
	}
	var pods corev1.PodList
	if err := d.client.List(ctx, &pods, client.InNamespace(Namespace)); err != nil {
		return Snapshot{}, err
	}
	s := Snapshot{Tally: map[config.Count]int64{}, Truth: truth.Counts(pods.Items, pool.GetNamespace(), pool.GetUID())}
	s.Desired, _, _ = unstructured.NestedInt64(pool.Object, "spec", "replicas")
	shown := func(c config.Count) int64 {
		v, found, _ := unstructured.NestedInt64(pool.Object, "status", string(c))
		if !found {
			v = -1
		}
		return v
	}
	for _, c := range config.Counts {
		s.Tally[c] = shown(c)
	}
	for _, c := range d.custom {
		s.Custom = append(s.Custom, c.name)
		s.Tally[c.name] = shown(c.name)
		s.Truth[c.name] = c.count(pods.Items, pool.GetUID())
	}
	for _, c := range d.unkept {
		if _, found, _ := unstructured.NestedFieldNoCopy(pool.Object, c.path...); found {
			s.Written = append(s.Written, strings.Join(c.path, "."))
		}
	}
	if d.legacy != nil {
		s.Legacy, s.LegacyOn = d.legacy.value(pool), true
	}
	if d.totals {
		s.Totals, s.Finished = map[config.Count]int64{}, d.finished.Totals()
		for _, c := range config.Totals {
			s.Totals[c] = shown(c)
		}
	}
	starting := false
	for _, p := range pods.Items {
		// A pod the kubelet has yet to start, or to report Ready.
		starting = starting || p.Status.Phase == "" || p.Status.Phase == corev1.PodPending ||
			(p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && !ready(&p))
	}
	s.Settled = !starting && s.Truth[config.Completing] == 0 && s.Truth[config.Completed] == 0 &&
		s.Truth[config.Unexpected] == 0 && s.Truth[config.Active] == s.Desired
	return s, nil
}

// Converge waits until the pool is settled and tally's values equal the
// truth; it returns errMismatch if they do not within timeout.
func (d *Demo) Converge(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		s, err := d.Snapshot(ctx)
		if err != nil {
			return err
		}
		if s.Settled && s.Match() {
			return nil
		}
		if time.Now().After(deadline) {
			if !s.Settled {
				return fmt.Errorf("%w: the pool did not settle within %s: %s", errMismatch, timeout, s.line(0))
			}
			return fmt.Errorf("%w within %s: %s", errMismatch, timeout, s.line(0))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Verdict prints whether tally's counts equal the truth now, and returns
// an error when they do not.
func (d *Demo) Verdict(ctx context.Context) error {
	s, err := d.Snapshot(ctx)
	if err != nil {
		return err
	}
	if !s.Match() {
		fmt.Fprintf(d.opts.Out, "verdict: FAIL: tally's counts differ from a fresh List, or its totals from the pods seen finishing, or it wrote a count it cannot keep %v\n  %s\n", s.Written, s.line(0))
		return errMismatch
	}
	if len(d.late.admitted) > 0 {
		fmt.Fprintf(d.opts.Out, "verdict: FAIL: marks sent after their pods finished were admitted: %s\n", strings.Join(d.late.admitted, ", "))
		return errLateMark
	}
	sent := ""
	if d.opts.Cluster == nil {
		applies, err := d.Applies(ctx)
		if err != nil {
			return fmt.Errorf("reading the aggregator's metrics: %w", err)
		}
		sent = fmt.Sprintf("; the aggregator sent %.0f server-side applies", applies)
	}
	calls, err := d.webhookCalls(ctx)
	if err != nil {
		return fmt.Errorf("reading the API server's metrics: %w", err)
	}
	sent += "; " + calls
	totals := ""
	if s.Totals != nil {
		totals = fmt.Sprintf("; its totals equal the pods seen finishing, deleted ones included (completedTotal=%d unexpectedTotal=%d)",
			s.Totals[config.CompletedTotal], s.Totals[config.UnexpectedTotal])
	}
	late := fmt.Sprintf("; the webhook refused all %d marks sent after their pods had finished", d.late.refused)
	if d.late.marked > 0 || d.late.gone > 0 {
		late += fmt.Sprintf(" (of %d more, %d found an intent admitted before the pod finished, %d the pod gone)",
			d.late.marked+d.late.gone, d.late.marked, d.late.gone)
	}
	shadow, err := d.shadowVerdict(ctx)
	if err != nil {
		fmt.Fprintf(d.opts.Out, "verdict: FAIL: %v\n", err)
		return err
	}
	sent += shadow
	custom := ""
	for _, c := range s.Custom {
		custom += fmt.Sprintf(" %s=%d", c, s.Tally[c])
	}
	for _, c := range d.unkept {
		custom += fmt.Sprintf(" %s unwritten", strings.Join(c.path, "."))
	}
	fmt.Fprintf(d.opts.Out, "verdict: PASS: tally's counts equal a fresh List (active=%d completing=%d completed=%d unexpected=%d%s)%s%s%s. Logs: %s\n",
		s.Tally[config.Active], s.Tally[config.Completing], s.Tally[config.Completed], s.Tally[config.Unexpected], custom, totals, late, sent, d.logDir)
	return nil
}

// errShadow: tally's shadow mode did not report the old counter's drift.
var errShadow = errors.New("tally's shadow mode does not report the old counter's difference")

// shadowVerdict, when the demo runs a counter kept the old way, waits for
// its handlers to write, then for the aggregator's
// tally_aggregator_compare_difference to report how far every pool's field
// is from a fresh List (the pools of other operators on the control plane
// included), and says so; errShadow if it does not within 10 s.
func (d *Demo) shadowVerdict(ctx context.Context) (string, error) {
	if d.legacy == nil {
		return "", nil
	}
	if err := d.legacy.drained(10 * time.Second); err != nil {
		return "", err
	}
	kind := operator.GVK.GroupKind().String()
	difference := fmt.Sprintf(`tally_aggregator_compare_difference{count="completing",kind=%q}`, kind)
	compared := fmt.Sprintf(`tally_aggregator_compared_parents{count="completing",kind=%q}`, kind)
	deadline := time.Now().Add(10 * time.Second)
	for {
		want, err := d.comparedTruth(ctx)
		if err != nil {
			return "", err
		}
		got, err := d.metric(ctx, difference)
		if err != nil {
			return "", fmt.Errorf("reading the aggregator's metrics: %w", err)
		}
		parents, err := d.metric(ctx, compared)
		if err != nil {
			return "", fmt.Errorf("reading the aggregator's metrics: %w", err)
		}
		if got == float64(want) && parents >= 1 {
			s, err := d.Snapshot(ctx)
			if err != nil {
				return "", err
			}
			drift := "it kept up this run: no drift"
			if s.Legacy != s.Truth[config.Completing] {
				drift = fmt.Sprintf("it drifted by %+d", s.Legacy-s.Truth[config.Completing])
			}
			return fmt.Sprintf("; the counter kept the old way shows completing=%d where a fresh List gives %d (%s), and tally's shadow mode reports the difference (%s %.0f)",
				s.Legacy, s.Truth[config.Completing], drift, difference, got), nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("%w: the pools' fields differ from a fresh List by %d in all, but %s is %.0f (over %.0f parents compared)", errShadow, want, difference, got, parents)
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// comparedTruth sums, over every WorkerPool, how far the field the old
// counter keeps is from a fresh List's completing count.
func (d *Demo) comparedTruth(ctx context.Context) (int64, error) {
	pools := &unstructured.UnstructuredList{}
	pools.SetGroupVersionKind(operator.GVK.GroupVersion().WithKind(operator.GVK.Kind + "List"))
	if err := d.client.List(ctx, pools); err != nil {
		return 0, err
	}
	var sum int64
	for i := range pools.Items {
		pool := &pools.Items[i]
		var pods corev1.PodList
		if err := d.client.List(ctx, &pods, client.InNamespace(pool.GetNamespace())); err != nil {
			return 0, err
		}
		diff := d.legacy.value(pool) - truth.Counts(pods.Items, pool.GetNamespace(), pool.GetUID())[config.Completing]
		sum += max(diff, -diff)
	}
	return sum, nil
}

// Applies returns how many status applies the running aggregator has sent.
func (d *Demo) Applies(ctx context.Context) (float64, error) {
	return d.metric(ctx, "tally_aggregator_applies_total{")
}

// metric returns the value of the first line of the running aggregator's
// metrics that starts with prefix; an error when none does.
func (d *Demo) metric(ctx context.Context, prefix string) (float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+d.aggregatorMetrics+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, prefix) {
			return strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("the aggregator exports no %s", prefix)
}

// webhookCalls says how many pod admissions the API server sent to tally's
// webhook, by operation, as it counts them
// (apiserver_admission_webhook_request_total).
func (d *Demo) webhookCalls(ctx context.Context) (string, error) {
	cs, err := kubernetes.NewForConfig(d.restConfig)
	if err != nil {
		return "", err
	}
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return "", err
	}
	sent := map[string]float64{}
	for line := range strings.Lines(string(raw)) {
		if !strings.HasPrefix(line, "apiserver_admission_webhook_request_total{") || !strings.Contains(line, `name="pods.tally.dev"`) {
			continue
		}
		i := strings.Index(line, `operation="`)
		if i < 0 {
			continue
		}
		op := line[i+len(`operation="`):]
		op = op[:strings.IndexByte(op, '"')]
		v, err := strconv.ParseFloat(strings.TrimSpace(line[strings.LastIndexByte(line, ' ')+1:]), 64)
		if err != nil {
			return "", fmt.Errorf("parsing %q: %w", line, err)
		}
		sent[op] += v
	}
	return fmt.Sprintf("the API server called the webhook for %.0f pod CREATEs and %.0f UPDATEs", sent["CREATE"], sent["UPDATE"]), nil
}
