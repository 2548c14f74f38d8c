# tally's build, test and demo entry points. Every tool is built from the Go
# module proxy into bin/; nothing is downloaded from anywhere else.

SHELL := /usr/bin/env bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

# Tool versions. A tool built from its own module under hack/ has the
# version that module's go.mod requires, read from there; the others are
# pinned here. No Go code names a version: the Makefile exports each
# tool's path (KUBEBUILDER_ASSETS, HELM, PROMTOOL, ...) to what it runs.
gomod_version = $(shell awk '$$1 == "$(2)" { print $$2 } $$1 == "require" && $$2 == "$(2)" { print $$3 }' hack/$(1)/go.mod)
KUBERNETES_VERSION := $(patsubst v%,%,$(call gomod_version,envtest,k8s.io/kubernetes))
HELM_VERSION := $(call gomod_version,helm,helm.sh/helm/v3)
PROMETHEUS_VERSION := $(call gomod_version,prometheus,github.com/prometheus/prometheus)
GORELEASER_VERSION := $(call gomod_version,goreleaser,github.com/goreleaser/goreleaser/v2)
SYFT_VERSION := $(call gomod_version,syft,github.com/anchore/syft)
KREW_VERSION := $(call gomod_version,krew,sigs.k8s.io/krew)
COSIGN_VERSION := $(call gomod_version,cosign,github.com/sigstore/cosign/v3)
ACTIONLINT_VERSION := $(call gomod_version,actionlint,github.com/rhysd/actionlint)
$(foreach v,KUBERNETES_VERSION HELM_VERSION PROMETHEUS_VERSION GORELEASER_VERSION SYFT_VERSION KREW_VERSION COSIGN_VERSION ACTIONLINT_VERSION,\
	$(if $($(v)),,$(error $(v): its module is not required in its hack/*/go.mod)))
STATICCHECK_VERSION := v0.8.2
CERT_MANAGER_VERSION := v1.21.2
PROMETHEUS_OPERATOR_VERSION := v0.85.0
KUBE_MAJOR := $(word 1,$(subst ., ,$(KUBERNETES_VERSION)))
KUBE_MINOR := $(word 2,$(subst ., ,$(KUBERNETES_VERSION)))

BIN := $(CURDIR)/bin
ENVTEST_DIR := $(BIN)/k8s/$(KUBERNETES_VERSION)
KUBE_APISERVER := $(ENVTEST_DIR)/kube-apiserver
ETCD := $(ENVTEST_DIR)/etcd
STATICCHECK := $(BIN)/staticcheck-$(STATICCHECK_VERSION)
HELM := $(BIN)/helm-$(HELM_VERSION)
CERT_MANAGER_CRDS := $(BIN)/cert-manager-crds-$(CERT_MANAGER_VERSION)
PROMTOOL := $(BIN)/promtool-$(PROMETHEUS_VERSION)
PROMETHEUS := $(BIN)/prometheus-$(PROMETHEUS_VERSION)
PROMETHEUS_OPERATOR_CRDS := $(BIN)/prometheus-operator-crds-$(PROMETHEUS_OPERATOR_VERSION)
GORELEASER := $(BIN)/goreleaser-$(GORELEASER_VERSION)
# goreleaser runs the command named syft: one folder per version.
SYFT := $(BIN)/syft-$(SYFT_VERSION)/syft
KREW := $(BIN)/krew-$(KREW_VERSION)
COSIGN := $(BIN)/cosign-$(COSIGN_VERSION)
ACTIONLINT := $(BIN)/actionlint-$(ACTIONLINT_VERSION)
KUBECTL := $(ENVTEST_DIR)/kubectl
NODE_BINARIES := $(addprefix $(ENVTEST_DIR)/,kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)

# The cluster (make cluster-up): state, kubeconfig and logs under
# CLUSTER_DIR; the images it imports, built like the tally image.
CLUSTER_DIR := $(CURDIR)/.cluster
GOARCH := $(shell go env GOARCH)
PAUSE_IMAGE := tally.local/pause:dev
OPERATOR_IMAGE := tally.local/workerpool-operator:dev
WORKER_IMAGE := tally.local/worker:dev
CLUSTER_IMAGES := $(BIN)/tally-image.tar $(BIN)/pause-image.tar $(BIN)/workerpool-operator-image.tar $(BIN)/worker-image.tar

# make conformance: Kubernetes' e2e.test and ginkgo, from the same release
# as kube-apiserver; agnhost and Debian's static busybox for the images the
# suite runs (built into CONFORMANCE_IMAGES); results in CONFORMANCE_DIR.
E2E_TEST := $(ENVTEST_DIR)/e2e.test
GINKGO := $(ENVTEST_DIR)/ginkgo
AGNHOST := $(ENVTEST_DIR)/agnhost
BUSYBOX := $(BIN)/busybox-static/bin/busybox
CONFORMANCE_IMAGES := $(BIN)/conformance-images
CONFORMANCE_DIR := $(CURDIR)/.conformance
CONFORMANCE_NODES ?= 4
CONFORMANCE_PASSES ?= without,with

export HELM
export CERT_MANAGER_CRDS
export PROMTOOL
export GORELEASER
export SYFT
export KREW
export COSIGN
export KUBECTL

export KUBEBUILDER_ASSETS := $(ENVTEST_DIR)

# The flags of every test tier. go vet runs in make lint with all its
# analyzers, so go test's own subset is off; test binaries are linked
# without DWARF (-w: stack traces and race reports keep their names and
# lines). Both took the -race build of make test's packages from 414 s to
# 336 s on two cores (2026-12-04, kube-apiserver's packages in the cache).
GO_TEST_FLAGS ?= -race -count=1 -timeout 30m -vet=off -ldflags=-w
FUZZ_TIME ?= 30s
BENCH_COUNT ?= 5
DEMO_DURATION ?= 60s

.PHONY: help
help: ## List the targets.
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build bin/webhook, bin/aggregator and bin/kubectl-tally.
	@echo ">> building bin/webhook, bin/aggregator and bin/kubectl-tally"
	go build -o $(BIN)/webhook ./cmd/webhook
	go build -o $(BIN)/aggregator ./cmd/aggregator
	go build -o $(BIN)/kubectl-tally ./cmd/kubectl-tally

.PHONY: image
image: ## Build the container image without a container engine: bin/tally-image.tar (OCI layout; docker load, kind load image-archive).
	@echo ">> building the image (linux/amd64 and linux/arm64) into $(BIN)/tally-image.tar"
	@mkdir -p $(BIN)
	go run ./hack/image --out $(BIN)/tally-image.tar $(if $(PROJECT_URL),--source "$(PROJECT_URL)")

.PHONY: push
push: ## Push the same image index to IMAGE=registry/repository:tag (credentials from the Docker config).
	@test -n "$(IMAGE)" || { echo "usage: make push IMAGE=registry/repository:tag"; exit 2; }
	go run ./hack/image --push $(IMAGE) $(if $(PROJECT_URL),--source "$(PROJECT_URL)")

.PHONY: envtest-assets
envtest-assets: $(KUBE_APISERVER) $(ETCD) ## Build kube-apiserver and etcd from source into bin/k8s/<version>.

# The version stamps a release build sets: clients (helm's kubeVersion check
# among them) read the server's version from /version.
kube_ldflags = -X k8s.io/component-base/version.gitVersion=v$(1) \
	-X k8s.io/component-base/version.gitMajor=$(word 1,$(subst ., ,$(1))) \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(1))) \
	-X k8s.io/component-base/version.gitTreeState=clean
KUBE_LDFLAGS := $(call kube_ldflags,$(KUBERNETES_VERSION))

$(KUBE_APISERVER):
	@echo ">> building kube-apiserver $(KUBERNETES_VERSION) from source (several minutes the first time)"
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && go build -ldflags '$(KUBE_LDFLAGS)' -o $@ k8s.io/kubernetes/cmd/kube-apiserver

# make test-compat: kube-apiserver of each older Kubernetes minor tally
# supports, each built from its own module under hack/compat/<minor> (its
# go.mod names the release), into bin/k8s/<version> beside the etcd that
# hack/envtest builds. The oldest is the one the README claims.
COMPAT_MINORS := $(sort $(notdir $(patsubst %/go.mod,%,$(wildcard hack/compat/*/go.mod))))
compat_version = $(patsubst v%,%,$(call gomod_version,compat/$(1),k8s.io/kubernetes))
COMPAT_VERSIONS := $(foreach m,$(COMPAT_MINORS),$(call compat_version,$(m)))
COMPAT_OLDEST := $(firstword $(COMPAT_VERSIONS))

define compat_assets
$(BIN)/k8s/$(2)/kube-apiserver:
	@echo ">> building kube-apiserver $(2) from source (several minutes the first time)"
	@mkdir -p $$(@D)
	cd hack/compat/$(1) && go build -ldflags '$(call kube_ldflags,$(2))' -o $$@ k8s.io/kubernetes/cmd/kube-apiserver

$(BIN)/k8s/$(2)/etcd: $(ETCD)
	@mkdir -p $$(@D)
	ln -sf ../$(KUBERNETES_VERSION)/etcd $$@
endef
$(foreach m,$(COMPAT_MINORS),$(eval $(call compat_assets,$(m),$(call compat_version,$(m)))))

$(ETCD):
	@echo ">> building etcd from source"
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && go build -o $@ ./etcd

$(NODE_BINARIES):
	@echo ">> building $(notdir $@) $(KUBERNETES_VERSION) from source"
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && go build -ldflags '$(KUBE_LDFLAGS)' -o $@ k8s.io/kubernetes/cmd/$(notdir $@)

$(E2E_TEST):
	@echo ">> building Kubernetes' e2e.test $(KUBERNETES_VERSION) from source"
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && go test -c -ldflags '$(KUBE_LDFLAGS)' -o $@ k8s.io/kubernetes/test/e2e

$(GINKGO):
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && go build -o $@ github.com/onsi/ginkgo/v2/ginkgo

$(AGNHOST):
	@mkdir -p $(ENVTEST_DIR)
	cd hack/envtest && CGO_ENABLED=0 go build -ldflags '-s -w' -o $@ k8s.io/kubernetes/test/images/agnhost

# Debian's statically linked busybox, for the suite's busybox image and the
# shell in its agnhost image.
$(BUSYBOX):
	@mkdir -p $(BIN)/busybox-static
	cd $(BIN)/busybox-static && { apt-get download busybox-static || { apt-get update && apt-get download busybox-static; }; } && \
		dpkg-deb -x busybox-static_*.deb . && rm busybox-static_*.deb
	@test -x $@

.PHONY: conformance-images
conformance-images: $(E2E_TEST) $(AGNHOST) $(BUSYBOX) ## Build the images Kubernetes' conformance tests run (agnhost, busybox, pause) into bin/conformance-images.
	@mkdir -p $(CONFORMANCE_IMAGES)
	CGO_ENABLED=0 go build -o $(CONFORMANCE_IMAGES)/pause ./hack/cluster/pause
	CGO_ENABLED=0 go build -o $(CONFORMANCE_IMAGES)/curl ./hack/conformance/curl
	go run ./hack/conformance images --e2e $(E2E_TEST) --agnhost $(AGNHOST) --busybox $(BUSYBOX) \
		--curl $(CONFORMANCE_IMAGES)/curl --pause $(CONFORMANCE_IMAGES)/pause --out $(CONFORMANCE_IMAGES)

.PHONY: kubectl
kubectl: $(BIN)/kubectl ## Build kubectl from the Go module proxy: bin/kubectl (for watching the demo, the Kopf example).

$(BIN)/kubectl: $(KUBECTL)
	ln -sf k8s/$(KUBERNETES_VERSION)/kubectl $@

.PHONY: cluster-binaries
cluster-binaries: envtest-assets $(NODE_BINARIES) ## Build the node's binaries (kubelet, kube-proxy, ...) beside kube-apiserver.

.PHONY: cluster-images
cluster-images: image ## Build the images the cluster imports: tally, pause, the WorkerPool example's operator and worker.
	go run ./hack/image --arch $(GOARCH) --cmd ./hack/cluster/pause --entrypoint /pause --tag $(PAUSE_IMAGE) --out $(BIN)/pause-image.tar
	go run ./hack/image --arch $(GOARCH) --cmd ./examples/workerpool/cmd/operator --entrypoint /operator --tag $(OPERATOR_IMAGE) --out $(BIN)/workerpool-operator-image.tar
	go run ./hack/image --arch $(GOARCH) --cmd ./examples/workerpool/cmd/worker --entrypoint /worker --tag $(WORKER_IMAGE) --out $(BIN)/worker-image.tar

CLUSTER := $(BIN)/cluster
CLUSTER_UP := $(CLUSTER) up --dir $(CLUSTER_DIR) --bin $(ENVTEST_DIR) --sandbox-image $(PAUSE_IMAGE) $(addprefix --load ,$(CLUSTER_IMAGES))
CLUSTER_DOWN := $(CLUSTER) down --dir $(CLUSTER_DIR) --check

.PHONY: $(CLUSTER)
$(CLUSTER): $(wildcard hack/cluster/*.go)
	go build -o $@ ./hack/cluster

# How many nodes make cluster-up starts; make e2e-cluster always starts two.
NODES ?= 1

.PHONY: cluster-up
cluster-up: $(CLUSTER) cluster-binaries cluster-images ## Start a cluster on this host (root, Linux; NODES=2 adds a node in a network namespace); kubeconfig: .cluster/admin.kubeconfig.
	$(CLUSTER_UP) --nodes $(NODES)

.PHONY: cluster-down
cluster-down: $(CLUSTER) ## Stop the cluster and restore the host (fails if anything is left).
	$(CLUSTER_DOWN)

.PHONY: conformance
conformance: $(CLUSTER) cluster-binaries cluster-images conformance-images $(HELM) $(GINKGO) ## On a one-node cluster: Kubernetes' conformance tests without tally, then with it installed and churning (root, Linux; 40 min on 2 cores); results in .conformance/results.md.
	@trap 'rc=$$?; $(CLUSTER_DOWN) || rc=1; exit $$rc' EXIT; \
	$(CLUSTER_UP) $$(for f in $(CONFORMANCE_IMAGES)/*.tar; do printf -- '--load %s ' $$f; done) && \
	go run ./hack/conformance run --cluster $(CLUSTER_DIR) --e2e $(E2E_TEST) --ginkgo $(GINKGO) --images $(CONFORMANCE_IMAGES) \
		--out $(CONFORMANCE_DIR) --nodes $(CONFORMANCE_NODES) --passes $(CONFORMANCE_PASSES)

# What make e2e-cluster builds before it starts the cluster.
E2E_CLUSTER_TOOLS := $(CLUSTER) cluster-binaries cluster-images $(HELM) $(PROMETHEUS) $(PROMETHEUS_OPERATOR_CRDS)

.PHONY: e2e-cluster-tools
e2e-cluster-tools: $(E2E_CLUSTER_TOOLS) ## Build what make e2e-cluster needs without starting the cluster.

.PHONY: e2e-cluster
e2e-cluster: $(E2E_CLUSTER_TOOLS) ## On a two-node cluster: install the chart for real, run the scenario on real pods, lose a node for good, drain the aggregator leader's node, then watch the alerts fire and clear on a real Prometheus; restores the host.
	@trap 'rc=$$?; $(CLUSTER_DOWN) || rc=1; exit $$rc' EXIT; \
	$(CLUSTER_UP) --nodes 2; \
	log=$$(mktemp); rc=0; \
	TALLY_CLUSTER_DIR=$(CLUSTER_DIR) TALLY_CLUSTER_BIN=$(CLUSTER) KUBECTL=$(KUBECTL) PROMETHEUS=$(PROMETHEUS) PROMETHEUS_OPERATOR_CRDS=$(PROMETHEUS_OPERATOR_CRDS) \
		go test ./test/cluster -count=1 -v -timeout 80m 2>&1 | tee $$log || rc=$$?; \
	if [ $$rc != 0 ]; then echo ">> what failed, repeated from above (the failures and their messages):"; \
		grep -E -A14 -- '--- FAIL|Error Trace:|^panic:' $$log | grep -v '^{"level"' | tail -200 || true; fi; \
	rm -f $$log; exit $$rc

# helm, built from source with the version stamps its release build sets.
HELM_LDFLAGS := -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$(KUBE_MAJOR) -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(KUBE_MINOR) \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$(KUBE_MAJOR) -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(KUBE_MINOR)

.PHONY: helm
helm: $(HELM) ## Build helm from source into bin/.

$(HELM):
	@echo ">> building helm $(HELM_VERSION) from source"
	cd hack/helm && go build -ldflags '$(HELM_LDFLAGS)' -o $@ helm.sh/helm/v3/cmd/helm

# promtool, which checks the chart's alerting rules and runs their unit tests,
# and the Prometheus server make e2e-cluster watches tally with (Kubernetes
# service discovery only, no UI assets); their version is the one
# hack/prometheus/go.mod requires. Both are built with the same tags, so
# they share their compiled packages: promtool only checks and tests rules,
# and without every other service discovery it built cold in 131 s instead
# of 284 s (2026-12-03, module cache full).
PROMETHEUS_TAGS := remove_all_sd,enable_kubernetes_sd
$(PROMTOOL): hack/prometheus/go.mod
	@echo ">> building promtool $(PROMETHEUS_VERSION) from source"
	cd hack/prometheus && go build -tags $(PROMETHEUS_TAGS) -o $@ github.com/prometheus/prometheus/cmd/promtool

$(PROMETHEUS): hack/prometheus/go.mod
	@echo ">> building prometheus $(PROMETHEUS_VERSION) from source"
	cd hack/prometheus && go build -tags $(PROMETHEUS_TAGS) -o $@ github.com/prometheus/prometheus/cmd/prometheus

# The Prometheus Operator's ServiceMonitor and PrometheusRule CRDs, taken
# from its Go module (manifests only): make e2e-cluster installs the chart's
# ServiceMonitor and PrometheusRule for real and reads them back.
$(PROMETHEUS_OPERATOR_CRDS):
	@echo ">> fetching the Prometheus Operator $(PROMETHEUS_OPERATOR_VERSION) CRDs from the Go module proxy"
	@dir=$$(go mod download -json github.com/prometheus-operator/prometheus-operator@$(PROMETHEUS_OPERATOR_VERSION) | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	test -n "$$dir" && mkdir -p $@.tmp && \
	cp $$dir/example/prometheus-operator-crd/monitoring.coreos.com_{servicemonitors,prometheusrules}.yaml $@.tmp/ && mv $@.tmp $@

# The release tools, each built from its own module under hack/ (the version
# its go.mod requires): goreleaser and syft make a release, cosign signs and
# attests it, krew installs its kubectl plugin in the release test,
# actionlint checks the workflows.
$(GORELEASER): hack/goreleaser/go.mod
	@echo ">> building goreleaser $(GORELEASER_VERSION) from source"
	cd hack/goreleaser && go build -o $@ github.com/goreleaser/goreleaser/v2

$(SYFT): hack/syft/go.mod
	@echo ">> building syft $(SYFT_VERSION) from source"
	cd hack/syft && go build -o $@ github.com/anchore/syft/cmd/syft

$(KREW): hack/krew/go.mod
	@echo ">> building krew $(KREW_VERSION) from source"
	cd hack/krew && go build -o $@ sigs.k8s.io/krew/cmd/krew

$(COSIGN): hack/cosign/go.mod
	@echo ">> building cosign $(COSIGN_VERSION) from source"
	cd hack/cosign && go build -o $@ github.com/sigstore/cosign/v3/cmd/cosign

$(ACTIONLINT): hack/actionlint/go.mod
	@echo ">> building actionlint $(ACTIONLINT_VERSION) from source"
	cd hack/actionlint && go build -o $@ github.com/rhysd/actionlint/cmd/actionlint

.PHONY: release-tools
release-tools: $(GORELEASER) $(SYFT) $(COSIGN) $(KREW) $(KUBECTL) $(HELM) ## Build what make release and its test use: goreleaser, syft, cosign, krew, kubectl, helm.

# A release: VERSION (x.y.z, the newest section of CHANGELOG.md), REGISTRY
# (where make publish pushes: the image to REGISTRY/tally, the chart to
# oci://REGISTRY/charts/tally), PROJECT_URL (the project's home page: the
# image's source label, the krew manifest's homepage), DOWNLOAD_URL (where
# the release's files are downloaded from: the krew manifest's archives)
# and, optionally, RUNBOOK_URL (the released chart's runbook URL for its
# alerts). No default names a registry or a home: a release says where it
# goes. COSIGN_KEY: cosign's private key (a file or KMS URI, its password in
# COSIGN_PASSWORD), no transparency log; empty: keyless, the release
# workflow's way. SNAPSHOT=true builds a tree that is not clean or not
# tagged v$(VERSION) (a trial, not a release). BUILDER_ID and INVOCATION_ID
# go into the provenance.
VERSION ?=
REGISTRY ?=
PROJECT_URL ?=
DOWNLOAD_URL ?=
RUNBOOK_URL ?=
COSIGN_KEY ?=
SNAPSHOT ?= false
BUILDER_ID ?= make-release:local
INVOCATION_ID ?=

.PHONY: release
release: $(GORELEASER) $(SYFT) $(COSIGN) $(HELM) ## Build a release into dist/: image and chart archives, kubectl-tally archives, SBOMs, krew manifest, static install manifest, provenance, signed checksums (VERSION=x.y.z REGISTRY=... PROJECT_URL=... DOWNLOAD_URL=... [COSIGN_KEY=...] [SNAPSHOT=true]).
	go run ./hack/release build --version "$(VERSION)" --registry "$(REGISTRY)" --project-url "$(PROJECT_URL)" --download-url "$(DOWNLOAD_URL)" --runbook-url "$(RUNBOOK_URL)" \
		--snapshot=$(SNAPSHOT) --builder-id "$(BUILDER_ID)" --invocation-id "$(INVOCATION_ID)" --cosign $(COSIGN) --cosign-key "$(COSIGN_KEY)" \
		--helm $(HELM) --goreleaser $(GORELEASER) --syft $(SYFT)

.PHONY: publish
publish: $(HELM) $(COSIGN) ## Push the release in dist/ to REGISTRY (the image, the chart with helm push), sign both and attest the provenance and SBOMs to the image ([COSIGN_KEY=...] PLAIN_HTTP=true for a local registry).
	go run ./hack/release publish --registry "$(REGISTRY)" --helm $(HELM) --cosign $(COSIGN) --cosign-key "$(COSIGN_KEY)" $(if $(filter true,$(PLAIN_HTTP)),--plain-http)

# cert-manager's CRDs, taken from its Go module (manifests only), for the
# server-side dry-run of the chart's Issuer and Certificate.
$(CERT_MANAGER_CRDS):
	@echo ">> fetching cert-manager $(CERT_MANAGER_VERSION) CRDs from the Go module proxy"
	@dir=$$(go mod download -json github.com/cert-manager/cert-manager@$(CERT_MANAGER_VERSION) | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	test -n "$$dir" && mkdir -p $@.tmp && cp $$dir/deploy/crds/*.yaml $@.tmp/ && mv $@.tmp $@

.PHONY: golden
golden: envtest-assets $(HELM) ## Regenerate the golden files: the chart's renderings, kubectl tally's outputs.
	UPDATE_GOLDEN=true go test ./test/chart -run "TestGolden|TestCertManagerManifests" -count=1
	UPDATE_GOLDEN=true go test ./test/kubectltally -count=1

# The test tiers. make test: unit tests, fuzz seed corpora, the envtest
# suites and the chart tests, with the tools they need (kube-apiserver,
# etcd, helm, cert-manager's CRDs), under -short: the long scenarios (tests
# that call framework.Long: real outages, leases, grace periods, scale)
# skip, naming make test-all. make test-release: the packages that
# need the image and release tools (the image, make release and publish,
# the alerts with promtool). make test-all: both, the long scenarios
# included, in one go test run. A
# test whose tool is not set skips, naming the target (fails under
# CI=true).
TEST_TOOLS := envtest-assets $(HELM) $(CERT_MANAGER_CRDS)
RELEASE_TEST_TOOLS := $(PROMTOOL) release-tools
RELEASE_TEST_PKGS := ./test/alerts ./test/image ./test/release

# make test-all runs the robustness suite's new seeds one after another for
# ROBUSTNESS_BUDGET (the last one started within it ends about a minute
# later); make robustness runs it for DURATION.
ROBUSTNESS_BUDGET ?= 6m

# make test runs TEST_P packages at a time: its suites mostly wait on
# their API servers, so four keep two cores busy (Go's default is one a
# core). test-all keeps the default: its long scenarios measure recoveries
# in seconds and flood the webhook.
TEST_P ?= 4

# The packages that run tally's binaries take them from here (built once,
# from this tree, before go test) rather than each linking its own.
TEST_BINARIES := $(BIN)/test

.PHONY: test-binaries
test-binaries:
	go build -o $(TEST_BINARIES)/ ./cmd/...

.PHONY: test
test: $(TEST_TOOLS) test-binaries ## Unit tests, fuzz seed corpora, envtest suites and chart tests, with -race and -short, TEST_P (4) packages at a time: the long scenarios run in make test-all (the release tier: make test-release).
	@echo ">> go test $(GO_TEST_FLAGS) -short -p $(TEST_P) on every package but $(RELEASE_TEST_PKGS)"
	TALLY_TEST_BINARIES=$(TEST_BINARIES) go test $(GO_TEST_FLAGS) -short -p $(TEST_P) $$(go list ./... | grep -vxF $(addprefix -e tally.dev/tally/,$(patsubst ./%,%,$(RELEASE_TEST_PKGS))))

.PHONY: test-release
test-release: $(TEST_TOOLS) $(RELEASE_TEST_TOOLS) ## The image, make release and make publish end to end, and the alerts' rule tests with promtool, with -race.
	go test $(GO_TEST_FLAGS) $(RELEASE_TEST_PKGS)

# make test-compat runs the suites that depend on the API server's
# semantics (admission and its match conditions, the chart's policies, the
# freshness barrier's consistent read and watch, finalizers; not the
# outage and fail-over suites) against kube-apiserver of each
# Kubernetes version in TEST_COMPAT_VERSIONS: by default every older minor
# under hack/compat, then the one make test runs. .ci/run runs the oldest
# (make test-compat-oldest).
COMPAT_TEST_PKGS := ./test/contract ./test/webhook ./test/completeness ./test/totals ./test/install
TEST_COMPAT_VERSIONS ?= $(COMPAT_VERSIONS) $(KUBERNETES_VERSION)

.PHONY: test-compat
test-compat: $(TEST_TOOLS) test-binaries $(foreach v,$(filter-out $(KUBERNETES_VERSION),$(TEST_COMPAT_VERSIONS)),$(BIN)/k8s/$(v)/kube-apiserver $(BIN)/k8s/$(v)/etcd) ## The API-dependent suites against each supported Kubernetes version (TEST_COMPAT_VERSIONS, default: $(COMPAT_VERSIONS) and $(KUBERNETES_VERSION)), with -race and -short.
	@for v in $(TEST_COMPAT_VERSIONS); do \
		echo ">> Kubernetes $$v: go test $(COMPAT_TEST_PKGS)"; \
		start=$$SECONDS; \
		KUBEBUILDER_ASSETS=$(BIN)/k8s/$$v TALLY_TEST_BINARIES=$(TEST_BINARIES) go test $(GO_TEST_FLAGS) -short -p $(TEST_P) $(COMPAT_TEST_PKGS) || exit 1; \
		echo ">> Kubernetes $$v: passed in $$((SECONDS - start)) s"; \
	done

.PHONY: test-compat-oldest
test-compat-oldest: ## make test-compat on the oldest supported Kubernetes alone ($(COMPAT_OLDEST)), as .ci/run does.
	$(MAKE) test-compat TEST_COMPAT_VERSIONS=$(COMPAT_OLDEST)

# TEST_ALL_SKIP leaves packages out of make test-all. .ci/run leaves out
# ./test/release, which make test-release runs before a release: it builds
# goreleaser, syft, cosign and krew from source, then a release
# cross-compiled for five platforms, about half an hour cold, which CI's
# time limit cannot hold beside the rest.
TEST_ALL_SKIP ?=

.PHONY: test-all-tools
test-all-tools: $(TEST_TOOLS) $(if $(filter ./test/release,$(TEST_ALL_SKIP)),$(PROMTOOL),$(RELEASE_TEST_TOOLS)) test-binaries ## Build what make test-all needs without running it.

.PHONY: test-all
test-all: test-all-tools ## make test with its long scenarios, and make test-release, in one go test run (TEST_ALL_SKIP: packages left out; the robustness suite runs new seeds for ROBUSTNESS_BUDGET).
	TALLY_TEST_BINARIES=$(TEST_BINARIES) TALLY_ROBUSTNESS_DURATION=$(ROBUSTNESS_BUDGET) go test $(GO_TEST_FLAGS) $(if $(TEST_ALL_SKIP),$$(go list ./... | grep -vxF $(addprefix -e tally.dev/tally/,$(patsubst ./%,%,$(TEST_ALL_SKIP)))),./...)

.PHONY: demo
demo: build envtest-assets $(HELM) $(if $(filter real,$(DEMO_CLUSTER)),$(CLUSTER) cluster-binaries cluster-images) ## Run tally on a local control plane and drive the scale-down scenario (DEMO_DURATION, default 60s; DEMO_CLUSTER=real: on a one-node cluster, root only).
	go build -o $(BIN)/tally-demo ./cmd/tally-demo
	@echo ">> running the demo (kubeconfig, certificates, logs and the plot of the run in .demo/; Ctrl-C stops it cleanly)"
	@if [ "$(DEMO_CLUSTER)" = real ]; then \
		trap 'rc=$$?; $(CLUSTER_DOWN) || rc=1; exit $$rc' EXIT; \
		$(CLUSTER_UP) && $(BIN)/tally-demo --duration $(DEMO_DURATION) --cluster $(CLUSTER_DIR); \
	else \
		$(BIN)/tally-demo --duration $(DEMO_DURATION); \
	fi

.PHONY: fuzz
fuzz: ## Fuzz the webhook's request path for FUZZ_TIME (default 30s) per target.
	@echo ">> fuzzing pkg/mutate for $(FUZZ_TIME) per target"
	go test ./pkg/mutate -run '^$$' -fuzz '^FuzzHandler$$' -fuzztime $(FUZZ_TIME) -fuzzminimizetime 1s
	go test ./pkg/mutate -run '^$$' -fuzz '^FuzzAppendString$$' -fuzztime $(FUZZ_TIME) -fuzzminimizetime 1s

# make fuzz-e2e: the end-to-end contract fuzzer (test/contract) against a
# real kube-apiserver with the chart's registration and policies,
# bin/webhook and bin/aggregator, the sequences changing what tally sees
# (namespace relabels, webhook outages under Ignore, configuration
# changes), for DURATION on seeds drawn from the clock; SEED=n runs one
# sequence again (a failing one prints its seed). make test runs its fixed
# seeds.
DURATION ?= 10m
SEED ?=

.PHONY: robustness
robustness: $(TEST_TOOLS) ## Two aggregator processes and the webhook under seeded random faults (cuts, broken, ended, trickling and throttled pod watches, late replays, throttled writes, steps of the API server clock, the leader killed or paused, stops of one or every replica, rollouts, the webhook down, pools deleted and created again, kube-apiserver and etcd restarts) over a churn of pods, the invariants checked on what the API server recorded: seeds one after another for DURATION (default 10m); SEED=n replays one.
	@echo ">> the robustness suite $(if $(SEED),on seed $(SEED),for $(DURATION))"
	TALLY_ROBUSTNESS_SEED=$(SEED) TALLY_ROBUSTNESS_DURATION=$(if $(SEED),,$(DURATION)) \
		go test ./test/robustness -run '^TestRobustness$$' -count=1 -v -timeout 24h

.PHONY: fuzz-e2e
fuzz-e2e: $(TEST_TOOLS) test-binaries ## Fuzz the pod metadata contract end to end for DURATION (default 10m) against a real API server; SEED=n replays one sequence.
	@echo ">> the contract fuzzer $(if $(SEED),on seed $(SEED),for $(DURATION))"
	TALLY_TEST_BINARIES=$(TEST_BINARIES) TALLY_CONTRACT_SEED=$(SEED) TALLY_CONTRACT_DURATION=$(if $(SEED),,$(DURATION)) \
		go test ./test/contract -run '^TestContract$$' -count=1 -v -timeout 24h

.PHONY: bench
bench: envtest-assets ## Run the benchmarks and the aggregator bench program (figures in docs/benchmarks.md).
	@echo ">> go test benchmarks (one core for the webhook, as the targets state)"
	go test ./pkg/mutate -run '^$$' -bench . -benchmem -cpu 1 -count $(BENCH_COUNT)
	go test ./pkg/aggregate/count -run '^$$' -bench . -benchmem -count $(BENCH_COUNT)
	@echo ">> aggregator against a real API server"
	go run ./test/bench
	@echo ">> backfill sweep over 10,000 pods"
	go run ./test/bench -scenario sweep
	@echo ">> the webhook over TLS, and pod creates through the API server with and without it"
	go run ./test/bench -scenario webhook
	@echo ">> the API requests the cumulative totals add per finished pod"
	go run ./test/bench -scenario totals
	@echo ">> a fresh install into 30,000 unstamped pods: counts before stamps"
	go run ./test/bench -scenario install -namespaces 10 -parents-per-namespace 30 -pods 100
	@echo ">> the uninstall hook's release of 10,000 tracked pods"
	go run ./test/bench -scenario uninstall

.PHONY: bench-scale
bench-scale: envtest-assets ## Count 150,000 pods (50 namespaces x 30 parents x 100) with tally's aggregator, 30,000 beside the conventional controller, then a fresh install into 150,000 unstamped pods (long: creating 150,000 pods alone takes 8 to 10 minutes; docs/benchmarks.md).
	go run ./test/bench -scenario scale -namespaces 50 -parents-per-namespace 30 -pods 100 -tally-only
	go run ./test/bench -scenario scale -namespaces 10 -parents-per-namespace 30 -pods 100
	go run ./test/bench -scenario install -namespaces 50 -parents-per-namespace 30 -pods 100

.PHONY: demo-picture
demo-picture: build envtest-assets $(HELM) ## Run the demo on a local control plane (seed 1) and keep the plot of the run as docs/demo.png, the README's picture.
	go build -o $(BIN)/tally-demo ./cmd/tally-demo
	$(BIN)/tally-demo --duration $(DEMO_DURATION) --seed 1
	cp .demo/demo.png docs/demo.png

.PHONY: lint
lint: $(STATICCHECK) $(ACTIONLINT) ## gofmt, go vet, staticcheck, actionlint, no test package in the product, no tracked file over 1 MiB outside testdata/.
	@echo ">> gofmt -l"
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	@echo ">> go vet"
	go vet ./...
	@echo ">> staticcheck"
	$(STATICCHECK) ./...
	@echo ">> the product imports no test package"
	@out=$$(go list -deps ./cmd/... ./internal/... ./pkg/... ./hack/... ./examples/... | grep '^tally.dev/tally/test' || true); \
		if [ -n "$$out" ]; then echo "imported by cmd, internal, pkg, hack or examples:"; echo "$$out"; exit 1; fi
	@echo ">> actionlint"
	$(ACTIONLINT) -no-color
	@echo ">> no tracked file over 1 MiB outside testdata/"
	@out=$$(git ls-files -z | xargs -0 stat -c '%s %n' 2>/dev/null | awk '$$1 > 1048576 && $$2 !~ /(^|\/)testdata\//'); \
		if [ -n "$$out" ]; then echo "tracked files over 1 MiB (bytes, path): build outputs belong in bin/ or dist/, large fixtures in a testdata/ that a test reads:"; echo "$$out"; exit 1; fi

$(STATICCHECK):
	@echo ">> building staticcheck $(STATICCHECK_VERSION)"
	@mkdir -p $(BIN)
	GOBIN=$(BIN) go install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(BIN)/staticcheck $@

.PHONY: clean
clean: ## Remove bin/ (including the control plane binaries), dist/ and the demo's and make conformance's outputs.
	rm -rf $(BIN) .demo dist .conformance
