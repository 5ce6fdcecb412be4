"""The two things every launcher of vLLM's OpenAI server here needs, written once:
its Prometheus samples and stopping its whole process group.

Used by ``benchmarks/vllm_storm.py`` and ``tests/vllm/openai_server.py``; both
start the server with ``start_new_session=True`` (its own process group: the
API server, the engine core and the worker)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request

SIGTERM_GRACE_S = 30.0


def vllm_metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus samples at ``url``/metrics, keyed by ``name{labels}``
    minus the labels every sample carries (engine, model_name); samples that
    differ only in those are summed."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        key, _, value = line.rpartition(" ")
        key = re.sub(r'(engine|model_name)="[^"]*",?', "", key).replace(",}", "}")
        key = key.replace("{}", "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def stop_server_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server, up to :data:`SIGTERM_GRACE_S` for it to exit, then
    SIGKILL to its whole process group (engine core and worker too)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(SIGTERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
