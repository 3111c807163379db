# etcd-snapcache. `make run` starts it in front of an embedded etcd;
# `make test` runs every test (what CI runs); `make bench` measures it
# beside etcd.

GO        ?= go
BIN       := bin/etcd-snapcache
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X main.version=$(VERSION)
# Extra flags for `make run`, e.g. RUN_FLAGS='--endpoints=127.0.0.1:2379'.
RUN_FLAGS ?=
# Test timeout; the suite takes a few minutes on 2 cores.
TEST_TIMEOUT ?= 20m
BENCH        ?= .
BENCHTIME    ?= 2s
# Flags of the process-level benchmarks, e.g.
# BENCH_E2E_FLAGS='-snapcache.e2e.keys=10000 -snapcache.e2e.revisions=20000'.
BENCH_E2E_FLAGS ?=
# Build tags of vet and the tests: snapcachetest builds the test hooks that
# no binary may contain (revtree's CorruptForTest), and the tests that use
# them.
TEST_TAGS    ?= snapcachetest

.PHONY: all build run test vet bench bench-e2e bench-chart kubeload clean tools tools-etcd tools-kube integration integration-clients integration-e2e integration-budget

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/etcd-snapcache

run: build
	./$(BIN) serve $(RUN_FLAGS)

vet:
	$(GO) vet -tags '$(TEST_TAGS)' ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }

# Every test, with the race detector, against real (embedded) etcd; then
# etcd's robustness validators over traffic recorded through the proxy (a
# nested module: go.etcd.io/etcd/tests/v3 stays out of the main module).
test: vet
	$(GO) test -race -tags '$(TEST_TAGS)' -count=1 -timeout $(TEST_TIMEOUT) ./...
	cd integration/robustness && $(GO) vet -tags '$(TEST_TAGS)' ./... && $(GO) test -race -tags '$(TEST_TAGS)' -count=1 -timeout 10m ./...
	cd bench/kubeload && $(GO) vet ./... && $(GO) test -count=1 ./...

# etcd, etcdctl and kube-apiserver, built from the Go module proxy into
# .tools/bin; rebuilt only when tools/*/go.mod or go.sum, the flags or the Go
# version change.
tools: tools-etcd tools-kube

tools-etcd:
	tools/build.sh etcd

tools-kube:
	tools/build.sh kube

# End-to-end suites with real clients as separate processes: a script of
# etcdctl commands against etcd and against the proxy, and an unmodified
# kube-apiserver using the proxy (watch cache off and on).
integration: integration-clients integration-e2e integration-budget

integration-clients: build tools
	cd integration/clients && $(GO) vet ./... && $(GO) test -count=1 -timeout 30m ./...

# etcd's own e2e tests (go.etcd.io/etcd/tests/v3, cluster_proxy mode) with
# etcd-snapcache started by the framework's unmodified `etcd grpc-proxy start`
# command lines (integration/e2e, its own module; about 16 minutes on 2
# cores, etcd's whole common package most of it).
integration-e2e: build tools-etcd
	cd integration/e2e && $(GO) vet -tags cluster_proxy ./... && ./run.sh

# The history budget under 10^5 revisions by concurrent writers (make test
# runs the same test with 10^4, under the race detector): reads below the
# floor and watches from below it, compared with etcd's (about a minute).
integration-budget:
	$(GO) test -tags '$(TEST_TAGS)' -count=1 -timeout 10m -run '^TestHistoryBudget$$' ./integration/ -args -snapcache.budget.revisions=100000

# Benchmarks: the store alone, and the proxy beside direct etcd in one run.
bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -benchtime $(BENCHTIME) -timeout 60m ./revtree/ ./integration/

# Process-level benchmarks (bench/e2e): etcd (built by tools/build.sh), the
# proxy (bin/etcd-snapcache) and the load generator as three processes:
# linearizable Get, watch fan-out, paginated LIST, historical Range and
# (with `make tools-kube`) kube-apiserver LISTs, each proxy vs etcd in
# alternating rounds (SUMMARY lines; bench/e2e/doc.go), e.g.
# `make bench-e2e BENCH='Linearizable|Watch|Paginated|Historical' BENCHTIME=1x`,
# with auth on: BENCH_E2E_FLAGS=-snapcache.e2e.auth; with mTLS on every hop
# (etcd and the proxy serving it with --client-cert-auth, the proxy, the load
# and kube-apiserver presenting client certificates; ControlPlane's too):
# BENCH_E2E_FLAGS=-snapcache.e2e.tls, whose SUMMARY lines name the benchmark
# with /tls (both flags may be given). BenchmarkHistoryMemory
# (the proxy in the benchmark's process) reports the proxy's heap per
# retained revision and its heap under a history budget (a few minutes).
# BenchmarkQuietCluster (`make bench-e2e BENCH=QuietCluster BENCHTIME=1x`,
# about 5 minutes) reports what the proxy costs a quiet cluster: its CPU
# idle, per write followed, per idle watch stream (200 and 2,000), and with
# streams and puts, beside etcd's direct.
# BenchmarkKeyspaceMemory (the proxy as a process, default flags) reports
# its live heap per key and its peak resident memory during a cold load,
# with and without the soft memory limit, e.g. `make bench-e2e
# BENCH=KeyspaceMemory BENCHTIME=1x BENCH_E2E_FLAGS=-snapcache.e2e.keyspace-keys=100000,1000000`.
# BenchmarkControlPlane (`make bench-e2e BENCH=ControlPlane`, which builds
# kube-apiserver too) runs 3 kube-apiservers with their watch caches on in
# front of etcd and in front of the proxy, under a kube-shaped client-go load
# (bin/kubeload): start storm, steady state, restarts (about 15 minutes at
# its default 100k objects; a smoke run: BENCH_E2E_FLAGS='-snapcache.e2e.cp-objects=5000
# -snapcache.e2e.cp-apiservers=2 -snapcache.e2e.cp-steady=20s -snapcache.e2e.cp-settle=5s').
# Its maintenance phases run on a 3-member etcd under the steady load, both
# sides: BENCH_E2E_FLAGS=-snapcache.e2e.cp-phases=steady,rolling-restart,defrag,move-leader,hung-leader,hung-watch-member,lost-member,cut-connection
# (any subset, in any order; -snapcache.e2e.cp-etcd-members sets the members).
BENCH_TIMEOUT ?= 60m
bench-e2e: build tools-etcd kubeload $(if $(findstring ControlPlane,$(BENCH)),tools-kube)
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -count=1 -timeout $(BENCH_TIMEOUT) ./bench/e2e/ -args $(BENCH_E2E_FLAGS)

# BenchmarkControlPlane's load generator: client-go clients of kube-apiserver
# (bench/kubeload, a module of its own, so that client-go stays out of the
# main module).
kubeload:
	cd bench/kubeload && $(GO) build -mod=readonly -o ../../bin/kubeload .

# The chart of docs/performance.md from a bench-e2e run's output, e.g.
# `make bench-e2e | tee bench.out && make bench-chart BENCH_OUT=bench.out`.
BENCH_OUT ?= bench.out
bench-chart:
	$(GO) run ./bench/chart < $(BENCH_OUT) > docs/performance.svg

clean:
	rm -rf bin .snapcache
