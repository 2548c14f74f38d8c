//go:build tools

// Package compat keeps kube-apiserver's packages in this module's graph.
package compat

import _ "k8s.io/kubernetes/cmd/kube-apiserver/app"
