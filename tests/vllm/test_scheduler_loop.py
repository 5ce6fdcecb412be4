"""The plug-in driven by vLLM's own scheduler and connector worker, without a model
(``engine_free.SchedulerLoop``), on a real daemon: runs on every supported vLLM
release, 0.33 included (which has no CPU build that runs models)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_free import TOKENS_PER_BLOCK, SchedulerLoop, base_config, with_connector
from vllm_e2e import pool_stats, tier

from benchmarks.vllm_model import random_prompt
from kvtierd_client.vllm.accounting import QUEUE_STEPS
from kvtierd_client.vllm.compat import VllmCalls, installed_version, release_of
from kvtierd_client.vllm.manager import CONFIG_INFO_KEYS

PROMPT_TOKENS = 100  # 6 full blocks of 16 tokens and a tail
FULL_BLOCKS = PROMPT_TOKENS // TOKENS_PER_BLOCK
RELEASE = release_of(installed_version())


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Any:
    return base_config(tiny_model)


@pytest.fixture
def make_loop(kvtierd, base) -> Iterator[Callable[..., SchedulerLoop]]:
    loops: list[SchedulerLoop] = []

    def make(**extra: Any) -> SchedulerLoop:
        loops.append(SchedulerLoop(with_connector(base, kvtierd.address, **extra)))
        return loops[-1]

    yield make
    for loop in loops:
        loop.shutdown()


def test_the_installed_release_is_driven_as_the_plugin_expects(make_loop):
    """The call order and the reset hook the plug-in assumes for this release are
    the ones vLLM's scheduler uses (the manager logs each call)."""
    loop = make_loop()
    calls: list[str] = []
    manager = loop.manager
    for name in ("lookup", "prepare_store", "on_schedule_end", "on_reset_flushed"):
        real = getattr(manager, name)
        setattr(manager, name, _recorder(calls, name, real))
    loop.add("r", random_prompt(PROMPT_TOKENS, seed=3))
    loop.step()
    first_step = [c for c in dict.fromkeys(calls) if c != "on_reset_flushed"]
    expected = VllmCalls.of_release(RELEASE)
    if expected.schedule_end_last:
        assert first_step == ["lookup", "prepare_store", "on_schedule_end"], calls
    else:
        assert first_step == ["lookup", "on_schedule_end", "prepare_store"], calls
    loop.run()
    calls.clear()
    assert loop.scheduler.reset_prefix_cache(reset_connector=True)
    assert ("on_reset_flushed" in calls) == expected.reset_flushed
    assert VllmCalls.installed() == expected


def _recorder(calls: list[str], name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    return record


def test_a_new_request_costs_one_round_trip_in_this_releases_call_order(make_loop, kvtierd):
    """Five new requests, one per step: each lookup's round trip also reserves the
    request's blocks and vLLM's prepare_store is answered from that grant, in
    whichever order this release calls the manager (0.32: after on_schedule_end).
    Queued completions go out with the next lookup or after two step ends, never by
    the session's timer (``kvtierd_flush_after`` an hour): the count does not
    depend on how fast the steps are."""
    loop = make_loop(kvtierd_flush_after=3600)
    manager = loop.manager
    before = manager.step_stats()
    for i in range(5):
        loop.add(f"r{i}", random_prompt(PROMPT_TOKENS, seed=100 + i))
        loop.step()
    steps = loop.run()
    for _ in range(QUEUE_STEPS):  # an idle engine: the last completions go out alone
        manager.on_schedule_end(_end())
    spent = manager.step_stats() - before
    assert manager.counters.ops["PrepareStore"] == 0  # every store claimed a grant
    # 5 lookups (each carrying the queued completions before it) and the last
    # completions sent alone a whole step later; 11 with 0.32's order before the
    # grants outlived the step end
    assert spent.round_trips == 6, (spent, steps)
    primary = tier(pool_stats(kvtierd.address, manager.pool_name), "primary")
    assert (primary.used_blocks, primary.pending_blocks) == (5 * FULL_BLOCKS, 0)


def test_a_prefix_stored_by_one_request_is_loaded_into_another_bit_exact(make_loop):
    """With 0.33 the load is a sync load (``sync_load_budget_bytes`` > 0): vLLM's
    worker submits it with ``expedited=True`` and waits for it inside the step."""
    loop = make_loop(sync_load_budget_bytes=64 << 20)
    prompt = random_prompt(PROMPT_TOKENS, seed=5)
    first = loop.add("first", prompt)
    loop.step()
    stored = loop.kv_of(loop.blocks_of(first)[:FULL_BLOCKS])
    loop.run()
    for tensor in loop.kv.values():
        tensor.zero_()  # the GPU blocks are reused: only the offloaded copy is left
    assert loop.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets

    second = loop.add("second", prompt)
    out = loop.step()
    loads = out.kv_connector_metadata.load_jobs
    assert len(loads) == 1
    (job,) = loads.values()
    assert len(job.dst_spec.block_ids) == FULL_BLOCKS  # the whole stored prefix
    sync = VllmCalls.of_release(RELEASE).schedule_end_last  # 0.33+: sync loads exist
    assert getattr(job, "sync", False) is sync
    if not sync:
        loop.step()  # 0.32: the request waited for its load; it runs now
    loaded = loop.kv_of(loop.blocks_of(second)[:FULL_BLOCKS])
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name
    loop.run()


def test_a_reset_with_a_store_in_flight_leaves_nothing_held(make_loop, kvtierd):
    loop = make_loop()
    manager = loop.manager
    loop.add("r", random_prompt(PROMPT_TOKENS, seed=9))
    loop.step()  # the store job is submitted at the next step's start
    loop.scheduler.finish_requests("r", _finished_status())
    assert loop.scheduler.reset_prefix_cache(reset_connector=True)
    loop.run()
    for _ in range(3):  # an idle engine's flush of the last queued completions
        manager.on_schedule_end(_end())
    primary = tier(pool_stats(kvtierd.address, manager.pool_name), "primary")
    assert (primary.pinned_blocks, primary.pending_blocks) == (0, 0), primary
    assert not manager.has_pending_work()


def test_the_config_info_metric_gets_the_labels_the_spec_declares(make_loop, kvtierd):
    """vLLM 0.33's ``vllm:kv_offload_config_info``: the spec declares the labels, the
    manager fills them once (0.32 never asks)."""
    loop = make_loop()
    spec_cls = type(loop.worker.connector_worker.spec)
    assert spec_cls.config_info_keys({}) == CONFIG_INFO_KEYS
    (info,) = loop.manager.config_info()
    assert tuple(info) == CONFIG_INFO_KEYS
    stats = pool_stats(kvtierd.address, loop.manager.pool_name)
    assert info["kvtierd_pool"] == loop.manager.pool_name
    assert info["kvtierd_block_bytes"] == stats.block_bytes
    assert info["kvtierd_capacity_blocks"] == tier(stats, "primary").capacity_blocks
    assert info["kvtierd_address"] == kvtierd.address
    if VllmCalls.of_release(RELEASE).reset_flushed:  # 0.33: rides on the first stats
        payload = loop.scheduler.connector.get_kv_connector_stats()
        assert payload.data["info"] == [info]


def _end() -> Any:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=[], preempted_req_ids=())


def _finished_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
