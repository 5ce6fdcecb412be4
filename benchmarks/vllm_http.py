"""The two things every launcher of vLLM's OpenAI server here needs, written once:
its Prometheus samples and stopping its whole process group (leaving nothing in
``/dev/shm``).

Used by ``benchmarks/vllm_storm.py`` and ``tests/vllm/openai_server.py``; both
start the server with ``start_new_session=True`` (its own process group: the
API server, the engine core and the worker)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from typing import Any

from benchmarks import devshm
from kvtierd_client import lease_beacon

SIGTERM_GRACE_S = 30.0  # for the server's whole group to exit after its SIGTERM
KILLED_GONE_S = 10.0  # for SIGKILLed processes to be gone (their mappings released)
GROUP_POLL_S = 0.05


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


def stop_server_group(
    proc: subprocess.Popen[Any],
    shm_before: frozenset[str] | None = None,
    grace: float = SIGTERM_GRACE_S,
) -> list[str]:
    """SIGTERM to the server, then up to ``grace`` seconds for its whole process
    group to exit on its own (the engine core and worker after the API server, then
    multiprocessing's resource tracker, which unlinks the shared memory they left);
    SIGKILL to whatever is left of it.

    ``shm_before``: ``devshm.entries()`` from before the server started; the
    multiprocessing segments and semaphores that appeared since and that no process
    holds are then removed (a SIGKILL of the group, its tracker included, left them:
    ~200 MB each) and their names returned. Either way the lease beacons of sessions
    whose owner died (the engine core's, killed) are swept, as the next beacon made
    on this machine would (``kvtierd_client.lease_beacon``)."""
    deadline = time.monotonic() + grace
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _wait_group_gone(proc.pid, deadline)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_group_gone(proc.pid, time.monotonic() + KILLED_GONE_S)
    lease_beacon.sweep_orphans(devshm.SHM)
    return devshm.remove_unheld_multiprocessing(shm_before) if shm_before is not None else []


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()  # after "pid (comm)"
        except OSError:  # exited meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(name))
    return members


def _wait_group_gone(pgid: int, deadline: float) -> None:
    """Until no live process is left in group ``pgid``, or ``deadline``
    (``time.monotonic()``). Polls: nothing signals that a group emptied."""
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(GROUP_POLL_S)
