# kvtierd developer entry points. Every target installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO  := proto/kvtier/v1/kvtier.proto
GENDIR := client/kvtierd_client/_proto
GEN    := $(GENDIR)/kvtier/v1/kvtier_pb2.py

.PHONY: install gen run test bench lint clean

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

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m benchmarks

lint: install
	$(BIN)/ruff check kvtierd client tests benchmarks
	$(BIN)/ruff format --check kvtierd client tests benchmarks

clean:
	rm -rf $(VENV) $(GENDIR) .pytest_cache .ruff_cache
