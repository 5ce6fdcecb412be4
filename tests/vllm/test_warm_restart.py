"""The vLLM plug-in across a warm restart of kvtierd (issue #20): the engine
outlives the daemon, reconnects, keeps its workers' mapping (the region is the
same file) and loads its prompt from the adopted primary tier; the fs tier,
configured too, serves nothing (no promotion)."""

from __future__ import annotations

import time

import pytest
from daemon_harness import start_daemon
from test_sharing_and_tiers import FULL_BLOCKS, PROMPT_TOKENS, wait_until_reachable
from vllm_e2e import TOKENS_PER_BLOCK, generate, manager_of, pool_stats, tier

from benchmarks.vllm_model import random_prompt

pytestmark = pytest.mark.engine  # runs vLLM engines: vLLM's CPU build (make test-vllm)


def test_engine_loads_from_the_adopted_primary_after_a_daemon_restart(make_llm, tmp_path):
    address = "unix://" + str(tmp_path / "k.sock")  # both daemons listen here too
    root = tmp_path / "fs"
    root.mkdir()
    config = f'[[tiers]]\ntype = "fs"\nroot = "{root}"\ncapacity = "1GiB"\n'
    prompt = random_prompt(PROMPT_TOKENS, seed=20)
    daemon = start_daemon("--listen", address, "--memory-budget", "512MiB", config=config)
    try:
        llm = make_llm(address, kvtierd_retry_interval=0.2)
        manager = manager_of(llm)
        cold, cached = generate(llm, prompt)
        assert cached == 0
        first_region = manager.region
        pool = manager.pool_name
        assert tier(pool_stats(address, pool), "primary").used_blocks == FULL_BLOCKS
        assert daemon.stop() == 0  # SIGTERM: the region file and its journal stay

        daemon = daemon.restart()  # same command line, same shm_dir
        wait_until_reachable(manager.client)
        time.sleep(0.3)  # past the manager's retry interval (0.2 s)
        assert llm.reset_prefix_cache()
        warm, cached = generate(llm, prompt)
        assert warm == cold
        assert cached == FULL_BLOCKS * TOKENS_PER_BLOCK  # loaded, not recomputed
        assert manager.counters.reconnects == 1
        assert manager.region == first_region and manager.region.still_current()
        lookups = manager.counters.lookups
        assert lookups.get("hit_pending", 0) == 0  # nothing promoted
        stats = pool_stats(address, pool)
        assert tier(stats, "fs0").hits == 0  # the fs tier served nothing
        assert tier(stats, "primary").hits >= FULL_BLOCKS
        assert "warm restart adopted" in daemon.log()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
