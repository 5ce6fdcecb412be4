"""Bad input at registration: one ERROR line saying what to change, no exception into
SGLang, and a backend that serves misses (and, where the daemon is what failed,
connects by itself once it answers)."""

from __future__ import annotations

import logging

import pytest
import torch
from daemon_harness import eventually, start_daemon

from benchmarks import sglang_env as env

LOGGER = "kvtierd_client.sglang"


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(LOGGER + ".") and r.levelno >= logging.ERROR
    ]


def _misses(backend: object, pool: object) -> None:
    """Every data-path call answers a miss, none raises."""
    keys = env.page_keys("miss", 3)
    slots = env.token_slots(pool, [1, 2, 3])
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots) == [False] * 3
    assert backend.batch_set_v1(keys, slots) == [False] * 3
    assert backend.get(keys[0]) is None
    assert backend.exists(keys[0]) is False


def test_daemon_not_running_at_registration_then_started(caplog):
    daemon = start_daemon("--memory-budget", "256MiB")
    assert daemon.stop() == 0  # its address now leads nowhere
    try:
        caplog.set_level(logging.INFO, logger=LOGGER)
        pool = env.mha_host_pool("page_first")
        backend = env.create_backend(
            env.storage_config(daemon.address, kvtierd_retry_interval=0.05), pool
        )
        (error,) = _errors(caplog)
        assert f"kvtierd is not reachable at {daemon.address}" in error
        assert "kvtierd_address" in error and "serves misses until it answers" in error
        _misses(backend, pool)
        daemon = daemon.restart()
        keys = env.page_keys("late", 2)
        env.fill_pages(pool, [4, 5], seed=9)
        eventually(
            lambda: backend.batch_set_v1(keys, env.token_slots(pool, [4, 5])) == [True] * 2,
            30, "stores once the daemon runs",
        )  # fmt: skip
        backend.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_malformed_address_turns_the_backend_off(caplog):
    pool = env.mha_host_pool("page_first")
    backend = env.create_backend(env.storage_config("unix:relative/path"), pool)
    (error,) = _errors(caplog)
    assert error.startswith("--hicache-storage-backend-extra-config kvtierd_address:")
    assert "SGLang runs without it" in error
    stats = env.unwrap(backend).statistics()
    assert not stats.enabled and stats.registration_error and stats.pool is None
    _misses(backend, pool)


def test_pool_over_the_daemons_budget(daemon, caplog):
    pool = env.mha_host_pool("page_first")
    config = env.storage_config(daemon.address, kvtierd_pool_bytes=1 << 30)  # budget: 256 MiB
    backend = env.create_backend(config, pool)
    (error,) = _errors(caplog)
    assert "RESOURCE_EXHAUSTED" in error
    assert "set (or lower) kvtierd_pool_bytes or raise the daemon's memory.budget" in error
    _misses(backend, pool)
    backend.close()


def _split_mla_pool() -> object:
    """A real MLA host pool in SGLang's Ascend layout (``page_first_kv_split``), which
    this backend does not move."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    bf16 = torch.bfloat16
    split = MLASplitBuffers(
        k=torch.zeros(2, 64, 1, 32, dtype=bf16), v=torch.zeros(2, 64, 1, 16, dtype=bf16),
        index_k=None, index_scales=None, index_layer_indices=(), k_width=32, v_width=16,
        index_width=0,
    )  # fmt: skip
    info = MLABufferInfo(
        buffers=split, data_ptrs=None, layer_indices=(0, 1), device_layer_num=2, page_size=4,
        kv_lora_rank=32, qk_rope_head_dim=16, kv_cache_dim=48, dtype=bf16,
        device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, 2.0, 0, 4, "page_first_kv_split", pin_memory=False, device="cpu",
        device_capacity_tokens=64, start_layer=0, end_layer=2, target_layer_num=2,
    )  # fmt: skip


def test_unsupported_layout_names_the_layout(daemon, caplog):
    pool = _split_mla_pool()
    backend = env.create_backend(env.storage_config(daemon.address, mla=True), pool)
    (error,) = _errors(caplog)
    assert error.startswith(
        "kvtierd: --hicache-mem-layout page_first_kv_split is not supported for MLA host pools "
        "(supported: layer_first, page_first, page_first_direct, page_unified)"
    )
    assert not env.unwrap(backend).statistics().enabled
    _misses(backend, pool)


def test_page_size_that_does_not_match_the_pools_block_size(daemon, caplog):
    first_pool = env.mha_host_pool("page_first", head_dim=64, page_size=4)  # 4 KiB pages
    first = env.create_backend(
        env.storage_config(daemon.address, kvtierd_pool="shared"), first_pool
    )
    assert not _errors(caplog)
    other_pool = env.mha_host_pool("page_first", head_dim=64, page_size=8)  # 8 KiB pages
    other = env.create_backend(
        env.storage_config(daemon.address, kvtierd_pool="shared"), other_pool
    )
    (error,) = _errors(caplog)
    assert "kvtierd pool 'shared/tp0of1' exists with another block size or layout" in error
    assert "block_bytes=8192" in error and "FAILED_PRECONDITION" in error
    _misses(other, other_pool)
    keys = env.page_keys("first-still-works", 2)
    assert first.batch_set_v1(keys, env.token_slots(first_pool, [1, 2])) == [True] * 2
    for b in (first, other):
        b.close()


def test_pool_bytes_that_hold_no_row(caplog):
    pool = env.mha_host_pool("page_first")  # 1 KiB pages: 4 KiB rows
    backend = env.create_backend(
        env.storage_config("unix:///nowhere.sock", kvtierd_pool_bytes=100), pool
    )
    (error,) = _errors(caplog)
    assert error.startswith("kvtierd: kvtierd_pool_bytes 100 holds no row of 4096 bytes")
    _misses(backend, pool)
