package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"tally.dev/tally/certs/devcert"
	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// runWebhook measures admissions over TLS, on one core each: bin/webhook
// against the conventional controller-runtime webhook, then pod creates
// through the API server with tally's webhook registered and without.
func runWebhook(ctx context.Context, env *framework.Env, step time.Duration, tlsSteps bool, api apiRounds) error {
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

	if tlsSteps {
		if err := overTLS(ctx, ca, step, tallyPort, convPort); err != nil {
			return err
		}
	}
	return throughAPIServer(ctx, env, ca, tallyPort, tally.Pid(), api)
}

// overTLS measures admissions sent straight to tally's webhook and to the
// conventional one, at rising concurrency, then at half of each one's
// saturation.
func overTLS(ctx context.Context, ca *devcert.CA, step time.Duration, tallyPort, convPort int) error {
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

	return nil
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
	var firstErr firstError
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
					firstErr.set(err)
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
					firstErr.set(err)
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
	if err := firstErr.get(); err != nil {
		return loadResult{}, err
	}
	slices.Sort(lat)
	return loadResult{rate: float64(done.Load()) / time.Since(start).Seconds(), lat: lat}, nil
}

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
