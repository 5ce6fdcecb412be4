"""vLLM's CPU-manager scenarios (vLLM's tests/v1/kv_offload/cpu/test_manager.py;
docs/design/semantics.md) replayed through the real daemon over its Unix socket: same
block ids, evicted keys, lookup results, events."""

from __future__ import annotations

import pytest

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import NotFound

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def keys(*ids: int) -> list[bytes]:
    """vLLM's test keys: str(i) plus the 4-byte group index 0."""
    return [str(i).encode() + (0).to_bytes(4, "big") for i in ids]


def event_sets(events) -> list[tuple[str, set[bytes]]]:
    return [("removed" if e.removed else "stored", set(e.keys)) for e in events]


@pytest.fixture
def open_pool(daemon, pool_name):
    clients = []

    def opener(num_blocks: int = 4, policy: str = "lru"):
        client = Client(daemon.address)
        clients.append(client)
        return client.open_session(
            pool_name, block_bytes=4096, num_blocks=num_blocks, eviction_policy=policy
        )

    yield opener
    for client in clients:
        client.close()


def test_lru_full_scenario(open_pool):
    s = open_pool()
    out = s.prepare_store(keys(1, 2))
    assert out.keys_to_store == keys(1, 2) and out.block_ids == [0, 1]
    assert out.evicted_keys == []
    assert s.lookup(keys(1, 2)) == [PENDING, PENDING]
    assert s.take_events() == []

    s.complete_store(keys(1, 2))
    assert event_sets(s.take_events()) == [("stored", set(keys(1, 2)))]
    assert s.lookup(keys(1, 2, 3)) == [HIT, HIT, MISS]

    out = s.prepare_store(keys(2, 3, 4, 5))
    assert out.keys_to_store == keys(3, 4, 5) and out.block_ids == [2, 3, 0]
    assert out.evicted_keys == keys(1)
    assert event_sets(s.take_events()) == [("removed", set(keys(1)))]

    assert s.prepare_store(keys(1, 6)) is None  # no room: only 2 is evictable, 1 and 6 needed
    s.complete_store(keys(2, 3, 4, 5))  # 2 is already ready: ignored
    assert s.lookup(keys(1, 2, 3, 4, 5)) == [MISS, HIT, HIT, HIT, HIT]

    assert s.prepare_load(keys(2, 3)) == [1, 2]
    assert s.prepare_store(keys(6, 7, 8)) is None  # 2 and 3 pinned
    s.complete_load(keys(2, 3))
    out = s.prepare_store(keys(6, 7, 8))
    assert out.keys_to_store == keys(6, 7, 8) and out.block_ids == [1, 0, 3]
    assert out.evicted_keys == keys(4, 5, 2)
    s.complete_store(keys(6, 7, 8))

    s.touch(keys(3, 6, 7))
    out = s.prepare_store(keys(9))
    assert out.block_ids == [3] and out.evicted_keys == keys(8)
    s.complete_store(keys(7, 9), success=False)
    assert s.lookup(keys(7, 9)) == [HIT, MISS]

    assert event_sets(s.take_events()) == [
        ("stored", set(keys(3, 4, 5))),
        ("removed", set(keys(4, 5, 2))),
        ("stored", set(keys(6, 7, 8))),
        ("removed", set(keys(8))),
    ]


def test_eviction_removed_precedes_stored(open_pool):
    s = open_pool(num_blocks=2)
    s.prepare_store(keys(1, 2))
    s.complete_store(keys(1, 2))
    s.prepare_store(keys(3))
    s.complete_store(keys(3))
    events = s.take_events()
    # stored {1,2} came from the first call; in the second, the removal precedes the store
    assert event_sets(events) == [
        ("stored", set(keys(1, 2))),
        ("removed", set(keys(1))),
        ("stored", set(keys(3))),
    ]
    assert all(e.medium == 1 and e.tier == "primary" for e in events)  # MEDIUM_CPU
    assert [e.seq for e in events] == sorted(e.seq for e in events)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_block_not_evicted_during_prepare_store(open_pool, policy):
    s = open_pool(policy=policy)
    s.prepare_store(keys(1, 2))
    s.complete_store(keys(1, 2))
    s.touch(keys(1))
    out = s.prepare_store(keys(2, 3, 4, 5))
    assert out.keys_to_store == keys(3, 4, 5)
    assert out.block_ids == [2, 3, 0]
    assert out.evicted_keys == keys(1)
    s.complete_store(keys(3, 4, 5))
    assert s.lookup(keys(2)) == [HIT]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_load_preserves_key_order(open_pool, policy):
    s = open_pool(policy=policy)
    out = s.prepare_store(keys(1, 2, 3))
    s.complete_store(keys(1, 2, 3))
    ids = dict(zip(out.keys_to_store, out.block_ids, strict=True))
    for order in ([3, 1, 2], [2, 3, 1], [1, 2, 3]):
        assert s.prepare_load(keys(*order)) == [ids[k] for k in keys(*order)]
        s.complete_load(keys(*order))


def test_arc_touch_ordering_evicts_t1_first(open_pool):
    s = open_pool(policy="arc")
    s.prepare_store(keys(1, 2, 3, 4))
    s.complete_store(keys(1, 2, 3, 4))
    s.touch(keys(1, 3, 4))  # 1, 3, 4 move to T2; T1 = {2}
    out = s.prepare_store(keys(5))
    assert out.evicted_keys == keys(2) and out.block_ids == [1]


def test_arc_eviction_waits_for_loads(open_pool):
    s = open_pool(policy="arc")
    s.prepare_store(keys(1, 2, 3, 4))
    s.complete_store(keys(1, 2, 3, 4))
    assert s.prepare_load(keys(2, 3)) == [1, 2]
    assert s.prepare_store(keys(5, 6, 7)) is None
    s.complete_load(keys(2, 3))
    out = s.prepare_store(keys(5, 6, 7))
    assert out is not None and len(out.evicted_keys) == 3


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_failed_store_frees_slot(open_pool, policy):
    s = open_pool(policy=policy)
    out = s.prepare_store(keys(5))
    s.complete_store(keys(5), success=False)
    assert s.lookup(keys(5)) == [MISS]
    assert out.block_ids == [0]
    # never-used rows are handed out first, then the freed row 0
    assert s.prepare_store(keys(6, 7, 8, 9)).block_ids == [1, 2, 3, 0]


def test_flush_pool_keeps_pinned_and_in_flight_blocks(daemon, open_pool, pool_name):
    """FlushPool is the safe reset: ready blocks go, blocks someone reads or
    writes stay, and an unknown pool is NOT_FOUND."""
    s = open_pool(num_blocks=8)
    s.prepare_store(keys(1, 2, 3))
    s.complete_store(keys(1, 2, 3))
    s.prepare_load(keys(2))  # pinned
    s.prepare_store(keys(4))  # in flight
    with Client(daemon.address) as admin:
        assert admin.flush_pool(pool_name) == 2
        assert s.lookup(keys(1, 2, 3, 4)) == [MISS, HIT, MISS, PENDING]
        assert admin.flush_pool(pool_name) == 0
        with pytest.raises(NotFound, match="does not exist"):
            admin.flush_pool(pool_name + "-missing")
    events = event_sets(s.take_events())
    assert events[-1] == ("removed", set(keys(1, 3)))
