"""Fixtures of the SGLang backend's tests: SGLang's real HiCache classes, a real kvtierd.

Run with ``make test-sglang`` (``.venv-sglang``: SGLang 0.5.23 without its CUDA
dependencies, CPU torch); ``make test`` does not collect this folder. The import
hook of ``sglang_env`` is installed before anything imports SGLang. Like every suite, the
session ends with ``tests/conftest.py``'s check that it left nothing in /dev/shm
(``tests/shm_leftovers.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, REPO / "tests", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from daemon_harness import DaemonProcess, start_daemon  # noqa: E402

from benchmarks import sglang_env  # noqa: E402,F401  (the import hook, before SGLang)


@pytest.fixture
def kvtierd() -> Iterator[DaemonProcess]:
    """A real daemon of its own (primary tier only), stopped cleanly after the test."""
    proc = start_daemon("--memory-budget", "256MiB")
    try:
        yield proc
        code = proc.stop()
        assert code == 0, f"daemon exited with {code}:\n{proc.log()}"
    finally:
        proc.cleanup()
