"""Engines sharing one kvtierd, across engine processes and daemon restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import eventually, start_daemon
from vllm_e2e import TOKENS_PER_BLOCK, generate, manager_of, pool_stats, shutdown_llm, tier

from benchmarks.vllm_model import random_prompt
from kvtierd_client.client import Client
from kvtierd_client.errors import Unavailable

pytestmark = pytest.mark.engine  # runs vLLM engines: vLLM's CPU build (make test-vllm)

PROMPT_TOKENS = 1100
FULL_BLOCKS = PROMPT_TOKENS // TOKENS_PER_BLOCK  # 8
ENGINE_RUN = Path(__file__).resolve().parent / "engine_run.py"


def run_engine_process(model: Path, address: str, prompt: list[int]) -> dict[str, Any]:
    """Runs one engine in a fresh Python process; returns what engine_run.py printed."""
    args = json.dumps({"model": str(model), "address": address, "prompt": prompt})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, str(ENGINE_RUN), args],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"engine process failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_a_second_engine_process_hits_the_blocks_the_first_stored(kvtierd, tiny_model):
    prompt = random_prompt(PROMPT_TOKENS, seed=3)
    first = run_engine_process(tiny_model, kvtierd.address, prompt)
    assert first["cached"] == 0
    assert first["lookups"].get("hit", 0) == 0
    assert tier(pool_stats(kvtierd.address, first["pool"]), "primary").used_blocks == FULL_BLOCKS

    second = run_engine_process(tiny_model, kvtierd.address, prompt)
    assert second["pool"] == first["pool"]  # same model and layout: same pool
    assert second["lookups"]["hit"] == FULL_BLOCKS  # its very first run
    assert second["cached"] == FULL_BLOCKS * TOKENS_PER_BLOCK
    assert second["tokens"] == first["tokens"]


def stored_keys(address: str, pool: str) -> list[bytes]:
    """The keys of the pool's primary store events."""
    keys: list[bytes] = []
    with Client(address) as client:
        last = client.get_stats(pool).pools[0].last_event_seq
        with client.watch_events(pool, after_seq=0, timeout=10) as stream:
            for event in stream:
                if event.tier in ("", "primary") and not event.removed:
                    keys.extend(event.keys)
                if event.seq >= last:
                    break
    return keys


def fs_daemon(root: Path) -> Any:
    config = f'[[tiers]]\ntype = "fs"\nroot = "{root}"\ncapacity = "1GiB"\n'
    return start_daemon("--memory-budget", "512MiB", config=config)


def test_fs_tier_serves_after_a_daemon_restart_and_drops_corrupted_blocks(make_llm, tmp_path):
    root = tmp_path / "fs"
    root.mkdir()
    prompt = random_prompt(PROMPT_TOKENS, seed=4)

    daemon = fs_daemon(root)
    try:
        llm = make_llm(daemon.address)
        cold, _ = generate(llm, prompt)
        pool = manager_of(llm).pool_name
        eventually(
            lambda: tier(pool_stats(daemon.address, pool), "fs0").used_blocks == FULL_BLOCKS,
            20, "the prompt's blocks written to the fs tier", interval=0.1,
        )  # fmt: skip
        keys = stored_keys(daemon.address, pool)
        shutdown_llm(llm)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert len(keys) == FULL_BLOCKS

    # a restarted daemon (empty primary) promotes the blocks from the fs tier
    daemon = fs_daemon(root)
    try:
        llm = make_llm(daemon.address)
        warm, cached = generate(llm, prompt)
        lookups = manager_of(llm).counters.lookups
        fs = tier(pool_stats(daemon.address, pool), "fs0")
        shutdown_llm(llm)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert warm == cold
    assert cached == FULL_BLOCKS * TOKENS_PER_BLOCK
    assert lookups["hit_pending"] >= 1 and lookups["hit"] >= FULL_BLOCKS  # promoted, then HIT
    assert fs.hits >= FULL_BLOCKS

    # flip one payload byte of one block's file: that block is a miss (checksum), the
    # blocks before it in the prompt load, it and the ones after it are recomputed
    (path,) = root.rglob(keys[-1].hex() + ".kvb")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    daemon = fs_daemon(root)
    try:
        llm = make_llm(daemon.address)
        again, cached = generate(llm, prompt)
        fs = tier(pool_stats(daemon.address, pool), "fs0")
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert again == cold
    assert cached < FULL_BLOCKS * TOKENS_PER_BLOCK and cached % TOKENS_PER_BLOCK == 0
    assert fs.failures >= 1


def test_a_daemon_restart_turns_into_misses_then_the_new_daemon_serves(make_llm, tmp_path):
    """The engine outlives its daemon: misses while it is gone (same tokens, nothing
    loaded), then a new session and region on the restarted daemon, then hits."""
    address = "unix://" + str(tmp_path / "k.sock")  # both daemons listen here too
    prompt = random_prompt(PROMPT_TOKENS, seed=5)
    daemon = start_daemon("--listen", address)
    try:
        llm = make_llm(address, kvtierd_retry_interval=0.2)
        manager = manager_of(llm)
        cold, _ = generate(llm, prompt)
        first_region = manager.region
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()

    assert llm.reset_prefix_cache()
    without_daemon, cached = generate(llm, prompt)
    assert without_daemon == cold and cached == 0

    daemon = start_daemon("--listen", address)
    try:
        wait_until_reachable(manager.client)
        time.sleep(0.3)  # on purpose: past the manager's retry interval (0.2 s)
        assert llm.reset_prefix_cache()
        fresh, cached = generate(llm, prompt)  # the new daemon is empty: computed, stored
        assert fresh == cold and cached == 0
        assert manager.counters.reconnects == 1
        assert manager.region != first_region and manager.region.still_current()
        assert llm.reset_prefix_cache()
        warm, cached = generate(llm, prompt)  # loaded from the new daemon's region
        assert warm == cold and cached == FULL_BLOCKS * TOKENS_PER_BLOCK
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def wait_until_reachable(client: Client, timeout: float = 10.0) -> None:
    """Until ``client``'s own channel reaches the daemon: while the daemon was gone
    the channel backed off its reconnects (up to ``grpc.max_reconnect_backoff_ms``,
    1 s, plus jitter), and until that backoff ends its calls fail at once even
    though the new daemon is up. A fixed sleep made this test flaky under load."""

    def reachable() -> bool:
        try:
            client.get_stats()
        except Unavailable:
            return False
        return True

    eventually(reachable, timeout, "the client's channel reaches the new daemon", interval=0.05)
