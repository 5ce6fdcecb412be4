"""Stores asked ahead (kvtierd_client.vllm.store_ahead): the bookkeeping alone, and
the scheduler's manager against a real daemon, driven as vLLM's scheduler drives
it (key positions recorded, lookups key by key, load, store, step end)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from benchmarks.vllm_managers import plugin_manager
from kvtierd_client.client import Client
from kvtierd_client.vllm.store_ahead import StoreAhead

END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + bytes(4)


# -- bookkeeping -----------------------------------------------------------------------


def test_a_claim_takes_reserved_rows_skips_present_keys_and_asks_the_rest():
    ahead = StoreAhead()
    ahead.add([k(1), k(2), k(3)], [k(2), k(3)], [20, 30], [k(9)])  # k(1) was present
    assert ahead.claim([k(7)]) is None  # offered to no grant: the daemon is asked
    claim = ahead.claim([k(1), k(3), k(4)])
    assert (claim.keys_to_store, claim.rows, claim.evicted, claim.ask) == (
        [k(3)], [30], [k(9)], [k(4)],
    )  # fmt: skip
    again = ahead.claim([k(2), k(3)])  # k(3) is ours now: present, skipped
    assert (again.keys_to_store, again.rows, again.evicted, again.ask) == ([k(2)], [20], [], [])
    assert ahead.take_unclaimed() == [] and ahead.reserved == set()


def test_a_present_key_evicted_since_is_asked_and_unclaimed_rows_are_given_back():
    ahead = StoreAhead()
    ahead.add([k(1), k(2)], [k(2)], [5], [])
    ahead.note_evicted([k(1)])  # a later store of the step evicted it
    claim = ahead.claim([k(1)])
    assert claim.ask == [k(1)] and claim.keys_to_store == []
    assert ahead.reserved == {k(2)}
    assert ahead.take_unclaimed() == [k(2)]
    assert ahead.claim([k(2)]) is None  # the step's grants are gone


# -- the manager against the daemon ---------------------------------------------------------


@pytest.fixture
def manager_on(kvtierd) -> Iterator:
    made = []

    def make(store_ahead: bool, pool: str, capacity: int = 64):
        manager, close = plugin_manager(kvtierd.address, pool, capacity, store_ahead)
        made.append(close)
        return manager

    yield make
    for close in made:
        close()


def request(manager, req_id: str, chain: list[bytes]) -> tuple[int, list[bytes]]:
    """One request as vLLM's scheduler makes it: lookups until the first miss,
    load of the hit prefix, store of the rest, step end. Its hits and stored keys."""
    ctx = ReqContext(req_id=req_id)
    for position, key in enumerate(chain):
        ctx.set_offload_key_position(OffloadKey(key), (position + 1) * 16)
    manager.on_new_request(ctx)
    hits = 0
    for key in chain:
        if manager.lookup(OffloadKey(key), ctx) is not LookupResult.HIT:
            break
        hits += 1
    if hits:
        manager.prepare_load(chain[:hits], ctx)
        manager.complete_load(chain[:hits], ctx)
    stored: list[bytes] = []
    out = manager.prepare_store(chain[hits:], ctx) if hits < len(chain) else None
    if out is not None:
        stored = [bytes(key) for key in out.keys_to_store]
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_schedule_end(END)
    return hits, stored


def test_a_request_costs_one_round_trip_with_the_same_answers(manager_on):
    ahead, asks = manager_on(True, "ahead/one"), manager_on(False, "ahead/two")
    chains = [[k(i) for i in range(8)], [k(i) for i in range(12)], [k(i) for i in range(4, 9)]]
    for i, chain in enumerate(chains):
        before = (ahead.step_stats().round_trips, asks.step_stats().round_trips)
        assert request(ahead, str(i), chain) == request(asks, str(i), chain)
        spent = (
            ahead.step_stats().round_trips - before[0],
            asks.step_stats().round_trips - before[1],
        )
        assert spent == (1, 2 if i < 2 else 1), spent  # the last request stores nothing
    assert request(ahead, "again", chains[1]) == (12, [])


def test_rows_reserved_ahead_and_not_stored_are_given_back_at_the_step_end(kvtierd, manager_on):
    manager = manager_on(True, "ahead/unclaimed", capacity=8)
    ctx = ReqContext(req_id="r")
    chain = [k(i) for i in range(6)]
    for position, key in enumerate(chain):
        ctx.set_offload_key_position(OffloadKey(key), (position + 1) * 16)
    assert manager.lookup(OffloadKey(chain[0]), ctx) is LookupResult.MISS
    out = manager.prepare_store(chain[:2], ctx)  # a chunk of the prompt only
    assert [bytes(key) for key in out.keys_to_store] == chain[:2]
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_schedule_end(END)
    manager.on_schedule_end(END)  # the queued give-back goes out by now
    with Client(kvtierd.address, fast_lane=False) as client:
        primary = client.get_stats("ahead/unclaimed").pools[0].tiers[0]
        assert primary.pending_blocks == 0 and primary.used_blocks == 2


def test_a_lookup_in_the_same_step_sees_keys_reserved_ahead_as_misses(manager_on):
    """Two requests sharing a tail in one step: the second one's lookup answers MISS
    (as before the first one's reservation), not HIT_PENDING."""
    manager = manager_on(True, "ahead/shared")
    first, second = ReqContext(req_id="1"), ReqContext(req_id="2")
    chain = [k(i) for i in range(4)]
    for ctx in (first, second):
        for position, key in enumerate(chain):
            ctx.set_offload_key_position(OffloadKey(key), (position + 1) * 16)
    assert manager.lookup(OffloadKey(chain[0]), first) is LookupResult.MISS
    assert manager.lookup(OffloadKey(chain[0]), second) is LookupResult.MISS
    out = manager.prepare_store(chain, first)
    assert [bytes(key) for key in out.keys_to_store] == chain
    assert manager.prepare_store(chain, second).keys_to_store == []
    manager.complete_store(out.keys_to_store, first)
    manager.on_schedule_end(END)
