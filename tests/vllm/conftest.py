"""Fixtures of the vLLM plug-in tests: a tiny local Llama, a real kvtierd, real engines.

Run with ``make test-vllm``: every test in ``.venv-vllm`` (vLLM 0.32's CPU build; in-process
engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the OpenAI servers of ``openai_server.py`` run
without it, in vLLM's default multiprocess mode), then the tests without the ``engine`` marker
in ``.venv-vllm033`` (vLLM 0.33, which has no CPU build that runs models: ``engine_free.py``
drives the plug-in with its scheduler and connector worker). ``make test`` does not collect
this folder. Like every suite, the session ends with ``tests/conftest.py``'s check that it
left nothing in /dev/shm (``tests/shm_leftovers.py``): the OpenAI servers' process groups
are stopped whole, and what a kill of them leaves there is removed (``openai_server.py``).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for path in (REPO, REPO / "tests", HERE):  # benchmarks, daemon_harness, vllm_e2e
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from daemon_harness import DaemonProcess, start_daemon  # noqa: E402
from vllm_e2e import kv_transfer_config, shutdown_llm  # noqa: E402

from benchmarks.vllm_model import build_tiny_llama, llm_kwargs  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def kvtierd() -> Iterator[DaemonProcess]:
    """A real daemon on a fresh socket and shm directory, stopped cleanly after the test."""
    proc = start_daemon("--memory-budget", "512MiB")
    try:
        yield proc
        code = proc.stop()
        assert code == 0, f"daemon exited with {code}:\n{proc.log()}"
    finally:
        proc.cleanup()


@pytest.fixture
def make_llm(tiny_model: Path) -> Iterator[Callable[..., Any]]:
    """``make_llm(address, **extra_config)``: an in-process vLLM engine offloading to
    kvtierd; every engine is shut down at the end of the test."""
    from vllm import LLM

    engines: list[Any] = []

    def factory(address: str, **extra: Any) -> Any:
        llm = LLM(**llm_kwargs(tiny_model, kv_transfer_config(address, **extra)))
        engines.append(llm)
        return llm

    yield factory
    for llm in engines:
        shutdown_llm(llm)
    engines.clear()
    gc.collect()
