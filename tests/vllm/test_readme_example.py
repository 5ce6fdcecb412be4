"""The vLLM guide's example starts as written (issue #16, item 2).

Scenario: the daemon config (written by the guide's shell block, run by ``sh``) and
the ``--kv-transfer-config`` JSON are read out of docs/guides/vllm.md (the fenced
blocks right after ``<!-- example: NAME -->``); only the socket path and the sizes
are replaced (a private socket, a budget and pool this machine can hold), every other
byte is the guide's, the fs root in the user's own data directory included.
``kvtierd --config`` and one OpenAI server (multiprocess) start with them and a
completion answers 200 with kvtierd's pool in use.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, daemon_command, eventually, wait_serving
from openai_server import OpenAIServer
from shm_leftovers import shm_tempdir
from vllm_e2e import BLOCK_KV_BYTES

from benchmarks.vllm_model import random_prompt
from kvtierd.util.units import parse_size
from kvtierd_client.client import Client

pytestmark = pytest.mark.engine  # runs vLLM engines: vLLM's CPU build (make test-vllm)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "vllm.md"
MARKER = re.compile(r"<!-- example: ([\w-]+) -->\n```\w*\n(.*?)\n```", re.DOTALL)
POOL_BYTES = 8 << 20  # 128 rows of 64 KiB


def readme_examples() -> dict[str, str]:
    """The marked fenced blocks of the vLLM guide by name."""
    return {name: body for name, body in MARKER.findall(GUIDE.read_text())}


def substitute(text: str, replacements: dict[str, str]) -> str:
    """``text`` with each old value replaced; each must occur exactly once, so a
    guide edit that renames or duplicates a value fails here instead of being
    silently tested with the guide's own (root-only or 16 GiB) value."""
    for old, new in replacements.items():
        assert text.count(old) == 1, f"vLLM guide example: {old!r} found {text.count(old)} times"
        text = text.replace(old, new)
    return text


def written_config(block: str, workdir: str) -> tuple[str, str]:
    """The daemon config the guide's shell block writes, run by ``sh`` in ``workdir``
    as a user whose data directory is ``workdir/data``; (its text, that fs root)."""
    data = os.path.join(workdir, "data")
    env = {"PATH": os.environ["PATH"], "HOME": workdir, "XDG_DATA_HOME": data}
    subprocess.run(["sh", "-eu", "-c", block], cwd=workdir, env=env, check=True, timeout=30)
    return Path(workdir, "kvtierd-vllm.toml").read_text(), os.path.join(data, "kvtierd", "fs")


def example_pair(socket_path: str, workdir: str) -> tuple[str, dict[str, object]]:
    """(daemon TOML, kv-transfer-config) of the guide with this test's socket and sizes
    (the fs root is the guide's: the user's own data directory, here in ``workdir``)."""
    examples = readme_examples()
    assert {"daemon-config", "kv-transfer-config"} <= examples.keys(), examples.keys()
    kv_text = examples["kv-transfer-config"]
    readme_kv = json.loads(kv_text)
    # both sides use the default socket (a directory of the user's own): named here only
    # to keep this test's daemon apart from any other on the machine
    assert "kvtierd_address" not in readme_kv["kv_connector_extra_config"], readme_kv
    assert "listen" not in examples["daemon-config"], examples["daemon-config"]
    readme_pool_bytes = readme_kv["kv_connector_extra_config"]["cpu_bytes_to_use"]
    daemon_text, fs_root = written_config(examples["daemon-config"], workdir)
    readme_budget = re.search(r'budget = "([^"]+)"', daemon_text)
    readme_capacity = re.search(r'capacity = "([^"]+)"', daemon_text)
    assert readme_budget and readme_capacity, daemon_text
    assert f'root = "{fs_root}"' in daemon_text, daemon_text  # per user, not a shared path
    # the budget rule the guide states, held by the guide's own numbers
    assert parse_size(readme_budget.group(1)) >= readme_pool_bytes, "budget < cpu_bytes_to_use"
    daemon = f'[server]\nlisten = ["unix://{socket_path}"]\n' + substitute(
        daemon_text,
        {
            f'"{readme_budget.group(1)}"': '"64MiB"',
            f'"{readme_capacity.group(1)}"': '"256MiB"',
        },
    )
    kv = json.loads(substitute(kv_text, {str(readme_pool_bytes): str(POOL_BYTES)}))
    kv["kv_connector_extra_config"]["kvtierd_address"] = "unix://" + socket_path  # type: ignore[index]
    return daemon, kv


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short: sun_path is 108 bytes
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def start_readme_daemon(workdir: str, config_text: str) -> DaemonProcess:
    """``kvtierd --config FILE`` as the guide runs it, plus a private shm directory
    and no metrics endpoint (other tests on this machine use the default port)."""
    config = os.path.join(workdir, "kvtierd-vllm.toml")
    Path(config).write_text(config_text)
    socket_path = re.search(r'"unix://([^"]+)"', config_text)
    assert socket_path, config_text
    shm_dir = shm_tempdir()
    log_path = os.path.join(workdir, "daemon.log")
    args = ["--config", config, "--shm-dir", shm_dir, "--metrics-address", ""]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(daemon_command(*args), stdout=log, stderr=subprocess.STDOUT)
    daemon = DaemonProcess(proc, socket_path.group(1), shm_dir, log_path, workdir)
    try:
        wait_serving(daemon)
    except BaseException:
        daemon.cleanup()
        raise
    return daemon


def test_the_readme_example_pair_starts_and_serves(tiny_model: Path, workdir: str) -> None:
    socket_path = os.path.join(workdir, "run", "kvtierd.sock")  # the daemon creates run/
    daemon_text, kv = example_pair(socket_path, workdir)
    daemon = start_readme_daemon(workdir, daemon_text)
    server = None
    try:
        server = OpenAIServer(tiny_model, kv)
        server.wait_ready()
        status, answer = server.complete(random_prompt(300, seed=16))
        assert status == 200, answer
        assert answer["choices"][0]["text"]
        with Client(daemon.address) as client:
            (pool,) = client.get_stats("").pools  # the server's pool, sized by the JSON
        assert pool.num_blocks == POOL_BYTES // BLOCK_KV_BYTES
        assert [t.tier for t in pool.tiers] == ["primary", "fs0"]  # the fs tier, unnamed
        with Client(daemon.address) as client:  # the stores complete after the answer
            eventually(
                lambda: client.get_stats(pool.name).pools[0].tiers[0].bytes_in > 0,
                30,
                "the completion's full blocks stored in the pool",
            )
    finally:
        if server is not None:
            server.stop()
        assert daemon.stop() == 0, daemon.log()
        daemon.cleanup()
