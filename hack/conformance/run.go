package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/demo"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
)

// The tests run: the [Conformance] tests (label Conformance) of these
// areas. Each focus is one regular expression; ginkgo runs a test that
// matches any of them.
var focus = []string{
	`\[sig-apps\]`,
	`\[sig-node\] (Pods|Container Lifecycle Hook|Downward API)`,
	`\[sig-api-machinery\] (AdmissionWebhook|ValidatingAdmissionPolicy)`,
	`\[sig-scheduling\]`,
}

// notRunnable are the tests of the focus that cannot pass on this cluster
// whatever tally does, by name, with the reason: ginkgo skips them in both
// passes and the table lists them.
var notRunnable = []struct{ name, reason string }{
	{"[sig-apps] ReplicationController should test the lifecycle of a ReplicationController",
		"runs e2e-test-images/nginx, which is not built here"},
	{"[sig-apps] Daemon set should rollback without unnecessary restarts",
		"needs a cluster of at least two nodes"},
}

// The WorkerPool pools that run and churn through the pass with tally.
const (
	churnNamespace = "conformance-tally"
	passTimeout    = 3 * time.Hour
)

var pools = []string{"alpha", "beta", "gamma"}

type runOptions struct {
	cluster, e2e, ginkgo, images, out string
	nodes                             int
	passes                            string
}

// passResult is one pass: its tests, its wall time, how ginkgo exited and,
// with tally, what the churn did and how tally's counts ended.
type passResult struct {
	name     string
	wall     time.Duration
	cases    []testCase
	runError error
	churn    string
}

func run(o runOptions) error {
	// ginkgo runs e2e.test in e2e.test's directory.
	for _, p := range []*string{&o.cluster, &o.e2e, &o.ginkgo, &o.images, &o.out} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	kubeconfig := filepath.Join(o.cluster, "admin.kubeconfig")
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	ctx := context.Background()
	passes := strings.Split(o.passes, ",")
	for _, pass := range passes {
		if pass != "without" && pass != "with" {
			return fmt.Errorf("unknown pass %q (without, with)", pass)
		}
	}
	// A pass that ran the suite and then failed (tally's counts did not
	// settle) still has its results in the table, written before the error
	// is returned.
	var results []passResult
	var failed error
	for _, pass := range passes {
		var r passResult
		if pass == "without" {
			r, err = o.pass(ctx, pass, kubeconfig)
		} else {
			r, err = o.withTally(ctx, cfg, c, kubeconfig)
		}
		if r.cases != nil {
			results = append(results, r)
			fmt.Printf(">> pass %s: %s\n", pass, summarize(r.cases).line(r.wall))
		}
		if err != nil {
			failed = fmt.Errorf("pass %s: %w", pass, err)
			break
		}
		if len(r.cases) == 0 {
			failed = fmt.Errorf("pass %s ran no test: %v", pass, r.runError)
			break
		}
	}
	report := table(results, time.Now())
	if err := os.WriteFile(filepath.Join(o.out, "results.md"), []byte(report), 0o644); err != nil {
		return err
	}
	fmt.Print(report)
	if failed != nil {
		return failed
	}
	if onlyWith := failsOnlyWithTally(results); len(onlyWith) > 0 {
		return fmt.Errorf("%d test(s) pass without tally and fail with it: %s", len(onlyWith), strings.Join(onlyWith, "; "))
	}
	return nil
}

// pass runs the suite once into out/<name>.
func (o runOptions) pass(ctx context.Context, name, kubeconfig string) (passResult, error) {
	dir := filepath.Join(o.out, name)
	if err := os.RemoveAll(dir); err != nil {
		return passResult{}, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return passResult{}, err
	}
	logFile, err := os.Create(filepath.Join(dir, "e2e.log"))
	if err != nil {
		return passResult{}, err
	}
	defer logFile.Close()
	args := []string{
		"--nodes", fmt.Sprint(o.nodes), "--timeout", passTimeout.String(), "--no-color", "--label-filter", "Conformance",
	}
	for _, f := range focus {
		args = append(args, "--focus", f)
	}
	for _, n := range notRunnable {
		args = append(args, "--skip", regexp.QuoteMeta(n.name))
	}
	args = append(args, o.e2e, "--",
		"--kubeconfig", kubeconfig, "--provider", "skeleton", "--report-dir", dir,
		"--allowed-not-ready-nodes", "0", "--non-blocking-taints", "node-role.kubernetes.io/control-plane")
	ctx, cancel := context.WithTimeout(ctx, passTimeout+10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, o.ginkgo, args...)
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+filepath.Join(o.images, "repo-list.yaml"))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	fmt.Printf(">> pass %s: %s %s (log: %s)\n", name, o.ginkgo, strings.Join(args, " "), logFile.Name())
	start := time.Now()
	runErr := cmd.Run()
	r := passResult{name: name, wall: time.Since(start), runError: runErr}
	r.cases, err = readJUnit(dir)
	if err != nil {
		return r, fmt.Errorf("the suite's report (its run: %v): %w", runErr, err)
	}
	return r, nil
}

// withTally installs tally and the example operator, runs the pass while
// the pools churn, then checks tally's counts and totals against the pods
// and uninstalls.
func (o runOptions) withTally(ctx context.Context, cfg *rest.Config, c client.Client, kubeconfig string) (passResult, error) {
	values, err := demo.WriteClusterValues(o.out, nil)
	if err != nil {
		return passResult{}, err
	}
	cluster := &demo.Cluster{Kubeconfig: kubeconfig, Client: c, Values: values, OperatorImage: demo.OperatorImage, WorkerImage: demo.WorkerImage}
	if err := cluster.Install(ctx); err != nil {
		return passResult{}, fmt.Errorf("installing tally: %w", err)
	}
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: churnNamespace}}); err != nil {
		return passResult{}, err
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	finished, err := demo.WatchFinished(watchCtx, cfg, churnNamespace)
	if err != nil {
		return passResult{}, err
	}
	for _, p := range pools {
		if err := c.Create(ctx, operator.Pool(churnNamespace, p, 4)); err != nil {
			return passResult{}, err
		}
	}
	ch := &churner{c: c, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 43))}
	churnCtx, stopChurn := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { ch.run(churnCtx) })
	r, err := o.pass(ctx, "with", kubeconfig)
	stopChurn()
	wg.Wait()
	if err != nil {
		return r, err
	}
	settled, verdict := settle(ctx, c, finished, 5*time.Minute)
	r.churn = ch.String() + "; " + verdict
	if !settled {
		return r, fmt.Errorf("tally's counts after the pass: %s", verdict)
	}
	if err := client.IgnoreNotFound(c.Delete(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: churnNamespace}})); err != nil {
		return r, err
	}
	if err := cluster.Uninstall(ctx); err != nil {
		return r, fmt.Errorf("uninstalling tally: %w", err)
	}
	return r, nil
}

// churner scales the pools up and down (the operator marks the pods it
// removes with the completion intent), marks and deletes pods as an
// operator would, and deletes pods unmarked, every 2 s.
type churner struct {
	c                             client.Client
	rng                           *rand.Rand
	scaled, marked, deleted, errs atomic.Int64
}

func (ch *churner) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(2 * time.Second):
		}
		pool := pools[ch.rng.IntN(len(pools))]
		switch ch.rng.IntN(3) {
		case 0:
			patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, 1+ch.rng.IntN(6))
			ch.count(&ch.scaled, ch.c.Patch(ctx, operator.Pool(churnNamespace, pool, 0), client.RawPatch(types.MergePatchType, []byte(patch))))
		case 1:
			if p := ch.runningPod(ctx, pool); p != nil {
				patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"conformance"}}}`, keys.CompletionIntent)
				err := ch.c.Patch(ctx, p, client.RawPatch(types.MergePatchType, []byte(patch)))
				if err == nil {
					err = client.IgnoreNotFound(ch.c.Delete(ctx, p))
				}
				ch.count(&ch.marked, err)
			}
		case 2:
			if p := ch.runningPod(ctx, pool); p != nil {
				ch.count(&ch.deleted, client.IgnoreNotFound(ch.c.Delete(ctx, p)))
			}
		}
	}
}

func (ch *churner) count(n *atomic.Int64, err error) {
	if err != nil && !errors.Is(err, context.Canceled) {
		ch.errs.Add(1)
		fmt.Printf("churn: %v\n", err)
		return
	}
	n.Add(1)
}

// runningPod picks a running, unmarked pod of pool, or nil.
func (ch *churner) runningPod(ctx context.Context, pool string) *corev1.Pod {
	var pods corev1.PodList
	if ch.c.List(ctx, &pods, client.InNamespace(churnNamespace)) != nil {
		return nil
	}
	var running []*corev1.Pod
	for i, p := range pods.Items {
		_, marked := p.Annotations[keys.CompletionIntent]
		if !marked && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && strings.HasPrefix(p.Name, pool+"-") {
			running = append(running, &pods.Items[i])
		}
	}
	if len(running) == 0 {
		return nil
	}
	return running[ch.rng.IntN(len(running))]
}

func (ch *churner) String() string {
	return fmt.Sprintf("churn: %d scale changes, %d pods marked and deleted, %d deleted unmarked, %d errors",
		ch.scaled.Load(), ch.marked.Load(), ch.deleted.Load(), ch.errs.Load())
}

// settle waits until every pool runs what it wants and shows counts equal
// to a fresh List of its pods, and the pools' totals add up to the pods
// seen finishing; it reports the last reading.
func settle(ctx context.Context, c client.Client, finished *demo.Finished, timeout time.Duration) (bool, string) {
	deadline := time.Now().Add(timeout)
	for {
		ok, verdict := reading(ctx, c, finished)
		if ok || time.Now().After(deadline) {
			return ok, verdict
		}
		time.Sleep(time.Second)
	}
}

func reading(ctx context.Context, c client.Client, finished *demo.Finished) (bool, string) {
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(churnNamespace)); err != nil {
		return false, err.Error()
	}
	ok := true
	var parts []string
	totals := map[config.Count]int64{}
	for _, name := range pools {
		pool := operator.Pool(churnNamespace, name, 0)
		if err := c.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
			return false, err.Error()
		}
		fresh := truth.Counts(pods.Items, churnNamespace, pool.GetUID())
		desired, _, _ := unstructured.NestedInt64(pool.Object, "spec", "replicas")
		ok = ok && fresh[config.Active] == desired && fresh[config.Completing] == 0 && fresh[config.Unexpected] == 0
		var counts []string
		for _, count := range config.Counts {
			v, found, _ := unstructured.NestedInt64(pool.Object, "status", string(count))
			if !found {
				v = -1
			}
			ok = ok && v == fresh[count]
			counts = append(counts, fmt.Sprintf("%s %d/%d", count, v, fresh[count]))
		}
		for _, total := range config.Totals {
			v, _, _ := unstructured.NestedInt64(pool.Object, "status", string(total))
			totals[total] += v
		}
		parts = append(parts, fmt.Sprintf("%s (tally/fresh List): %s", name, strings.Join(counts, ", ")))
	}
	seen := finished.Totals()
	for _, total := range config.Totals {
		ok = ok && totals[total] == seen[total]
		parts = append(parts, fmt.Sprintf("%s %d (pods seen finishing: %d)", total, totals[total], seen[total]))
	}
	return ok, strings.Join(parts, "; ")
}
