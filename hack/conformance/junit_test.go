package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// report is a JUnit report as e2e.test writes it: suite nodes, specs the
// filter left out, and specs that passed, failed and skipped at run time.
func report(cases ...string) []byte {
	return []byte(`<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="6"><testsuite name="Kubernetes e2e suite">
<testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="0"></testcase>
<testcase name="[It] [sig-storage] not selected" classname="Kubernetes e2e suite" status="skipped" time="0"><skipped message="skipped"></skipped></testcase>
` + strings.Join(cases, "\n") + `
</testsuite></testsuites>`)
}

const (
	passed  = `<testcase name="[It] [sig-apps] Deployment works [Conformance]" status="passed" time="12.5"></testcase>`
	pulled  = `<testcase name="[It] [sig-apps] StatefulSet rolls [Conformance]" status="failed" time="300"><failure message="timed out" type="failed">pod ss-0: ErrImagePull: Failed to pull image &#34;registry.k8s.io/e2e-test-images/nginx:1.27.0-2&#34;: no such host</failure></testcase>`
	skipped = `<testcase name="[It] [sig-scheduling] needs two nodes [Conformance]" status="skipped" time="0.1"><skipped message="skipped - Requires at least 2 nodes"></skipped></testcase>`
)

func TestParseJUnit(t *testing.T) {
	cases, err := parseJUnit(report(passed, pulled, skipped,
		`<testcase name="[It] [sig-node] Pods timed out [Conformance]" status="timedout" time="900"><failure message="">the spec timed out</failure></testcase>`))
	require.NoError(t, err)
	assert.Equal(t, []testCase{
		{Name: "[sig-apps] Deployment works [Conformance]", Status: "passed", Time: 12500 * time.Millisecond},
		{Name: "[sig-apps] StatefulSet rolls [Conformance]", Status: "failed", Message: "timed out", Time: 300 * time.Second,
			Detail: `pod ss-0: ErrImagePull: Failed to pull image "registry.k8s.io/e2e-test-images/nginx:1.27.0-2": no such host`},
		{Name: "[sig-scheduling] needs two nodes [Conformance]", Status: "skipped", Message: "skipped - Requires at least 2 nodes", Time: 100 * time.Millisecond},
		{Name: "[sig-node] Pods timed out [Conformance]", Status: "failed", Detail: "the spec timed out", Time: 900 * time.Second},
	}, cases, "suite nodes and specs left out by the filter are not tests; a timeout is a failure")
	assert.Equal(t, summary{run: 3, passed: 1, failed: 2, skipped: 1}, summarize(cases))

	_, err = parseJUnit([]byte("<testsuites><testsuite>"))
	assert.Error(t, err, "a truncated report")
}

func TestReason(t *testing.T) {
	tests := []struct {
		name string
		c    testCase
		want string
	}{
		{"image not built here", testCase{Status: "failed", Message: "timed out", Detail: `ErrImagePull: Failed to pull image "registry.k8s.io/e2e-test-images/nginx:1.27.0-2": no such host`},
			"needs registry.k8s.io/e2e-test-images/nginx:1.27.0-2, which is not built here"},
		{"first line", testCase{Status: "failed", Message: "Expected\n  <int>: 1\nto equal 2"}, "Expected"},
		{"no message", testCase{Status: "failed", Detail: "the spec timed out\nat line 3"}, "the spec timed out"},
		{"skip", testCase{Status: "skipped", Message: "skipped - Requires at least 2 nodes"}, "skipped - Requires at least 2 nodes"},
		{"long", testCase{Status: "failed", Message: strings.Repeat("x", 300)}, strings.Repeat("x", 200) + "…"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { assert.Equal(t, tt.want, reason(tt.c)) })
	}
}

func TestTableNamesWhatFailsOnlyWithTally(t *testing.T) {
	without, err := parseJUnit(report(passed, pulled, skipped))
	require.NoError(t, err)
	failed := strings.Replace(passed, `status="passed" time="12.5"></testcase>`, `status="failed" time="12.5"><failure message="boom"></failure></testcase>`, 1)
	with, err := parseJUnit(report(failed, pulled, skipped))
	require.NoError(t, err)
	results := []passResult{
		{name: "without", wall: 61 * time.Second, cases: without},
		{name: "with", wall: 75 * time.Second, cases: with, churn: "churn: 3 scale changes"},
	}
	assert.Equal(t, []string{"[sig-apps] Deployment works [Conformance]"}, failsOnlyWithTally(results))
	assert.Empty(t, failsOnlyWithTally(results[:1]))

	got := table(results, time.Date(2026, 12, 3, 9, 0, 0, 0, time.UTC))
	for _, want := range []string{
		"Kubernetes conformance tests on the one-node cluster, 2026-12-03",
		"| | without tally | with tally |",
		"| tests run | 2 | 2 |",
		"| passed | 1 | 0 |",
		"| failed | 1 | 2 |",
		"| skipped | 1 | 1 |",
		"| wall time | 1m1s | 1m15s |",
		"- [sig-apps] Deployment works [Conformance]\n  - without tally: passed\n  - with tally: failed (boom)\n",
		"  - with tally: failed (needs registry.k8s.io/e2e-test-images/nginx:1.27.0-2, which is not built here)",
		"  - without tally: skipped (skipped - Requires at least 2 nodes)",
		"With tally: churn: 3 scale changes",
		"Not run in either pass (skipped by name):\n\n- [sig-apps] ReplicationController should test the lifecycle of a ReplicationController: runs e2e-test-images/nginx",
	} {
		assert.Contains(t, got, want)
	}
}
