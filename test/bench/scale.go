package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/examples/workerpool/operator"
	"tally.dev/tally/internal/process"
	"tally.dev/tally/internal/repo"
	"tally.dev/tally/internal/truth"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/test/builder"
	"tally.dev/tally/test/framework"
)

// stampTime is the completion intents' -at stamp.
var stampTime = time.Now().UTC().Format(time.RFC3339)

// scalePool is one parent of the scale scenario and the state of its pods.
type scalePool struct {
	ns, name string
	uid      types.UID
	pods     []*corev1.Pod
}

// truth is what the pool's status must show.
func (p *scalePool) truth() map[config.Count]int64 {
	pods := make([]corev1.Pod, len(p.pods))
	for i, pod := range p.pods {
		pods[i] = *pod
	}
	return truth.Counts(pods, p.ns, p.uid)
}

// contender is a process counting the pools: tally's aggregator, or the
// conventional controller.
type contender struct {
	name string
	bin  string
	args []string
	// env is added to the process's environment.
	env []string
}

// scaleResult is what one contender measured.
type scaleResult struct {
	name                        string
	idleRSS, peakRSS, steadyRSS int64 // bytes
	firstComplete               time.Duration
	initialCPU                  time.Duration
	burstConverged              time.Duration
	burstCPU                    time.Duration
	burstChanges                int
	rssPerPod                   float64
	// A 3 s pause of tally's process (SIGSTOP) while 1-2% of the pods gain
	// an intent: from the process running again to every parent right, and
	// the CPU it used meanwhile (a relist of every pod would show).
	pauseChanges   int
	pauseConverged time.Duration
	pauseCPU       time.Duration
}

// runScale creates namespaces × parents × pods pods (Kubernetes' limits are
// 150,000 pods per cluster and 3,000 per namespace) and measures, for the
// aggregator (protobuf and JSON) and the conventional controller, the time
// from start to every parent right, memory and CPU, and convergence after
// 10% of the pods change at once.
func runScale(ctx context.Context, env *framework.Env, namespaces, parentsPerNS, podsPer int, tallyOnly bool, only string) error {
	dir, err := os.MkdirTemp("", "tally-bench-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := framework.BuildBinaries(dir, "aggregator"); err != nil {
		return err
	}
	build := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, "conventional"), "./test/bench/conventional")
	build.Dir = repo.Root()
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building the conventional controller: %w: %s", err, out)
	}
	kubeconfig, err := adminKubeconfig(env, dir)
	if err != nil {
		return err
	}
	cfgFile := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfgFile, []byte(`parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    resource: workerpools
    counts: {completing: status.completing, completed: status.completed, active: status.active, unexpected: status.unexpected}
`), 0o600); err != nil {
		return err
	}
	customFile := filepath.Join(dir, "custom.yaml")
	if err := os.WriteFile(customFile, []byte(`parents:
  - group: example.tally.dev
    version: v1
    kind: WorkerPool
    resource: workerpools
    counts: {completing: status.completing, completed: status.completed, active: status.active, unexpected: status.unexpected}
    customCounts:
      - name: ready
        path: status.ready
        expression: 'has(pod.status.conditions) && pod.status.conditions.exists(c, c.type == "Ready" && c.status == "True")'
      - name: restarted
        path: status.restarted
        expression: 'has(pod.status.containerStatuses) && pod.status.containerStatuses.exists(s, s.restartCount > 0)'
`), 0o600); err != nil {
		return err
	}
	aggArgs := []string{"--config", cfgFile, "--kubeconfig", kubeconfig, "--metrics-bind-address", "0", "--backfill-interval", "1h"}
	customArgs := append([]string{"--config", customFile}, aggArgs[2:]...)
	contenders := []contender{
		{name: "tally aggregator (protobuf)", bin: filepath.Join(dir, "aggregator"), args: aggArgs},
		{name: "tally aggregator (json)", bin: filepath.Join(dir, "aggregator"), args: append(append([]string{}, aggArgs...), "--kube-api-content-type", "json")},
		{name: "tally aggregator (protobuf, GOGC=50)", bin: filepath.Join(dir, "aggregator"), args: aggArgs, env: []string{"GOGC=50"}},
		{name: "tally aggregator (protobuf, two custom counts)", bin: filepath.Join(dir, "aggregator"), args: customArgs},
		{name: "conventional controller", bin: filepath.Join(dir, "conventional"), args: []string{"--kubeconfig", kubeconfig}},
	}
	if tallyOnly {
		contenders = contenders[:len(contenders)-1]
	}
	if only != "" {
		contenders = slices.DeleteFunc(contenders, func(c contender) bool { return !strings.Contains(c.name, only) })
	}

	// A client that is not the bottleneck: protobuf, no client-side limit.
	fast := rest.CopyConfig(env.Config)
	fast.QPS, fast.Burst = -1, 0
	fast.ContentType = "application/vnd.kubernetes.protobuf"
	cs, err := kubernetes.NewForConfig(fast)
	if err != nil {
		return err
	}
	c, err := client.New(fast, client.Options{})
	if err != nil {
		return err
	}

	start := time.Now()
	var pools []*scalePool
	for n := range namespaces {
		ns := fmt.Sprintf("scale-%02d", n)
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			return err
		}
		for i := range parentsPerNS {
			pool := operator.Pool(ns, fmt.Sprintf("pool-%02d", i), int64(podsPer))
			if err := c.Create(ctx, pool); err != nil {
				return err
			}
			pools = append(pools, &scalePool{ns: ns, name: pool.GetName(), uid: pool.GetUID()})
		}
	}

	fmt.Printf("created %d namespaces and %d parents in %s\n", namespaces, len(pools), time.Since(start).Round(time.Millisecond))

	// Idle baselines: the parents, no pods yet.
	idle := map[string]int64{}
	for _, ct := range contenders {
		p, err := startContender(ctx, ct, dir)
		if err != nil {
			return err
		}
		time.Sleep(5 * time.Second)
		idle[ct.name] = rss(p.Pid())
		if err := p.Stop(); err != nil {
			return err
		}
	}

	var creates []func() error
	for _, p := range pools {
		for j := range podsPer {
			// Stamped exactly as the webhook would, so that the aggregator's
			// start-up sweep finds nothing to correct.
			pod := builder.RealisticPod(builder.Pod(p.ns, fmt.Sprintf("%s-%03d", p.name, j)).
				ControlledBy(operator.GVK, p.name, p.uid).
				Label(keys.ParentUID, string(p.uid)).Label(keys.ParentName, p.name).
				Annotation(keys.Parent, "WorkerPool.example.tally.dev/"+p.name).
				Mixed(j))
			if _, ok := pod.Annotations[keys.CompletionIntent]; ok {
				pod.Annotations[keys.CompletionIntentAt] = stampTime
				pod.Annotations[keys.CompletionIntentBy] = "bench"
			}
			p.pods = append(p.pods, pod)
			creates = append(creates, func() error {
				created, err := cs.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
				if err != nil {
					return err
				}
				if pod.Status.Phase != "" {
					created.Status.Phase = pod.Status.Phase
					if pod.Status.Phase == corev1.PodRunning {
						// What a kubelet reports of a running pod, which the
						// custom counts read.
						created.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
						for _, c := range created.Spec.Containers {
							created.Status.ContainerStatuses = append(created.Status.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, Ready: true,
								RestartCount: int32(j % 3), State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}})
						}
					}
					_, err = cs.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{})
				}
				return err
			})
		}
	}
	fmt.Printf("creating %d pods (%d per parent, %d per namespace)...\n", len(creates), podsPer, parentsPerNS*podsPer)
	start = time.Now()
	if err := parallel(48, creates); err != nil {
		return fmt.Errorf("creating pods: %w", err)
	}
	fmt.Printf("created %d pods in %s (%.0f pods/s)\n", len(creates), time.Since(start).Round(time.Millisecond), float64(len(creates))/time.Since(start).Seconds())

	var results []scaleResult
	for round, ct := range contenders {
		// Statuses that no count can equal: the contender must write all.
		var resets []func() error
		for _, p := range pools {
			resets = append(resets, func() error {
				u := operator.Pool(p.ns, p.name, 0)
				return c.Status().Patch(ctx, u, client.RawPatch("application/merge-patch+json",
					[]byte(`{"status":{"completing":-1,"completed":-1,"active":-1,"unexpected":-1}}`)))
			})
		}
		if err := parallel(32, resets); err != nil {
			return err
		}
		r, err := measure(ctx, c, cs, ct, dir, pools, round, len(creates))
		if err != nil {
			return fmt.Errorf("%s: %w", ct.name, err)
		}
		r.idleRSS = idle[ct.name]
		r.rssPerPod = float64(r.steadyRSS-r.idleRSS) / float64(len(creates))
		results = append(results, r)
		fmt.Printf("%s: every parent right %s after start; RSS idle %.0f MiB, peak %.0f MiB, steady %.0f MiB (%.0f B per pod above idle); CPU %.1f s to the first complete write; burst of %d changes converged in %s, %.2f CPU s per 1,000 changes\n",
			r.name, r.firstComplete.Round(time.Millisecond), mib(r.idleRSS), mib(r.peakRSS), mib(r.steadyRSS), r.rssPerPod,
			r.initialCPU.Seconds(), r.burstChanges, r.burstConverged.Round(time.Millisecond), r.burstCPU.Seconds()/float64(r.burstChanges)*1000)
		if r.pauseChanges > 0 {
			fmt.Printf("%s: paused %s while %d pods gained an intent: every parent right %s after it ran again, with %.2f CPU s meanwhile\n",
				r.name, pauseFor, r.pauseChanges, r.pauseConverged.Round(time.Millisecond), r.pauseCPU.Seconds())
		}
	}
	fmt.Println()
	fmt.Printf("| | pods | every parent right after | RSS idle | RSS peak | RSS steady | per pod above idle | CPU to first complete write | burst of 10%%: converged | CPU per 1,000 changes |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		fmt.Printf("| %s | %d | %s | %.0f MiB | %.0f MiB | %.0f MiB | %.0f B | %.1f s | %s | %.2f s |\n", r.name, len(creates), r.firstComplete.Round(100*time.Millisecond),
			mib(r.idleRSS), mib(r.peakRSS), mib(r.steadyRSS), r.rssPerPod, r.initialCPU.Seconds(), r.burstConverged.Round(100*time.Millisecond), r.burstCPU.Seconds()/float64(r.burstChanges)*1000)
	}
	if conv := results[len(results)-1]; conv.name == "conventional controller" {
		fmt.Printf("\nsteady RSS, aggregator (protobuf) / conventional: %.3f (target <= 0.1)\n", float64(results[0].steadyRSS)/float64(conv.steadyRSS))
	}
	if len(results) > 1 && strings.Contains(results[1].name, "json") {
		fmt.Printf("CPU to the first complete write, protobuf / json: %.2f\n", results[0].initialCPU.Seconds()/results[1].initialCPU.Seconds())
	}
	return nil
}

func startContender(ctx context.Context, ct contender, dir string) (*process.Process, error) {
	port, err := process.FreePort()
	if err != nil {
		return nil, err
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	for _, kv := range ct.env {
		k, v, _ := strings.Cut(kv, "=")
		os.Setenv(k, v)
		defer os.Unsetenv(k)
	}
	p, err := process.Start(strings.Fields(ct.name)[0]+"-"+strconv.Itoa(port), ct.bin, dir, append(ct.args, "--health-probe-bind-address", addr)...)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	if err := p.WaitReady(ctx, "http://"+addr+"/readyz"); err != nil {
		_ = p.Stop()
		return nil, err
	}
	return p, nil
}

// measure runs one contender over the pools: start to every parent right,
// then a burst of changes to 10% of the pods (round picks which).
func measure(ctx context.Context, c client.Client, cs kubernetes.Interface, ct contender, dir string, pools []*scalePool, round, nPods int) (scaleResult, error) {
	r := scaleResult{name: ct.name}
	start := time.Now()
	p, err := startContender(ctx, ct, dir)
	if err != nil {
		return r, err
	}
	defer p.Stop()
	var peak int64
	var mu sync.Mutex
	sample := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-sample:
				return
			case <-time.After(100 * time.Millisecond):
				mu.Lock()
				peak = max(peak, rss(p.Pid()))
				mu.Unlock()
			}
		}
	})
	defer func() {
		close(sample)
		wg.Wait()
	}()
	if err := waitRight(ctx, c, pools, 15*time.Minute); err != nil {
		return r, err
	}
	r.firstComplete = time.Since(start)
	r.initialCPU = cpu(p.Pid())
	time.Sleep(10 * time.Second)
	r.steadyRSS = rss(p.Pid())

	// Burst: 10% of the pods gain an intent (pods of this round only).
	changes := markIntents(ctx, cs, pools, func(j int) bool { return j%10 == round })
	r.burstChanges = len(changes)
	cpu0 := cpu(p.Pid())
	start = time.Now()
	if err := parallel(48, changes); err != nil {
		return r, err
	}
	if err := waitRight(ctx, c, pools, 15*time.Minute); err != nil {
		return r, err
	}
	r.burstConverged = time.Since(start)
	r.burstCPU = cpu(p.Pid()) - cpu0
	mu.Lock()
	r.peakRSS = peak
	mu.Unlock()
	if strings.HasPrefix(ct.name, "tally") {
		if err := pause(ctx, c, cs, p, pools, round, &r); err != nil {
			return r, err
		}
	}
	return r, nil
}

// markIntents returns the changes that give an intent to the pods, j-th of
// their pool, that pick picks and that have none yet, and records it in the
// pools' truth.
func markIntents(ctx context.Context, cs kubernetes.Interface, pools []*scalePool, pick func(j int) bool) []func() error {
	var changes []func() error
	for _, pool := range pools {
		for j, pod := range pool.pods {
			if !pick(j) || pod.Annotations[keys.CompletionIntent] != "" {
				continue
			}
			if pod.Annotations == nil {
				pod.Annotations = map[string]string{}
			}
			// The truth holds what the patch writes: an intent on a
			// finished pod counts only with its stamps (first sight).
			pod.Annotations[keys.CompletionIntent] = "scale-down"
			pod.Annotations[keys.CompletionIntentAt] = stampTime
			pod.Annotations[keys.CompletionIntentBy] = "bench"
			patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"scale-down",%q:%q,%q:"bench"}}}`,
				keys.CompletionIntent, keys.CompletionIntentAt, stampTime, keys.CompletionIntentBy)
			changes = append(changes, func() error {
				_, err := cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
				return err
			})
		}
	}
	return changes
}

// pauseFor is how long pause stops tally's process.
const pauseFor = 3 * time.Second

// pause stops p (SIGSTOP) for pauseFor while 1-2% of the pods, of a tenth
// that no burst changes, gain an intent, and measures from when p runs
// again to every parent right, and the CPU p used meanwhile.
func pause(ctx context.Context, c client.Client, cs kubernetes.Interface, p *process.Process, pools []*scalePool, round int, r *scaleResult) error {
	// Two of each hundred, x and x+10, one of which has no intent yet (a
	// pod's index a multiple of 3 has one from the start); never a burst's.
	x := (round + 5) % 10
	changes := markIntents(ctx, cs, pools, func(j int) bool { return j%100 == x || j%100 == x+10 })
	r.pauseChanges = len(changes)
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	stopped := time.Now()
	err := parallel(48, changes)
	time.Sleep(time.Until(stopped.Add(pauseFor)))
	if err := errors.Join(err, p.Signal(syscall.SIGCONT)); err != nil {
		return err
	}
	cpu0, start := cpu(p.Pid()), time.Now()
	if err := waitRight(ctx, c, pools, 15*time.Minute); err != nil {
		return fmt.Errorf("after a pause: %w", err)
	}
	r.pauseConverged = time.Since(start)
	r.pauseCPU = cpu(p.Pid()) - cpu0
	return nil
}

// waitRight waits until every pool's status equals its truth.
func waitRight(ctx context.Context, c client.Client, pools []*scalePool, timeout time.Duration) error {
	want := map[string]map[config.Count]int64{}
	for _, p := range pools {
		want[p.ns+"/"+p.name] = p.truth()
	}
	deadline := time.Now().Add(timeout)
	for {
		list := &unstructured.UnstructuredList{}
		list.SetGroupVersionKind(operator.GVK.GroupVersion().WithKind("WorkerPoolList"))
		if err := c.List(ctx, list); err != nil {
			return err
		}
		wrong := 0
		for _, u := range list.Items {
			for name, v := range want[u.GetNamespace()+"/"+u.GetName()] {
				if got, _, _ := unstructured.NestedInt64(u.Object, "status", string(name)); got != v {
					wrong++
					break
				}
			}
		}
		if wrong == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d parents not right after %s", wrong, len(pools), timeout)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// rss returns a process's resident set size in bytes.
func rss(pid int) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// cpu returns the user and system CPU time a process has used.
func cpu(pid int) time.Duration {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}
