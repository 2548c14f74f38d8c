package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/helm"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/identity"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// runWebhook measures admissions over TLS, on one core each: bin/webhook
// against the conventional controller-runtime webhook, then pod creates
// through the API server with tally's webhook registered and without.
func runWebhook(ctx context.Context, env *framework.Env, step time.Duration, apiRound time.Duration) error {
	dir, err := os.MkdirTemp("", "tally-bench-webhook-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := framework.BuildBinaries(dir, "webhook"); err != nil {
		return err
	}
	build := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, "conventional-webhook"), "./test/bench/conventional-webhook")
	build.Dir = repo.Root()
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building the conventional webhook: %w: %s", err, out)
	}
	ca, err := devcert.NewCA("bench CA", time.Hour)
	if err != nil {
		return err
	}
	pair, err := ca.Issue([]string{"127.0.0.1"}, time.Hour)
	if err != nil {
		return err
	}
	certDir := filepath.Join(dir, "certs")
	if err := pair.WriteDir(certDir); err != nil {
		return err
	}
	kubeconfig, err := adminKubeconfig(env, dir)
	if err != nil {
		return err
	}
	cfgFile := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfgFile, []byte("parents:\n  - {group: example.tally.dev, version: v1, kind: WorkerPool, resource: workerpools}\n"), 0o600); err != nil {
		return err
	}
	tallyPort, err := process.FreePort()
	if err != nil {
		return err
	}
	convPort, err := process.FreePort()
	if err != nil {
		return err
	}
	probe, err := process.FreePort()
	if err != nil {
		return err
	}
	oneCore := func(p *process.Process) error {
		// GOMAXPROCS=1 and the process pinned to one CPU: one core each.
		return exec.Command("taskset", "-a", "-p", "-c", "0", strconv.Itoa(p.Pid())).Run()
	}
	os.Setenv("GOMAXPROCS", "1")
	tally, err := process.Start("webhook", filepath.Join(dir, "webhook"), dir, "--config", cfgFile, "--kubeconfig", kubeconfig,
		"--cert-dir", certDir, "--host", "127.0.0.1", "--port", strconv.Itoa(tallyPort), "--metrics-bind-address", "0",
		"--health-probe-bind-address", "127.0.0.1:"+strconv.Itoa(probe), "--shutdown-delay", "0s", "--zap-log-level", "error")
	if err != nil {
		return err
	}
	defer tally.Stop()
	conv, err := process.Start("conventional-webhook", filepath.Join(dir, "conventional-webhook"), dir, "--cert-dir", certDir, "--port", strconv.Itoa(convPort))
	os.Unsetenv("GOMAXPROCS")
	if err != nil {
		return err
	}
	defer conv.Stop()
	if err := tally.WaitReady(ctx, fmt.Sprintf("http://127.0.0.1:%d/readyz", probe)); err != nil {
		return err
	}
	time.Sleep(time.Second)
	for _, p := range []*process.Process{tally, conv} {
		if err := oneCore(p); err != nil {
			return fmt.Errorf("pinning %d to CPU 0 (taskset, util-linux): %w", p.Pid(), err)
		}
	}
	// The load generator (this process) on the other core.
	if err := exec.Command("taskset", "-a", "-p", "-c", "1", strconv.Itoa(os.Getpid())).Run(); err != nil {
		return fmt.Errorf("pinning the load generator to CPU 1: %w", err)
	}

	bodies, err := reviews()
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.CertPEM)
	fmt.Printf("admissions over TLS with keep-alive, server on CPU 0 (GOMAXPROCS=1), load from CPU 1; %s per step; CREATE and intent UPDATE alternating, %d B and %d B\n", step, len(bodies[0]), len(bodies[1]))
	servers := []struct{ name, url string }{
		{"tally (bin/webhook)", fmt.Sprintf("https://127.0.0.1:%d%s", tallyPort, mutate.Path)},
		{"conventional (controller-runtime CustomDefaulter)", fmt.Sprintf("https://127.0.0.1:%d/mutate-pods", convPort)},
	}
	sat := map[string]float64{}
	for _, s := range servers {
		best, bestConc := 0.0, 0
		for _, conc := range []int{1, 2, 4, 8, 16, 32, 64} {
			res, err := load(ctx, s.url, roots, bodies, conc, step, 0)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			fmt.Printf("  %-50s concurrency %3d: %8.0f admissions/s  p50 %-8s p99 %s\n", s.name, conc, res.rate, res.p(50), res.p(99))
			if res.rate > best {
				best, bestConc = res.rate, conc
			}
		}
		half, err := load(ctx, s.url, roots, bodies, bestConc, step, best/2)
		if err != nil {
			return err
		}
		sat[s.name] = best
		fmt.Printf("%s: saturation %.0f admissions/s (concurrency %d); at 50%% (%.0f/s): p50 %s p99 %s\n",
			s.name, best, bestConc, best/2, half.p(50), half.p(99))
	}
	fmt.Printf("tally / conventional at saturation: %.1fx (target >= 5x); tally on one core: %.0f/s (target >= 10,000)\n",
		sat[servers[0].name]/sat[servers[1].name], sat[servers[0].name])

	return throughAPIServer(ctx, env, ca, tallyPort, tally.Pid(), apiRound)
}

// adminKubeconfig writes a cluster-admin kubeconfig for env into dir.
func adminKubeconfig(env *framework.Env, dir string) (string, error) {
	user, err := env.AddUser(envtest.User{Name: "bench-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return "", err
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "kubeconfig")
	return path, os.WriteFile(path, kc, 0o600)
}

// reviews returns a CREATE of the realistic pod and an UPDATE setting its
// completion intent, as the API server sends them.
func reviews() ([][]byte, error) {
	pod := builder.RealisticPod(builder.Pod("bench", "pool-0-abcde").ControlledBy(operator.GVK, "pool-0", "6f2c7e84-0b6e-4d5e-9b3a-2d0c9c1f7a11"))
	marked := pod.DeepCopy()
	marked.Labels = map[string]string{keys.ParentUID: "6f2c7e84-0b6e-4d5e-9b3a-2d0c9c1f7a11", keys.ParentName: "pool-0"}
	marked.Annotations = map[string]string{keys.Parent: "WorkerPool.example.tally.dev/pool-0"}
	old := marked.DeepCopy()
	marked.Annotations[keys.CompletionIntent] = "scale-down"
	var out [][]byte
	for _, r := range []struct {
		op       admissionv1.Operation
		obj, old *corev1.Pod
	}{{admissionv1.Create, pod, nil}, {admissionv1.Update, marked, old}} {
		raw, err := json.Marshal(r.obj)
		if err != nil {
			return nil, err
		}
		req := &admissionv1.AdmissionRequest{
			UID: types.UID("2c8e1b5a-6a0e-4bb4-9f4c-0d3a4b5c6d7e"), Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"}, Namespace: "bench", Name: r.obj.Name,
			Operation: r.op, UserInfo: authenticationv1.UserInfo{Username: "system:serviceaccount:ops:pool-operator"},
			Object: runtime.RawExtension{Raw: raw},
		}
		if r.old != nil {
			oldRaw, err := json.Marshal(r.old)
			if err != nil {
				return nil, err
			}
			req.OldObject = runtime.RawExtension{Raw: oldRaw}
		}
		body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req})
		if err != nil {
			return nil, err
		}
		out = append(out, body)
	}
	return out, nil
}

// loadResult is one load step.
type loadResult struct {
	rate float64
	lat  []time.Duration
}

func (r loadResult) p(q int) time.Duration { return pct(r.lat, q).Round(time.Microsecond) }

// load sends the bodies in turn from conc keep-alive connections for d,
// or until ctx ends: as fast as answers come (rate 0), or at rate requests
// a second in all.
func load(ctx context.Context, url string, roots *x509.CertPool, bodies [][]byte, conc int, d time.Duration, rate float64) (loadResult, error) {
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, MaxIdleConnsPerHost: conc, MaxConnsPerHost: conc, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	var mu sync.Mutex
	var lat []time.Duration
	var done atomic.Int64
	var firstErr atomic.Value
	start := time.Now()
	deadline := start.Add(d)
	var interval time.Duration
	if rate > 0 {
		interval = time.Duration(float64(time.Second) * float64(conc) / rate)
	}
	var wg sync.WaitGroup
	for w := range conc {
		wg.Go(func() {
			var mine []time.Duration
			next := start.Add(time.Duration(w) * interval / time.Duration(conc))
			for i := w; time.Now().Before(deadline); i++ {
				if interval > 0 {
					time.Sleep(time.Until(next))
					next = next.Add(interval)
				}
				t := time.Now()
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(bodies[i%len(bodies)]))
				if err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if err == nil && resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("%s", resp.Status)
					}
				}
				if err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				mine = append(mine, time.Since(t))
				done.Add(1)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		return loadResult{}, err
	}
	slices.Sort(lat)
	return loadResult{rate: float64(done.Load()) / time.Since(start).Seconds(), lat: lat}, nil
}

// throughAPIServer creates pods from 10 and 50 clients for d at a time,
// without a webhook and with tally's registered, alternating, and reads the
// API server's own measure of the webhook call.
// rounds is how many times each admission case is measured.
const rounds = 4

// createdLabel marks the pods the create rounds make, deleted between rounds
// so that every round starts from the same store.
const createdLabel = "bench.tally.dev/created"

// mean returns the mean of ds.
func mean(ds []time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum / time.Duration(len(ds))
}

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
func throughAPIServer(ctx context.Context, env *framework.Env, ca *devcert.CA, port, webhookPID int, d time.Duration) error {
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
	servers, err := children("kube-apiserver")
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
		for _, clients := range []int{10, 50} {
			fmt.Printf("%s, %d clients:\n", w.name, clients)
			type total struct {
				n                  int
				p99s               []time.Duration
				lat                []time.Duration
				apiCPU, webhookCPU time.Duration
				calls              float64
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
					before, err := webhookHistogram(ctx, cs, wh.Name)
					if err != nil {
						return err
					}
					apiBefore, whBefore := cpu(apiserver), cpu(webhookPID)
					n, lat, err := w.run(clients, c)
					if err != nil {
						return fmt.Errorf("%s, %s: %w", w.name, c.name, err)
					}
					apiCPU, whCPU := cpu(apiserver)-apiBefore, cpu(webhookPID)-whBefore
					after, err := webhookHistogram(ctx, cs, wh.Name)
					if err != nil {
						return err
					}
					t := &totals[i]
					t.n += n
					t.lat = append(t.lat, lat...)
					t.p99s = append(t.p99s, pct(lat, 99))
					t.apiCPU += apiCPU
					t.webhookCPU += whCPU
					t.calls += after[math.Inf(1)] - before[math.Inf(1)]
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
			}
		}
	}
	return register(nil)
}

// drive runs clients goroutines calling do(client) for d, and returns the
// number of calls and their latencies.
func drive(clients int, d time.Duration, do func(client int) error) (int, []time.Duration, error) {
	var mu sync.Mutex
	var lat []time.Duration
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	var firstErr atomic.Value
	for c := range clients {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(deadline) {
				t := time.Now()
				if err := do(c); err != nil {
					firstErr.CompareAndSwap(nil, err)
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
	if err, _ := firstErr.Load().(error); err != nil {
		return 0, nil, err
	}
	slices.Sort(lat)
	return len(lat), lat, nil
}

// children returns the PIDs of this process's children running the named
// commands.
func children(names ...string) ([]int, error) {
	procs, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		st := string(b)
		open, closing := strings.IndexByte(st, '('), strings.LastIndexByte(st, ')')
		if open < 0 || closing < 0 {
			continue
		}
		f := strings.Fields(st[closing+2:])
		if len(f) < 2 || f[1] != strconv.Itoa(os.Getpid()) || !slices.Contains(names, st[open+1:closing]) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		pids = append(pids, pid)
	}
	return pids, nil
}

// histogram is the API server's apiserver_admission_webhook_admission_duration_seconds
// for one webhook: cumulative counts by upper bound.
type histogram map[float64]float64

func webhookHistogram(ctx context.Context, cs kubernetes.Interface, name string) (histogram, error) {
	raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	h := histogram{}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_admission_webhook_admission_duration_seconds_bucket{") || !strings.Contains(line, `name="`+name+`"`) {
			continue
		}
		i := strings.Index(line, `le="`)
		j := strings.Index(line[i+4:], `"`)
		le, err := strconv.ParseFloat(line[i+4:i+4+j], 64)
		if err != nil {
			le = math.Inf(1)
		}
		v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		h[le] += v
	}
	return h, sc.Err()
}
