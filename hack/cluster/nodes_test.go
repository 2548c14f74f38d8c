package main

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestBinary(t *testing.T) {
	for component, want := range map[string]string{
		"kubelet":        "kubelet",
		"kubelet-2":      "kubelet",
		"kube-proxy":     "kube-proxy",
		"kube-proxy-2":   "kube-proxy",
		"containerd-4":   "containerd",
		"kube-apiserver": "kube-apiserver",
	} {
		assert.Equal(t, want, binary(component), component)
	}
}

// TestNodesApart checks that no two nodes share a name, an address, a pod
// range, a link or a socket, and that only the first runs on the host.
func TestNodesApart(t *testing.T) {
	nodes := nodesOf(maxNodes)
	assert.Equal(t, node{n: 1, name: "tally-node", ip: "10.244.0.1", podCIDR: "10.244.0.0/24", gateway: "10.244.0.1"}, nodes[0])
	seen := map[string]int{}
	var ranges []netip.Prefix
	for _, nd := range nodes {
		for _, v := range []string{nd.name, nd.ip, nd.podCIDR, nd.socket(), nd.component("kubelet"), nd.cgroupRoot()} {
			seen[v]++
		}
		if nd.n > 1 {
			for _, v := range []string{nd.uplink, nd.hostIP} {
				seen[v]++
			}
			assert.Equal(t, nd.name, nd.netns, "a node's namespace is named after it")
			assert.LessOrEqual(t, len(nd.uplink), 15, "a link name has at most 15 bytes")
		}
		p, err := netip.ParsePrefix(nd.podCIDR)
		require.NoError(t, err)
		for _, q := range ranges {
			assert.False(t, p.Overlaps(q), "%s overlaps %s", p, q)
		}
		ranges = append(ranges, p)
		assert.True(t, p.Contains(netip.MustParseAddr(nd.gateway)), "node %d's gateway %s outside %s", nd.n, nd.gateway, p)
		if nd.n > 1 {
			assert.False(t, p.Contains(netip.MustParseAddr(nd.ip)), "node %d's address inside its pod range", nd.n)
		}
	}
	for v, n := range seen {
		assert.Equal(t, 1, n, "%q is used by %d nodes", v, n)
	}
}
