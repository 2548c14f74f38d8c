package aggregate

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"tally.dev/tally/pkg/aggregate/count"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// sweep is the state of one Sweep.
type sweep struct {
	*Backfill
	seen, unstamped, stamped int
	// released holds the pods whose tracking finalizer the sweep removed
	// (their kind keeps no totals), by controller.
	released map[types.UID]*releasedPods
	// inScope reports whether the pods of a namespace are stamped.
	inScope func(ns string) bool
	// refused are the namespaces of a fixed list whose pods the sweep was
	// refused to list.
	refused []string
}

func (s *sweep) run(ctx context.Context, read func()) error {
	var err error
	if s.inScope, err = s.scope(ctx); err != nil {
		return err
	}
	found, patches, err := s.read(ctx)
	if err != nil {
		return err
	}
	if len(s.refused) > 0 {
		// Of a namespace refused part-way (a phase not read), nothing
		// read is taken; what Unstamped held there is kept.
		for key, p := range found {
			if slices.Contains(s.refused, p.Namespace) {
				delete(found, key)
			}
		}
		maps.Copy(found, s.Unstamped.in(s.refused))
	}
	s.Unstamped.replace(found)
	var swept []string
	for _, ns := range s.namespaces() {
		if !slices.Contains(s.refused, ns) {
			swept = append(swept, ns)
		}
	}
	s.markSwept(swept)
	if read != nil {
		read()
	}

	if patches {
		if err := s.stampUnlabelled(ctx); err != nil {
			return err
		}
	}

	misstamped, err := s.pods.ByIndex(count.MisstampedIndex, count.MisstampedValue)
	if err != nil {
		return fmt.Errorf("listing misstamped pods: %w", err)
	}
	for _, obj := range misstamped {
		if ctx.Err() != nil {
			break
		}
		cached, ok := obj.(*count.Pod)
		if !ok || !s.inScope(cached.Namespace) {
			continue
		}
		pod := podMeta(cached.Namespace, cached.Name)
		if err := s.reader.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			if !apierrors.IsNotFound(err) {
				s.report(pod, fmt.Sprintf("reading the pod: %v", err))
			}
			continue
		}
		s.stamp(ctx, pod, "")
	}
	return ctx.Err()
}

// stampUnlabelled lists the unlabelled pods again and stamps those in scope,
// each decided again on what it is now; then it forgets the pods read that
// are no longer unlabelled and not cached: gone (or stamped by someone
// else, which the cache shows soon).
func (s *sweep) stampUnlabelled(ctx context.Context) error {
	listed := map[string]bool{}
	err := s.eachUnlabelled(ctx, "", func(pod *metav1.PartialObjectMetadata) error {
		key := pod.Namespace + "/" + pod.Name
		listed[key] = true
		if s.inScope(pod.Namespace) {
			s.stamp(ctx, pod, key)
		}
		return ctx.Err()
	})
	if err != nil {
		return err
	}
	for _, key := range s.Unstamped.Keys() {
		if !listed[key] {
			if _, exists, err := s.pods.GetByKey(key); err == nil && !exists {
				s.Unstamped.Forget(key, true)
			}
		}
	}
	return nil
}

// scope returns whether the pods of a namespace are to be stamped, from the
// namespaces the API server lists now.
func (s *sweep) scope(ctx context.Context) (func(string) bool, error) {
	if s.Namespaces == nil || s.Namespaces.Empty() {
		return func(string) bool { return true }, nil
	}
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NamespaceList"))
	if err := s.reader.List(ctx, list); err != nil {
		return nil, fmt.Errorf("listing namespaces (the sweep stamps only the pods of those the webhook's namespaceSelector selects): %w", err)
	}
	selected := make(map[string]bool, len(list.Items))
	for i := range list.Items {
		ns := &list.Items[i]
		// As the API server matches a namespaceSelector: the namespace's
		// labels, which always include kubernetes.io/metadata.name.
		if s.Namespaces.Matches(labels.Set(ns.Labels)) {
			selected[ns.Name] = true
		}
	}
	return func(ns string) bool { return selected[ns] }, nil
}

// read returns, by pod key, the unlabelled pods in scope that the webhook's
// rules stamp, as Unstamped holds them: reduced as the cache reduces pods,
// under the parent their stamp names; and whether any unlabelled pod in
// scope needs a patch at all. A pod's phase is not in its metadata: when
// there are pods to hold, the terminal ones are found by listing each
// terminal phase.
func (s *sweep) read(ctx context.Context) (map[string]*count.Pod, bool, error) {
	found := map[string]*count.Pod{}
	// marked holds the found pods that carry an intent: whether it counts
	// depends on their phase too (an intent first seen on a finished pod
	// is not admitted).
	marked := map[string]*mutate.PodMeta{}
	patches := false
	err := s.eachUnlabelled(ctx, "", func(pod *metav1.PartialObjectMetadata) error {
		if !s.inScope(pod.Namespace) {
			return nil
		}
		s.seen++
		meta := &mutate.PodMeta{Namespace: pod.Namespace, Labels: pod.Labels, Annotations: pod.Annotations, OwnerReferences: pod.OwnerReferences, DeletionTimestamp: pod.DeletionTimestamp}
		d := s.rules.Decide(ctx, mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, Now: time.Now()})
		patches = patches || len(d.Patch) > 0 || len(s.untrack(pod)) > 0 || d.Denied != "" || d.Unavailable != ""
		if d.Denied != "" || d.Unavailable != "" || d.Parent.UID == "" {
			return nil
		}
		parent := types.UID(count.Intern(string(d.Parent.UID)))
		p := &count.Pod{
			Meta:        count.Meta{Name: pod.Name, Namespace: count.Intern(pod.Namespace), UID: pod.UID, DeletionTimestamp: pod.DeletionTimestamp},
			ParentUID:   parent,
			Controller:  count.Controller{Kind: d.Parent.GroupKind, Name: count.Intern(d.Parent.Name), UID: parent},
			Unevaluated: true,
		}
		_, p.Intent = pod.Annotations[keys.CompletionIntent]
		key := pod.Namespace + "/" + pod.Name
		found[key] = p
		if p.Intent {
			marked[key] = meta
		}
		return ctx.Err()
	})
	if err != nil || len(found) == 0 {
		return found, patches, err
	}
	for _, phase := range []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed} {
		err := s.eachUnlabelled(ctx, "status.phase="+string(phase), func(pod *metav1.PartialObjectMetadata) error {
			if p, ok := found[pod.Namespace+"/"+pod.Name]; ok && p.UID == pod.UID {
				p.Phase = phase
			}
			return nil
		})
		if err != nil {
			return nil, false, err
		}
	}
	for key, meta := range marked {
		p := found[key]
		d := s.rules.Decide(ctx, mutate.Input{Operation: mutate.Update, Pod: meta, Old: meta, OldPhase: p.Phase, Now: time.Now()})
		p.Intent = d.Dropped == ""
	}
	return found, patches, nil
}

// eachUnlabelled calls fn for each pod without the keys.ParentUID label
// matching fieldSelector ("" for all), in every namespace or in each of
// within, listing metadata a page at a time.
func (s *sweep) eachUnlabelled(ctx context.Context, fieldSelector string, fn func(*metav1.PartialObjectMetadata) error) error {
	opts := []client.ListOption{client.MatchingLabelsSelector{Selector: unlabelled}, client.Limit(BackfillPageSize)}
	if fieldSelector != "" {
		sel, err := fields.ParseSelector(fieldSelector)
		if err != nil {
			return err
		}
		opts = append(opts, client.MatchingFieldsSelector{Selector: sel})
	}
	for _, ns := range s.namespaces() {
		if slices.Contains(s.refused, ns) {
			continue
		}
		err := eachPage(ctx, s.reader, append(slices.Clone(opts), client.InNamespace(ns)), fn)
		if apierrors.IsForbidden(err) && ns != metav1.NamespaceAll {
			// One namespace of a fixed list refused (its Role missing):
			// the others are swept.
			s.refuse(ns, err)
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// namespaces returns the namespaces whose pods the sweep lists: [""] for
// every namespace.
func (s *sweep) namespaces() []string {
	if len(s.within) == 0 {
		return []string{metav1.NamespaceAll}
	}
	return s.within
}

// refuse records that the pods of namespace ns could not be listed, and
// logs it once per sweep.
func (s *sweep) refuse(ns string, err error) {
	if slices.Contains(s.refused, ns) {
		return
	}
	s.refused = append(s.refused, ns)
	s.log.Error(err, "Backfill sweep may not list the pods of a namespace tally works in (is its Role missing?); the other namespaces are swept", "namespace", ns)
}

// eachPage calls fn for each pod metadata that reader lists with opts, a
// page at a time.
func eachPage(ctx context.Context, reader client.Reader, opts []client.ListOption, fn func(*metav1.PartialObjectMetadata) error) error {
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(podListGVK)
	for n := len(opts); ; {
		if err := reader.List(ctx, list, opts...); err != nil {
			return fmt.Errorf("listing pods without %s: %w", keys.ParentUID, err)
		}
		for i := range list.Items {
			if err := fn(&list.Items[i]); err != nil {
				return err
			}
		}
		if list.Continue == "" {
			return nil
		}
		opts = append(opts[:n], client.Continue(list.Continue))
	}
}
