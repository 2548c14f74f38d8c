package contract

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestCheck: the invariants find each kind of violation in a history made
// by hand, and none in a history that keeps the contract.
func TestCheck(t *testing.T) {
	sentAt := time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)
	at := sentAt.Format(time.RFC3339)
	pool := withController(owners[0])
	job := withController(owners[7])
	identity := func(p *corev1.Pod) *corev1.Pod {
		p.Labels = map[string]string{parentUIDLabel: string(pool.UID), parentNameLabel: pool.Name}
		p.Annotations = map[string]string{parentAnnotation: "WorkerPool.example.tally.dev/pool-a"}
		return p
	}
	pod := func(rv string, change ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", UID: "u", ResourceVersion: rv, OwnerReferences: []metav1.OwnerReference{pool},
			Finalizers: []string{trackingKey}}}
		identity(p)
		for _, c := range change {
			c(p)
		}
		return p
	}
	marked := func(p *corev1.Pod) {
		p.Annotations[intentKey], p.Annotations[intentAtKey], p.Annotations[intentByKey] = "scale-down", at, "alice"
	}
	failed := func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }
	untracked := func(p *corev1.Pod) {
		p.OwnerReferences = []metav1.OwnerReference{job}
		p.Labels, p.Annotations = map[string]string{}, map[string]string{}
	}
	requests := map[string]sent{
		"1": {user: "alice", before: sentAt, after: sentAt.Add(time.Second), main: true},
		"2": {user: "alice", before: sentAt, after: sentAt.Add(time.Second), main: true},
		"3": {user: "bob", before: sentAt, after: sentAt.Add(time.Second), main: true},
		"4": {user: "alice", before: sentAt, after: sentAt.Add(time.Second), main: true},
		"6": {user: "alice", before: sentAt, after: sentAt.Add(time.Second), main: true},
		"7": {user: "bob", before: sentAt, after: sentAt.Add(time.Second), main: true},
		// pods/status, which the webhook is not called for.
		"10": {user: "alice", before: sentAt, after: sentAt.Add(time.Second)},
	}
	// Tally saw versions 1 to 4 and 6 on: 5 was stored while it did not.
	seen := &views{spans: []span{{from: 0, to: 4}, {from: 5, to: math.MaxUint64}}}
	forged := func(p *corev1.Pod) {
		p.Annotations[intentKey], p.Annotations[intentAtKey], p.Annotations[intentByKey] = "scale-down", "2001-01-01T00:00:00Z", "mallory"
	}
	bare := func(p *corev1.Pod) { p.Labels, p.Annotations = map[string]string{}, map[string]string{} }
	tests := []struct {
		name     string
		versions []*corev1.Pod
		want     []string
	}{
		{name: "created, marked, failed, deleted", versions: []*corev1.Pod{pod("1"), pod("2", marked), pod("3", marked, failed)}},
		{name: "an admitted intent removed", want: []string{"sticky", "sticky", "sticky"},
			versions: []*corev1.Pod{pod("1"), pod("2", marked), pod("3")}},
		{name: "-at forged", want: []string{"sticky", "stamps"},
			versions: []*corev1.Pod{pod("1"), pod("2", marked), pod("3", marked, func(p *corev1.Pod) { p.Annotations[intentAtKey] = "2001-01-01T00:00:00Z" })}},
		{name: "an intent first seen after the end", want: []string{"no intent after the end"},
			versions: []*corev1.Pod{pod("1"), pod("2", failed), pod("4", failed, marked)}},
		{name: "an intent carried in by a detour", want: []string{"no intent after the end"},
			versions: []*corev1.Pod{pod("1"), pod("2", failed),
				pod("3", failed, untracked, func(p *corev1.Pod) { p.Annotations[intentKey] = "scale-down" }),
				pod("4", failed, func(p *corev1.Pod) { marked(p); p.Annotations[intentByKey] = unobserved })}},
		{name: "identity forged", want: []string{"identity"},
			versions: []*corev1.Pod{pod("1", func(p *corev1.Pod) { p.Labels[parentUIDLabel] = "forged" })}},
		{name: "identity on an untracked pod", want: []string{"identity"},
			versions: []*corev1.Pod{pod("1", func(p *corev1.Pod) { p.OwnerReferences, p.Finalizers = []metav1.OwnerReference{job}, nil })}},
		{name: "stamps by someone else", want: []string{"stamps"},
			versions: []*corev1.Pod{pod("1"), pod("3", marked)}},
		{name: "stamps from no request", want: []string{"stamps"},
			versions: []*corev1.Pod{pod("1"), pod("9", marked)}},
		{name: "a tracked intent without stamps", want: []string{"stamps"},
			versions: []*corev1.Pod{pod("1"), pod("2", func(p *corev1.Pod) { p.Annotations[intentKey] = "drain" })}},
		{name: "the tracking finalizer missing at creation", want: []string{"tracking finalizer"},
			versions: []*corev1.Pod{pod("1", func(p *corev1.Pod) { p.Finalizers = nil })}},
		{name: "the tracking finalizer on an untracked pod", want: []string{"tracking finalizer"},
			versions: []*corev1.Pod{pod("1", untracked)}},
		{name: "the tracking finalizer added by an update", want: []string{"tracking finalizer"},
			versions: []*corev1.Pod{pod("1", func(p *corev1.Pod) { p.Finalizers = nil }, untracked), pod("2", untracked)}},
		{name: "what a client did while tally did not see the pod is not tally's, until tally had time to judge it", want: []string{"judged"},
			versions: []*corev1.Pod{pod("1"), pod("2", failed), pod("5", failed, bare, forged)}},
		{name: "a late intent outlasts tally's first sight", want: []string{"no intent after the end", "stamps"},
			versions: []*corev1.Pod{pod("1"), pod("2", failed), pod("5", failed, bare, forged), pod("6", failed, forged)}},
		{name: "forged stamps outlast tally's first sight", want: []string{"stamps"},
			versions: []*corev1.Pod{pod("1"), pod("5", bare, forged), pod("6", forged)}},
		{name: "the aggregator judges first: stamped as seen now by no one observed",
			versions: []*corev1.Pod{pod("1"), pod("5", bare, forged), pod("8", func(p *corev1.Pod) { marked(p); p.Annotations[intentByKey] = unobserved })}},
		{name: "an intent stamped as tally stamps, out of view, is taken as admitted",
			versions: []*corev1.Pod{pod("1"), pod("2", failed), pod("5", failed, forged), pod("6", failed, forged)}},
		{name: "a pod tally never judged again, when the sequence ends", want: []string{"judged"},
			versions: []*corev1.Pod{pod("1"), pod("5", bare, forged), pod("10", bare, forged, func(p *corev1.Pod) { p.Status.Phase = corev1.PodRunning })}},
		{name: "a change of a pod tally did not judge again is not checked",
			versions: []*corev1.Pod{pod("1"), pod("5", bare, forged), pod("10", bare, forged, func(p *corev1.Pod) { p.Status.Phase = corev1.PodRunning }),
				pod("7", forged)}, want: []string{"stamps"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := &history{views: seen, requests: requests, start: sentAt}
			for _, v := range tc.versions {
				h.versions = append(h.versions, version{pod: v})
			}
			var rules []string
			for _, v := range h.check() {
				rules = append(rules, v.rule)
			}
			assert.Equal(t, tc.want, rules, "%v", h.check())
		})
	}
}
