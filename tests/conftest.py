from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):  # benchmarks (devshm), then the harnesses
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# tests/vllm needs vLLM (`make test-vllm` builds .venv-vllm for it), tests/sglang SGLang
# (`make test-sglang`, .venv-sglang), tests/dynamo Dynamo's indexer (`make test-dynamo`,
# .venv-dynamo); elsewhere a bare `pytest` leaves them out instead of failing on the import
collect_ignore: list[str] = []
# (Dynamo's ``dynamo`` is itself a namespace package: its indexer module is looked for)
for _folder, _module in (("vllm", "vllm"), ("sglang", "sglang"), ("dynamo", "dynamo.indexer")):
    _spec = importlib.util.find_spec(_module)
    if _spec is None or _spec.origin is None:  # origin None: only tests/<engine>, a namespace
        collect_ignore.append(_folder)

from daemon_harness import DaemonProcess, start_daemon  # noqa: E402

# the check that a run left nothing in /dev/shm: its hooks end every suite's session
from shm_leftovers import pytest_sessionfinish, pytest_sessionstart  # noqa: E402, F401

_pool_counter = itertools.count()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """One real daemon per test module (tests use distinct pool names)."""
    proc = start_daemon("--memory-budget", "256MiB", "--lease", "2s", "--write-quarantine", "1s")
    try:
        yield proc
        code = proc.stop()
        assert code == 0, f"daemon exited with {code}:\n{proc.log()}"
        # memory.warm_restart keeps each region with its journal, nothing else
        left = proc.region_files()
        regions = {name.removesuffix(".region") for name in left if name.endswith(".region")}
        journals = {name.removesuffix(".journal") for name in left if name.endswith(".journal")}
        assert regions == journals and len(left) == 2 * len(regions), (
            f"files left after shutdown other than region + journal pairs: {left}"
        )
    finally:
        proc.cleanup()


@pytest.fixture
def pool_name(request: pytest.FixtureRequest) -> str:
    """A pool name unique to this test."""
    name = re.sub(r"[^A-Za-z0-9._:/-]", "_", request.node.name)[:80]
    return f"test/{name}/{next(_pool_counter)}"


# the redis tier's tests start real redis-server processes (tests/redis_harness.py)
from redis_harness import (  # noqa: E402, F401
    redis_cluster,
    redis_cluster_factory,
    redis_factory,
    redis_server,
)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A new directory with a short path for a test's Unix sockets (removed after):
    ``sun_path`` holds 107 bytes, and the daemon binds a longer temporary name first,
    which pytest's ``tmp_path`` (longer still under pytest-xdist) may not leave room for."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
