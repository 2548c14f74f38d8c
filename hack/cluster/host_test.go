package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestHostDiff(t *testing.T) {
	before := &host{
		Sysctls:  map[string]string{"net.ipv4.ip_forward": "0", "vm.overcommit_memory": "0"},
		NFTables: []string{"inet filter"},
		Links:    []string{"eth0", "lo"},
		Cgroups:  []string{"memory/system"},
		Netns:    []string{},
	}
	for _, tc := range []struct {
		name string
		now  func(h host) host
		want []string
	}{
		{"same", func(h host) host { return h }, nil},
		{"sysctl changed", func(h host) host {
			h.Sysctls = map[string]string{"net.ipv4.ip_forward": "1", "vm.overcommit_memory": "0"}
			return h
		}, []string{`sysctl net.ipv4.ip_forward = "1", was "0"`}},
		{"bridge and table left", func(h host) host {
			h.Links = []string{"eth0", "lo", "tally0"}
			h.NFTables = []string{"inet filter", "ip kube-proxy"}
			return h
		}, []string{`link "tally0" added`, `nftables table "ip kube-proxy" added`}},
		{"cgroup left, netns left", func(h host) host {
			h.Cgroups = []string{"memory/kubepods", "memory/system"}
			h.Netns = []string{"cni-1234"}
			return h
		}, []string{`cgroup "memory/kubepods" added`, `network namespace "cni-1234" added`}},
		{"something removed", func(h host) host {
			h.Links = []string{"lo"}
			return h
		}, []string{`link "eth0" removed`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := tc.now(*before)
			assert.Equal(t, tc.want, before.diff(&now))
		})
	}
}

func TestUnescapeMount(t *testing.T) {
	assert.Equal(t, "/run/a b/c\\d", unescapeMount(`/run/a\040b/c\134d`))
}
