package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// admissionCase is one way the API server admits the measured requests.
type admissionCase struct {
	name string
	// conditions are the registration's match conditions; nil registers no
	// webhook.
	conditions []admissionregistrationv1.MatchCondition
	// stamp makes the created pods carry their identity already.
	stamp bool
}

// throughAPIServer measures pod creates and label-only updates of tracked
// pods through the API server, alternating how they are admitted: no
// webhook, tally's registration as it was (every tracked pod called),
// tally's registration now, for pods their operator did not stamp and for
// pods it did. It reports latency, throughput, webhook calls, and the CPU
// time the API server and the webhook spent per request.
// apiRounds says how the admissions through the API server are measured.
type apiRounds struct {
	round  time.Duration
	rounds int
	// workloads, when set, keeps the workloads whose name contains it.
	workloads string
	// clients lists the numbers of clients, comma-separated.
	clients string
	// cases, when set, keeps the cases whose name contains it, beside the
	// first (no webhook), which the others are measured against.
	cases string
}

func throughAPIServer(ctx context.Context, env *framework.Env, ca *devcert.CA, port, webhookPID int, api apiRounds) error {
	d, rounds := api.round, api.rounds
	var clientCounts []int
	for _, f := range strings.Split(api.clients, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("-api-clients: %q is not a number of clients", f)
		}
		clientCounts = append(clientCounts, n)
	}
	if rounds < 1 {
		return fmt.Errorf("-api-rounds must be at least 1, not %d", rounds)
	}
	cfg := rest.CopyConfig(env.Config)
	cfg.QPS, cfg.Burst = -1, 0
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	pool := operator.Pool(ns, "creates", 0)
	if err := env.Client.Create(ctx, pool); err != nil {
		return err
	}
	tallyCfg := &config.Config{Parents: []config.Parent{{Group: "example.tally.dev", Version: "v1", Kind: "WorkerPool", Resource: "workerpools"}}}
	wh := mutate.Webhook(tallyCfg, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To(fmt.Sprintf("https://127.0.0.1:%d%s", port, mutate.Path)), CABundle: ca.CertPEM,
	}, helm.AggregatorUser)
	now := wh.MatchConditions
	var previous []admissionregistrationv1.MatchCondition
	for _, c := range now {
		if c.Name != mutate.ChangeConditionName {
			previous = append(previous, c)
		}
	}
	register := func(conds []admissionregistrationv1.MatchCondition) error {
		mwc := &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "tally-bench"}}
		if err := client.IgnoreNotFound(env.Client.Delete(ctx, mwc)); err != nil {
			return err
		}
		if conds != nil {
			w := wh.DeepCopy()
			w.MatchConditions = conds
			mwc.Webhooks = []admissionregistrationv1.MutatingWebhook{*w}
			if err := env.Client.Create(ctx, mwc); err != nil {
				return err
			}
		}
		// The API server picks registrations up asynchronously.
		time.Sleep(2 * time.Second)
		return nil
	}
	servers, err := process.Children(os.Getpid(), "kube-apiserver")
	if err != nil || len(servers) != 1 {
		return fmt.Errorf("finding the API server among this process's children: %v (found %v)", err, servers)
	}
	apiserver := servers[0]
	newPod := func(name string, stamp bool) *corev1.Pod {
		pod := builder.RealisticPod(builder.Pod(ns, name).ControlledBy(operator.GVK, pool.GetName(), pool.GetUID()).Label(createdLabel, "true"))
		if stamp {
			identity.Stamp(pod)
		}
		return pod
	}
	var seq atomic.Int64
	creates := func(clients int, c admissionCase) (int, []time.Duration, error) {
		return drive(clients, d, func(int) error {
			pod := newPod(fmt.Sprintf("creates-%d", seq.Add(1)), c.stamp)
			_, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
			return err
		})
	}
	// Each update client relabels a pod of its own, stamped when it was
	// created, so that the updates never conflict.
	updated := make([]string, 50)
	for i := range updated {
		pod := newPod(fmt.Sprintf("updated-%d", i), true)
		delete(pod.Labels, createdLabel)
		if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return err
		}
		updated[i] = pod.Name
	}
	updates := func(clients int, _ admissionCase) (int, []time.Duration, error) {
		return drive(clients, d, func(client int) error {
			patch := fmt.Appendf(nil, `{"metadata":{"labels":{"tick":"%d"}}}`, seq.Add(1))
			_, err := cs.CoreV1().Pods(ns).Patch(ctx, updated[client], types.MergePatchType, patch, metav1.PatchOptions{})
			return err
		})
	}

	workloads := []struct {
		name  string
		run   func(int, admissionCase) (int, []time.Duration, error)
		cases []admissionCase
	}{
		{"pod creates (realistic pods of a WorkerPool)", creates, []admissionCase{
			{name: "no admission webhook"},
			{name: "tally, pods not stamped", conditions: now},
			{name: "tally, pods stamped by their operator", conditions: now, stamp: true},
			{name: "tally before (every tracked pod called), stamped", conditions: previous, stamp: true},
		}},
		{"label-only updates of stamped tracked pods", updates, []admissionCase{
			{name: "no admission webhook"},
			{name: "tally", conditions: now},
			{name: "tally before (every tracked pod called)", conditions: previous},
		}},
	}
	fmt.Printf("\nthrough the API server (API server and etcd on both cores, the webhook on CPU 0, the clients on CPU 1), %s a round, the cases alternating in %d rounds, each round in another order; the created pods deleted between rounds; CPU from /proc/<pid>/stat\n", d, rounds)
	for _, w := range workloads {
		if !strings.Contains(w.name, api.workloads) {
			continue
		}
		w.cases = slices.DeleteFunc(slices.Clone(w.cases), func(c admissionCase) bool {
			return c.name != w.cases[0].name && !strings.Contains(c.name, api.cases)
		})
		for _, clients := range clientCounts {
			fmt.Printf("%s, %d clients:\n", w.name, clients)
			type total struct {
				n                  int
				p99s               []time.Duration
				lat                []time.Duration
				apiCPU, webhookCPU time.Duration
				calls              float64
				// plugin is the MutatingAdmissionWebhook plugin's time
				// (its every registration: selectors, the object's
				// conversion, match conditions, calls), conditions the
				// evaluations of tally's match conditions that excluded
				// the webhook, by the API server's own histograms.
				plugin, conditions sumCount
				// cpus are each round's API-server CPU per request.
				cpus []time.Duration
			}
			totals := make([]total, len(w.cases))
			for round := range rounds {
				for k := range w.cases {
					// Each case runs first, second ... in turn.
					i := (k + round) % len(w.cases)
					c := w.cases[i]
					if err := cs.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: createdLabel}); err != nil {
						return err
					}
					if err := register(c.conditions); err != nil {
						return err
					}
					before, err := scrapeAdmission(ctx, cs, wh.Name)
					if err != nil {
						return err
					}
					apiBefore, whBefore := cpu(apiserver), cpu(webhookPID)
					n, lat, err := w.run(clients, c)
					if err != nil {
						return fmt.Errorf("%s, %s: %w", w.name, c.name, err)
					}
					apiCPU, whCPU := cpu(apiserver)-apiBefore, cpu(webhookPID)-whBefore
					after, err := scrapeAdmission(ctx, cs, wh.Name)
					if err != nil {
						return err
					}
					t := &totals[i]
					t.n += n
					t.lat = append(t.lat, lat...)
					t.p99s = append(t.p99s, pct(lat, 99))
					t.apiCPU += apiCPU
					t.webhookCPU += whCPU
					if n > 0 {
						t.cpus = append(t.cpus, apiCPU/time.Duration(n))
					}
					t.calls += after.calls - before.calls
					t.plugin = t.plugin.add(after.plugin.sub(before.plugin))
					t.conditions = t.conditions.add(after.conditions.sub(before.conditions))
				}
			}
			base := totals[0]
			baseP99 := mean(base.p99s)
			baseCPU := base.apiCPU / time.Duration(base.n)
			for i, c := range w.cases {
				t := totals[i]
				slices.Sort(t.lat)
				p99 := mean(t.p99s)
				cpu := t.apiCPU / time.Duration(t.n)
				fmt.Printf("  %-52s %6d requests, %5.0f/s, p50 %-9s p99 %-9s (%.2fx), API server CPU %6.3f ms/request (%.2fx), webhook CPU %.3f ms/request, webhook calls %.0f\n",
					c.name, t.n, float64(t.n)/(float64(rounds)*d.Seconds()), pct(t.lat, 50).Round(time.Microsecond), p99.Round(time.Microsecond),
					float64(p99)/float64(baseP99), float64(cpu.Microseconds())/1000, float64(cpu)/float64(baseCPU),
					float64((t.webhookCPU/time.Duration(t.n)).Microseconds())/1000, t.calls)
				// The API server runs the plugin again for a request a
				// webhook patched (reinvocation), and records a match
				// condition's time only when the conditions exclude the
				// webhook (or fail): both are per request only where no
				// call patches.
				fmt.Printf("  %-52s admission by the API server's metrics: MutatingAdmissionWebhook %.1f µs/request over %.0f passes, tally's match conditions %.1f µs an evaluation that excluded the webhook (%.0f)\n", "",
					t.plugin.perRequest(float64(t.n))*1e6, t.plugin.count, t.conditions.mean()*1e6, t.conditions.count)
				if i > 0 {
					// Each round's ratio to the same round of no webhook.
					p99r, cpur := ratios(t.p99s, base.p99s), ratios(t.cpus, base.cpus)
					fmt.Printf("  %-52s by round: p99 %.2f–%.2fx (median %.2f), API server CPU %.2f–%.2fx (median %.2f)\n", "",
						p99r[0], p99r[len(p99r)-1], p99r[len(p99r)/2], cpur[0], cpur[len(cpur)-1], cpur[len(cpur)/2])
				}
			}
		}
	}
	return register(nil)
}

// ratios returns each round's a over the same round's b, sorted.
func ratios(a, b []time.Duration) []float64 {
	out := make([]float64, 0, min(len(a), len(b)))
	for i := range min(len(a), len(b)) {
		out = append(out, float64(a[i])/float64(b[i]))
	}
	if len(out) == 0 {
		out = append(out, math.NaN())
	}
	slices.Sort(out)
	return out
}

// firstError keeps the first error that any of several goroutines met.
type firstError struct {
	mu  sync.Mutex
	err error
}

func (f *firstError) set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
	}
}

func (f *firstError) get() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// drive runs clients goroutines calling do(client) for d, and returns the
// number of calls and their latencies.
func drive(clients int, d time.Duration, do func(client int) error) (int, []time.Duration, error) {
	var mu sync.Mutex
	var lat []time.Duration
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	var firstErr firstError
	for c := range clients {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(deadline) {
				t := time.Now()
				if err := do(c); err != nil {
					firstErr.set(err)
					return
				}
				mine = append(mine, time.Since(t))
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if err := firstErr.get(); err != nil {
		return 0, nil, err
	}
	slices.Sort(lat)
	return len(lat), lat, nil
}

// sumCount is a histogram's _sum and _count.
type sumCount struct{ sum, count float64 }

func (a sumCount) add(b sumCount) sumCount { return sumCount{a.sum + b.sum, a.count + b.count} }
func (a sumCount) sub(b sumCount) sumCount { return sumCount{a.sum - b.sum, a.count - b.count} }

// mean returns the mean observation, 0 with none.
func (a sumCount) mean() float64 { return a.perRequest(a.count) }

// perRequest returns the sum spread over n requests, 0 with none.
func (a sumCount) perRequest(n float64) float64 {
	if n == 0 {
		return 0
	}
	return a.sum / n
}

// admission is what the API server's /metrics says of admission at one
// moment.
type admission struct {
	// calls is how many times it called the webhook name.
	calls float64
	// plugin is apiserver_admission_controller_admission_duration_seconds
	// of the MutatingAdmissionWebhook plugin, over requests it admitted.
	plugin sumCount
	// conditions is apiserver_admission_match_condition_evaluation_seconds
	// of the webhook name.
	conditions sumCount
}

func scrapeAdmission(ctx context.Context, cs kubernetes.Interface, name string) (admission, error) {
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return admission{}, err
	}
	var a admission
	value := func(line string) float64 {
		v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		return v
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		webhook := strings.Contains(line, `name="`+name+`"`)
		plugin := strings.Contains(line, `name="MutatingAdmissionWebhook"`) && strings.Contains(line, `type="admit"`) && strings.Contains(line, `rejected="false"`)
		switch {
		case webhook && strings.HasPrefix(line, "apiserver_admission_webhook_admission_duration_seconds_count{"):
			a.calls += value(line)
		case plugin && strings.HasPrefix(line, "apiserver_admission_controller_admission_duration_seconds_sum{"):
			a.plugin.sum += value(line)
		case plugin && strings.HasPrefix(line, "apiserver_admission_controller_admission_duration_seconds_count{"):
			a.plugin.count += value(line)
		case webhook && strings.HasPrefix(line, "apiserver_admission_match_condition_evaluation_seconds_sum{"):
			a.conditions.sum += value(line)
		case webhook && strings.HasPrefix(line, "apiserver_admission_match_condition_evaluation_seconds_count{"):
			a.conditions.count += value(line)
		}
	}
	return a, sc.Err()
}
