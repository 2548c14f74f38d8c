package contract

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	jsonpatch "github.com/evanphx/json-patch/v5"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// owners are the ownerReferences a request may carry: tracked kinds in
// their own and another version, a parent name that is no label value, one
// too long for a label, a kind of the same name in another group, and
// kinds tally does not track.
var owners = []metav1.OwnerReference{
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "pool-a", UID: "0c3e2b9e-0000-4000-8000-00000000000a"},
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "pool-b", UID: "0c3e2b9e-0000-4000-8000-00000000000b"},
	{APIVersion: "example.tally.dev/v2", Kind: "WorkerPool", Name: "pool-a", UID: "0c3e2b9e-0000-4000-8000-00000000000a"},
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: strings.Repeat("p", 70), UID: "0c3e2b9e-0000-4000-8000-00000000000c"},
	{APIVersion: "example.tally.dev/v1", Kind: "WorkerPool", Name: "Pool_A.", UID: "0c3e2b9e-0000-4000-8000-00000000000d"},
	{APIVersion: "v1", Kind: "ReplicationController", Name: "rc", UID: "0c3e2b9e-0000-4000-8000-0000000000rc"},
	{APIVersion: "other.dev/v1", Kind: "WorkerPool", Name: "pool-a", UID: "0c3e2b9e-0000-4000-8000-00000000000a"},
	{APIVersion: "batch/v1", Kind: "Job", Name: "job", UID: "0c3e2b9e-0000-4000-8000-0000000000jb"},
	{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", UID: "0c3e2b9e-0000-4000-8000-0000000000rs"},
}

// reasons are intents a client may set: valid tokens and invalid ones.
var reasons = []string{"scale-down", "drain", "Scale Down", strings.Repeat("x", 64), ""}

// users are the requesters, impersonated with every permission; none is
// tally's own.
var users = []string{"alice", "bob", "system:serviceaccount:ops:workerpool-operator"}

// managers are the field managers of server-side applies.
var managers = []string{"operator", "kubectl", "gitops"}

// request is one request of a sequence: what it does, drawn from the seed,
// and how to send it.
type request struct {
	step int
	user string
	pod  string
	what string
	send func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error)
	// op, stored and asked are what the model reads, for the requests
	// whose result the fuzzer can compute as the API server does (CREATE,
	// PUT, merge, strategic-merge and JSON patches): the operation, the pod
	// as stored before (nil on CREATE) and the pod the request asks for.
	// asked is nil for the others.
	op            string
	stored, asked *corev1.Pod
	// main: the request goes to the pods resource, whose CREATE and
	// UPDATE the webhook is registered for.
	main bool
}

// generator draws the requests of one sequence from its seed.
type generator struct {
	rng  *rand.Rand
	ns   string
	pods []string
	// read returns the stored pod (nil when there is none), for the
	// requests built on it: PUT, JSON patch tests.
	read func(ctx context.Context, name string) *corev1.Pod
}

func (g *generator) pick(n int) int { return g.rng.IntN(n) }

func (g *generator) chance(p float64) bool { return g.rng.Float64() < p }

// meta draws a random change to a pod's metadata, applied to m: owners,
// identity keys, an intent, its stamps, finalizers, other labels.
func (g *generator) meta(m *metav1.ObjectMeta, now time.Time) []string {
	var did []string
	if m.Labels == nil {
		m.Labels = map[string]string{}
	}
	if m.Annotations == nil {
		m.Annotations = map[string]string{}
	}
	for n := 1 + g.pick(3); n > 0; n-- {
		switch g.pick(14) {
		case 0, 1:
			m.OwnerReferences = g.ownerRefs()
			did = append(did, "owners "+describeRefs(m.OwnerReferences))
		case 2:
			for i := range m.OwnerReferences {
				m.OwnerReferences[i].Controller = ptr.To(g.chance(0.5))
			}
			did = append(did, "controller flags "+describeRefs(m.OwnerReferences))
		case 3:
			ref := owners[g.pick(len(owners))]
			m.Labels[parentUIDLabel] = string(ref.UID)
			m.Labels[parentNameLabel] = ref.Name[:min(len(ref.Name), 63)]
			m.Annotations[parentAnnotation] = ref.Kind + ".example.tally.dev/" + ref.Name
			did = append(did, "identity of "+ref.Name[:min(len(ref.Name), 8)])
		case 4:
			delete(m.Labels, parentUIDLabel)
			delete(m.Labels, parentNameLabel)
			delete(m.Annotations, parentAnnotation)
			did = append(did, "identity removed")
		case 5, 6:
			r := reasons[g.pick(len(reasons))]
			m.Annotations[intentKey] = r
			did = append(did, fmt.Sprintf("intent %q", r))
		case 7:
			delete(m.Annotations, intentKey)
			did = append(did, "intent removed")
		case 8, 9:
			at := g.stamp(now)
			by := append(slices.Clone(users), "mallory", unobserved)[g.pick(len(users)+2)]
			m.Annotations[intentAtKey], m.Annotations[intentByKey] = at, by
			did = append(did, fmt.Sprintf("stamps %q by %q", at, by))
		case 10:
			delete(m.Annotations, intentAtKey)
			delete(m.Annotations, intentByKey)
			did = append(did, "stamps removed")
		case 11:
			m.Finalizers = g.finalizers()
			did = append(did, fmt.Sprintf("finalizers %v", m.Finalizers))
		case 12:
			m.Labels["app"] = fmt.Sprintf("w%d", g.pick(3))
			did = append(did, "label app")
		default:
			m.Annotations["note"] = strconv.Itoa(g.pick(100))
			did = append(did, "annotation note")
		}
	}
	return did
}

func (g *generator) ownerRefs() []metav1.OwnerReference {
	var refs []metav1.OwnerReference
	controller := false
	for n := g.pick(4); n > 0; n-- {
		ref := owners[g.pick(len(owners))]
		if slices.ContainsFunc(refs, func(r metav1.OwnerReference) bool { return r.UID == ref.UID }) {
			continue
		}
		// At most one controller, mostly: the API server refuses two.
		c := !controller && g.chance(0.7) || g.chance(0.03)
		controller = controller || c
		ref.Controller = ptr.To(c)
		refs = append(refs, ref)
	}
	return refs
}

// stamp draws an -at value a client could write: of now (within the
// reinvocation window), long ago, in the future, not UTC, not a time.
func (g *generator) stamp(now time.Time) string {
	switch g.pick(6) {
	case 0:
		return now.UTC().Format(time.RFC3339)
	case 1:
		return "2001-01-01T00:00:00Z"
	case 2:
		return now.Add(-time.Minute).UTC().Format(time.RFC3339)
	case 3:
		return now.Add(time.Hour).UTC().Format(time.RFC3339)
	case 4:
		return now.In(time.FixedZone("UTC+1", 3600)).Format(time.RFC3339)
	default:
		return "yesterday"
	}
}

func (g *generator) finalizers() []string {
	var out []string
	if g.chance(0.5) {
		out = append(out, "example.com/keep")
	}
	if g.chance(0.4) {
		out = append(out, trackingKey)
	}
	return out
}

// resourceVersion draws the resourceVersion an update is sent with, given
// the stored one: the stored one, "0", empty, zero-padded, stale.
func (g *generator) resourceVersion(stored string) (string, string) {
	switch g.pick(6) {
	case 0:
		return "0", `"0"`
	case 1:
		return "", "empty"
	case 2:
		return "0" + stored, "zero-padded"
	case 3:
		n, _ := strconv.ParseUint(stored, 10, 64)
		return strconv.FormatUint(n-1, 10), "stale"
	default:
		return stored, "current"
	}
}

// next draws the next request of the sequence.
func (g *generator) next(ctx context.Context, step int) request {
	name := g.pods[g.pick(len(g.pods))]
	r := request{step: step, user: users[g.pick(len(users))], pod: name}
	stored := g.read(ctx, name)
	now := time.Now()
	if stored == nil {
		return g.create(r, now)
	}
	pods := func(c kubernetes.Interface) podClient { return c.CoreV1().Pods(g.ns) }
	switch g.pick(16) {
	case 0, 1, 2:
		pod := stored.DeepCopy()
		did := g.meta(&pod.ObjectMeta, now)
		rv, form := g.resourceVersion(stored.ResourceVersion)
		pod.ResourceVersion = rv
		r.what = fmt.Sprintf("PUT (resourceVersion %s %q): %s", form, rv, strings.Join(did, ", "))
		r.main = true
		r.op, r.stored, r.asked = "UPDATE", stored, pod
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).Update(ctx, pod, metav1.UpdateOptions{})
		}
	case 3, 4:
		patch, did := g.mergePatch(now)
		r.what = "merge patch " + did + ": " + string(patch)
		r.main = true
		r.op, r.stored, r.asked = "UPDATE", stored, patched(stored, func(raw []byte) ([]byte, error) { return jsonpatch.MergePatch(raw, patch) })
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
		}
	case 5:
		patch, did := g.mergePatch(now)
		r.what = "strategic merge patch " + did + ": " + string(patch)
		r.main = true
		r.op, r.stored, r.asked = "UPDATE", stored, patched(stored, func(raw []byte) ([]byte, error) {
			return strategicpatch.StrategicMergePatch(raw, patch, corev1.Pod{})
		})
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
		}
	case 6:
		patch := g.jsonPatch(stored, now)
		r.what = "JSON patch: " + string(patch)
		r.main = true
		r.op, r.stored, r.asked = "UPDATE", stored, patched(stored, func(raw []byte) ([]byte, error) {
			ops, err := jsonpatch.DecodePatch(patch)
			if err != nil {
				return nil, err
			}
			return ops.Apply(raw)
		})
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).Patch(ctx, name, types.JSONPatchType, patch, metav1.PatchOptions{})
		}
	case 7, 8:
		cfg, did := g.apply(name, now)
		manager, force := managers[g.pick(len(managers))], g.chance(0.5)
		r.what = fmt.Sprintf("apply by %s (force %t): %s", manager, force, did)
		r.main = true
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).Apply(ctx, cfg, metav1.ApplyOptions{FieldManager: manager, Force: force})
		}
	case 9, 10:
		pod := stored.DeepCopy()
		phase := []corev1.PodPhase{corev1.PodRunning, corev1.PodSucceeded, corev1.PodFailed}[g.pick(3)]
		pod.Status.Phase = phase
		r.what = fmt.Sprintf("pods/status: phase %s", phase)
		if g.chance(0.3) {
			did := g.meta(&pod.ObjectMeta, now)
			r.what += ", and " + strings.Join(did, ", ")
		}
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		}
	case 11:
		pod := stored.DeepCopy()
		pod.Spec.EphemeralContainers = append(pod.Spec.EphemeralContainers, corev1.EphemeralContainer{
			EphemeralContainerCommon: corev1.EphemeralContainerCommon{Name: fmt.Sprintf("debug-%d", len(pod.Spec.EphemeralContainers)), Image: "registry.example/debug:1",
				TerminationMessagePolicy: corev1.TerminationMessageReadFile, ImagePullPolicy: corev1.PullIfNotPresent}})
		did := g.meta(&pod.ObjectMeta, now)
		r.what = "pods/ephemeralcontainers, with " + strings.Join(did, ", ")
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return pods(c).UpdateEphemeralContainers(ctx, name, pod, metav1.UpdateOptions{})
		}
	case 12:
		binding := &corev1.Binding{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{"note": "bound"}},
			Target: corev1.ObjectReference{Kind: "Node", Name: "node-1"}}
		if g.chance(0.5) {
			binding.Annotations[[]string{intentKey, intentAtKey, parentAnnotation}[g.pick(3)]] = "scale-down"
		}
		r.what = fmt.Sprintf("pods/binding with annotations %v", binding.Annotations)
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return nil, pods(c).Bind(ctx, binding, metav1.CreateOptions{})
		}
	default:
		var grace *int64
		if g.chance(0.5) {
			grace = ptr.To[int64](0)
		}
		r.what = fmt.Sprintf("DELETE (grace %v, finalizers %v, node %q)", ptrString(grace), stored.Finalizers, stored.Spec.NodeName)
		r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
			return nil, pods(c).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: grace})
		}
	}
	return r
}

// podClient is the typed pods client of a namespace.
type podClient = interface {
	Update(context.Context, *corev1.Pod, metav1.UpdateOptions) (*corev1.Pod, error)
	UpdateStatus(context.Context, *corev1.Pod, metav1.UpdateOptions) (*corev1.Pod, error)
	UpdateEphemeralContainers(context.Context, string, *corev1.Pod, metav1.UpdateOptions) (*corev1.Pod, error)
	Patch(context.Context, string, types.PatchType, []byte, metav1.PatchOptions, ...string) (*corev1.Pod, error)
	Apply(context.Context, *corev1ac.PodApplyConfiguration, metav1.ApplyOptions) (*corev1.Pod, error)
	Bind(context.Context, *corev1.Binding, metav1.CreateOptions) error
	Delete(context.Context, string, metav1.DeleteOptions) error
	Create(context.Context, *corev1.Pod, metav1.CreateOptions) (*corev1.Pod, error)
}

func (g *generator) create(r request, now time.Time) request {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: g.ns, Name: r.pod},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "worker", Image: "registry.example/worker:1"}}},
	}
	pod.OwnerReferences = g.ownerRefs()
	did := []string{"owners " + describeRefs(pod.OwnerReferences)}
	if g.chance(0.6) {
		did = append(did, g.meta(&pod.ObjectMeta, now)...)
	}
	if g.chance(0.4) {
		// Bound at creation: its deletion is graceful, so the pod stays
		// terminating.
		pod.Spec.NodeName = "node-1"
		did = append(did, "on node-1")
	}
	r.what = "CREATE: " + strings.Join(did, ", ")
	r.op, r.asked, r.main = "CREATE", pod, true
	r.send = func(ctx context.Context, c kubernetes.Interface) (*corev1.Pod, error) {
		return c.CoreV1().Pods(g.ns).Create(ctx, pod, metav1.CreateOptions{})
	}
	return r
}

// mergePatch draws a patch of the pod's metadata, valid both as a JSON
// merge patch and as a strategic merge patch.
func (g *generator) mergePatch(now time.Time) ([]byte, string) {
	m := metav1.ObjectMeta{Labels: map[string]string{}, Annotations: map[string]string{}}
	did := g.meta(&m, now)
	patch := map[string]any{}
	labels, annotations := map[string]any{}, map[string]any{}
	for k, v := range m.Labels {
		labels[k] = v
	}
	for k, v := range m.Annotations {
		annotations[k] = v
	}
	// What a change removed, the patch removes (null), unless a later
	// change set it again.
	removed := map[string][]string{
		"identity removed": {"label " + parentUIDLabel, "label " + parentNameLabel, "annotation " + parentAnnotation},
		"intent removed":   {"annotation " + intentKey},
		"stamps removed":   {"annotation " + intentAtKey, "annotation " + intentByKey},
	}
	for _, d := range did {
		for _, key := range removed[d] {
			field, k, _ := strings.Cut(key, " ")
			if field == "label" {
				if _, set := m.Labels[k]; !set {
					labels[k] = nil
				}
			} else if _, set := m.Annotations[k]; !set {
				annotations[k] = nil
			}
		}
	}
	if len(labels) > 0 {
		patch["labels"] = labels
	}
	if len(annotations) > 0 {
		patch["annotations"] = annotations
	}
	if m.OwnerReferences != nil || slices.ContainsFunc(did, func(d string) bool { return strings.HasPrefix(d, "owners") }) {
		patch["ownerReferences"] = m.OwnerReferences
	}
	if m.Finalizers != nil || slices.ContainsFunc(did, func(d string) bool { return strings.HasPrefix(d, "finalizers") }) {
		patch["finalizers"] = m.Finalizers
	}
	raw, _ := json.Marshal(map[string]any{"metadata": patch})
	return raw, strings.Join(did, ", ")
}

// jsonPatch draws RFC 6902 operations on the pod's annotations, owners or
// finalizers, sometimes guarded by a test of its resourceVersion.
func (g *generator) jsonPatch(stored *corev1.Pod, now time.Time) []byte {
	type op struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value any    `json:"value,omitempty"`
	}
	var ops []op
	if g.chance(0.3) {
		rv, _ := g.resourceVersion(stored.ResourceVersion)
		ops = append(ops, op{Op: "test", Path: "/metadata/resourceVersion", Value: rv})
	}
	esc := func(k string) string { return strings.ReplaceAll(k, "/", "~1") }
	if stored.Annotations == nil {
		ops = append(ops, op{Op: "add", Path: "/metadata/annotations", Value: map[string]string{}})
	}
	for n := 1 + g.pick(2); n > 0; n-- {
		switch g.pick(6) {
		case 0:
			ops = append(ops, op{Op: "add", Path: "/metadata/annotations/" + esc(intentKey), Value: reasons[g.pick(len(reasons))]})
		case 1:
			ops = append(ops, op{Op: "remove", Path: "/metadata/annotations/" + esc(intentKey)})
		case 2:
			ops = append(ops, op{Op: "add", Path: "/metadata/annotations/" + esc(intentAtKey), Value: g.stamp(now)},
				op{Op: "add", Path: "/metadata/annotations/" + esc(intentByKey), Value: "mallory"})
		case 3:
			ops = append(ops, op{Op: "replace", Path: "/metadata/ownerReferences", Value: g.ownerRefs()})
		case 4:
			ops = append(ops, op{Op: "add", Path: "/metadata/finalizers", Value: g.finalizers()})
		default:
			ops = append(ops, op{Op: "add", Path: "/metadata/labels", Value: map[string]string{"app": "w"}})
		}
	}
	raw, _ := json.Marshal(ops)
	return raw
}

// apply draws a server-side apply configuration of the pod's metadata.
func (g *generator) apply(name string, now time.Time) (*corev1ac.PodApplyConfiguration, string) {
	m := metav1.ObjectMeta{}
	did := g.meta(&m, now)
	cfg := corev1ac.Pod(name, g.ns).WithLabels(m.Labels).WithAnnotations(m.Annotations)
	for _, ref := range m.OwnerReferences {
		cfg.WithOwnerReferences(metav1ac.OwnerReference().WithAPIVersion(ref.APIVersion).WithKind(ref.Kind).
			WithName(ref.Name).WithUID(ref.UID).WithController(ref.Controller != nil && *ref.Controller))
	}
	if len(m.Finalizers) > 0 {
		cfg.WithFinalizers(m.Finalizers...)
	}
	return cfg, strings.Join(did, ", ")
}

// patched returns the pod a patch asks for, applied to stored as the API
// server applies it; nil when it does not apply (the API server refuses
// it then, and the model is silent).
func patched(stored *corev1.Pod, apply func([]byte) ([]byte, error)) *corev1.Pod {
	raw, err := json.Marshal(stored)
	if err != nil {
		return nil
	}
	if raw, err = apply(raw); err != nil {
		return nil
	}
	var pod corev1.Pod
	if err := json.Unmarshal(raw, &pod); err != nil {
		return nil
	}
	return &pod
}

func describeRefs(refs []metav1.OwnerReference) string {
	parts := make([]string, 0, len(refs))
	for _, r := range refs {
		c := ""
		if r.Controller != nil && *r.Controller {
			c = "*"
		}
		parts = append(parts, fmt.Sprintf("%s%s %s/%s", c, r.APIVersion, r.Kind, r.Name[:min(len(r.Name), 8)]))
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func ptrString(p *int64) string {
	if p == nil {
		return "default"
	}
	return strconv.FormatInt(*p, 10)
}
