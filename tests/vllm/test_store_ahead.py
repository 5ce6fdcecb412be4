"""Stores asked ahead (kvtierd_client.vllm.store_ahead): the bookkeeping alone, and
the scheduler's manager against a real daemon, driven as vLLM's scheduler drives
it (key positions recorded, lookups key by key, load, store, step end) in either
release's call order: 0.33 calls ``on_schedule_end`` after the step's
``prepare_store``, 0.32 before it (``test_scheduler_loop`` checks the installed
release's order with vLLM's own scheduler)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from benchmarks.vllm_managers import plugin_manager
from kvtierd_client.client import Client
from kvtierd_client.vllm.compat import VllmCalls
from kvtierd_client.vllm.store_ahead import StoreAhead

END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
V032 = VllmCalls(schedule_end_last=False, reset_flushed=False)
V033 = VllmCalls(schedule_end_last=True, reset_flushed=True)


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
    ahead.note_absent([k(1)])  # a later store of the step evicted it
    claim = ahead.claim([k(1)])
    assert claim.ask == [k(1)] and claim.keys_to_store == []
    assert ahead.reserved == {k(2)}
    assert ahead.end_step() == [k(2)]
    assert ahead.claim([k(2)]) is None  # the step's grants are gone


def test_with_a_lifetime_of_two_a_grant_is_claimed_after_one_step_end():
    """vLLM 0.32's order: the step ends, then its prepare_store calls come."""
    ahead = StoreAhead(lifetime=2)
    ahead.add([k(1), k(2), k(3)], [k(2), k(3)], [20, 30], [])
    assert ahead.end_step() == [] and ahead.live == 1
    claim = ahead.claim([k(1), k(2)])
    assert (claim.keys_to_store, claim.rows, claim.ask) == ([k(2)], [20], [])
    ahead.add([k(4)], [k(4)], [40], [k(1)])  # the next step's grant evicts k(1)
    assert ahead.claim([k(1)]).ask == [k(1)]  # absent now: the daemon is asked
    assert ahead.end_step() == [k(3)] and ahead.reserved == {k(4)}
    assert ahead.end_step() == [k(4)] and ahead.live == 0


def test_a_failed_store_of_a_key_makes_a_grant_ask_for_it_again():
    ahead = StoreAhead(lifetime=2)
    ahead.add([k(1), k(2)], [k(2)], [20], [])
    assert ahead.claim([k(2)]).keys_to_store == [k(2)]
    assert ahead.claim([k(2)]).keys_to_store == []  # claimed: ours, skipped
    ahead.note_absent([k(2)])  # its store failed
    assert ahead.claim([k(2)]).ask == [k(2)]
    with pytest.raises(ValueError, match="at least one step end"):
        StoreAhead(lifetime=0)


# -- the manager against the daemon ---------------------------------------------------------


@pytest.fixture
def manager_on(kvtierd) -> Iterator:
    made = []

    def make(store_ahead: bool, pool: str, capacity: int = 64, calls: VllmCalls = V033):
        # queued completions go out with the next call or after two step ends, never by
        # the session's timer: round trips counted here do not depend on the speed
        manager, close = plugin_manager(
            kvtierd.address, pool, capacity, store_ahead, calls, flush_after=3600
        )
        made.append(close)
        return manager

    yield make
    for close in made:
        close()


def request(
    manager, req_id: str, chain: list[bytes], calls: VllmCalls = V033
) -> tuple[int, list[bytes]]:
    """One request as vLLM's scheduler makes it: lookups until the first miss,
    load of the hit prefix, store of the rest, and the step end after the store
    (``calls``: 0.33's order) or before it (0.32's). Its hits and stored keys."""
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
    if not calls.schedule_end_last:
        manager.on_schedule_end(END)
    out = manager.prepare_store(chain[hits:], ctx) if hits < len(chain) else None
    if out is not None:
        stored = [bytes(key) for key in out.keys_to_store]
        manager.complete_store(out.keys_to_store, ctx)
    if calls.schedule_end_last:
        manager.on_schedule_end(END)
    return hits, stored


@pytest.mark.parametrize("calls", [V033, V032], ids=["0.33-order", "0.32-order"])
def test_a_request_costs_one_round_trip_with_the_same_answers(manager_on, calls):
    ahead = manager_on(True, "ahead/one", calls=calls)
    asks = manager_on(False, "ahead/two", calls=calls)
    chains = [[k(i) for i in range(8)], [k(i) for i in range(12)], [k(i) for i in range(4, 9)]]
    for i, chain in enumerate(chains):
        before = (ahead.step_stats().round_trips, asks.step_stats().round_trips)
        assert request(ahead, str(i), chain, calls) == request(asks, str(i), chain, calls)
        spent = (
            ahead.step_stats().round_trips - before[0],
            asks.step_stats().round_trips - before[1],
        )
        assert spent == (1, 2 if i < 2 else 1), spent  # the last request stores nothing
    assert request(ahead, "again", chains[1], calls) == (12, [])


@pytest.mark.parametrize(
    ("calls", "lifetime", "round_trips"),
    [(V033, 1, 6), (V032, 2, 6), (V032, 1, 11)],
    ids=["0.33-order", "0.32-order", "0.32-order-grant-ends-with-the-step"],
)
def test_round_trips_of_five_new_requests_in_each_order(manager_on, calls, lifetime, round_trips):
    """Five new requests, one per step, and two idle steps (the last completions
    go out alone). A grant that ended with the step under 0.32's order (before
    issue #28) was given back before vLLM claimed it: a PrepareStore per request."""
    manager = manager_on(True, f"ahead/five/{lifetime}", calls=calls)
    manager._ahead.lifetime = lifetime
    for i in range(5):
        request(manager, str(i), [k(10 * i + j) for j in range(6)], calls)
    for _ in range(2):
        manager.on_schedule_end(END)
    assert manager.step_stats().round_trips == round_trips
    assert manager.counters.ops["PrepareStore"] == (5 if round_trips == 11 else 0)
    assert not manager.has_pending_work()  # nothing reserved ahead is left


@pytest.mark.parametrize("calls", [V033, V032], ids=["0.33-order", "0.32-order"])
def test_rows_reserved_ahead_and_not_stored_are_given_back_at_the_step_end(
    kvtierd, manager_on, calls
):
    manager = manager_on(True, "ahead/unclaimed", capacity=8, calls=calls)
    ctx = ReqContext(req_id="r")
    chain = [k(i) for i in range(6)]
    for position, key in enumerate(chain):
        ctx.set_offload_key_position(OffloadKey(key), (position + 1) * 16)
    assert manager.lookup(OffloadKey(chain[0]), ctx) is LookupResult.MISS
    if not calls.schedule_end_last:
        manager.on_schedule_end(END)
    out = manager.prepare_store(chain[:2], ctx)  # a chunk of the prompt only
    assert [bytes(key) for key in out.keys_to_store] == chain[:2]
    manager.complete_store(out.keys_to_store, ctx)
    for _ in range(3):  # the grant ends, then the queued give-back goes out
        manager.on_schedule_end(END)
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
