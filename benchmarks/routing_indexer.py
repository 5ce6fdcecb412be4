"""NVIDIA Dynamo's standalone KV indexer, run for real (``python -m dynamo.indexer``).

The indexer subscribes to every ZMQ endpoint of ``--workers`` (``instance[:dp_rank]=
endpoint``), decodes vLLM's KV events and answers ``POST /query {token_ids,
model_name}`` with, per instance, how many leading tokens it holds on its GPU
(``gpu``, from dp rank 0) and in its GPU or host memory (``cpu``) or anywhere,
disk included (``disk``): cumulative, ``disk >= cpu >= gpu``. :class:`Indexer` starts
it on a free loopback port, waits for ``/health`` and turns ``/query`` answers into
:class:`Holding` per instance, in blocks.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60.0
MODEL = "default"


@dataclass(frozen=True)
class Holding:
    """An instance's leading blocks of a query: on its GPU, in GPU or host memory, anywhere."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def version() -> str:
    """``dynamo.indexer <version of ai-dynamo-runtime>``."""
    return f"dynamo.indexer {importlib.metadata.version('ai-dynamo-runtime')}"


class Indexer:
    """One indexer process; ``workers`` maps ``"instance[:dp_rank]"`` to an endpoint."""

    def __init__(self, workers: dict[str, str], block_size: int) -> None:
        self.block_size = block_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = tempfile.mkdtemp(prefix="kvtb-indexer-")
        self.log_path = Path(self.directory, "indexer.log")
        spec = ",".join(f"{worker}={endpoint}" for worker, endpoint in workers.items())
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
             "--block-size", str(block_size), "--model-name", MODEL, "--workers", spec],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"},
        )  # fmt: skip
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dynamo.indexer exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        raise TimeoutError(f"dynamo.indexer did not answer /health in {START_TIMEOUT_S:.0f} s")

    def query(self, tokens: list[int]) -> dict[int, Holding]:
        """Per instance id, the leading blocks of ``tokens`` it holds (absent: none)."""
        body = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
        request = urllib.request.Request(
            self.url + "/query", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            found = json.loads(answer.read())
        size = self.block_size
        return {
            int(instance): Holding(
                gpu=int(held.get("gpu", 0)) // size,
                cpu=int(held.get("cpu", 0)) // size,
                disk=int(held.get("disk", 0)) // size,
            )
            for instance, held in (found.get("instances") or {}).items()
        }

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def warnings(self) -> list[str]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [line for line in text.splitlines() if " WARN " in line or " ERROR " in line]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
