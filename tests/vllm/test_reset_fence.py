"""What the jobs in flight at ``reset_cache`` hold (graves) is released when vLLM
says its workers flushed them (0.33's ``on_reset_flushed``), or a fixed number of
steps later with 0.32, which does not say: the manager against a real daemon."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, ScheduleEndContext

from benchmarks.vllm_managers import plugin_manager
from kvtierd_client.client import Client
from kvtierd_client.vllm.accounting import QUEUE_STEPS
from kvtierd_client.vllm.compat import VllmCalls
from kvtierd_client.vllm.holdings import GRAVE_STEPS

END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
KEYS = [OffloadKey(i.to_bytes(8, "big") + bytes(4)) for i in range(3)]


@pytest.fixture(params=[True, False], ids=["0.33-hook", "0.32-steps"])
def reset_with_a_load_in_flight(request, kvtierd) -> Iterator[tuple[object, VllmCalls, Client]]:
    """A manager whose load of three stored blocks is in flight at reset_cache."""
    hook = request.param
    calls = VllmCalls(schedule_end_last=hook, reset_flushed=hook)
    manager, close = plugin_manager(kvtierd.address, "fence", 16, True, calls)
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store(KEYS, ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_load(KEYS, ctx)  # pinned; vLLM will never complete this load
    manager.reset_cache()
    with Client(kvtierd.address) as client:
        yield manager, calls, client
    close()


def pinned(client: Client) -> int:
    return client.get_stats("fence").pools[0].tiers[0].pinned_blocks


def test_the_pins_of_a_load_in_flight_at_a_reset_wait_for_the_flush(reset_with_a_load_in_flight):
    manager, calls, client = reset_with_a_load_in_flight
    for _ in range(GRAVE_STEPS):
        assert manager.has_pending_work()
        manager.on_schedule_end(END)
    if calls.reset_flushed:  # 0.33: the steps do not matter, vLLM's report does
        assert manager.has_pending_work() and pinned(client) == len(KEYS)
        manager.on_reset_flushed()
    assert not manager.has_pending_work()
    for _ in range(QUEUE_STEPS):  # the queued release goes out alone
        manager.on_schedule_end(END)
    assert pinned(client) == 0
