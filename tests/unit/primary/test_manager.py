"""PrimaryManager against vLLM's CPUOffloadingManager behaviour
(docs/design/semantics.md; the scenarios of vLLM's ``tests/v1/kv_offload/cpu/test_manager.py``)."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Callable

import pytest

from kvtierd.contract import (
    EVICTION_POLICIES,
    PRIMARY_TIER,
    BlockEvent,
    LookupResult,
    Medium,
    StoreGrant,
)
from kvtierd.primary.errors import NotLoadableError, NotPinnedError
from kvtierd.primary.manager import PrimaryManager
from kvtierd.primary.policies import ARCPolicy, LRUPolicy
from kvtierd.primary.table import PrimaryStats

MISS, HIT, PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def keys(ints: list[int]) -> list[bytes]:
    return [str(i).encode() + b"\0\0\0\0" for i in ints]


def key(i: int) -> bytes:
    return keys([i])[0]


def make(policy: str = "lru", num_blocks: int = 4) -> tuple[PrimaryManager, list[BlockEvent]]:
    events: list[BlockEvent] = []
    return PrimaryManager(num_blocks, policy, on_event=events.append), events


def take(events: list[BlockEvent]) -> list[BlockEvent]:
    out = list(events)
    events.clear()
    return out


def stored(ints: list[int]) -> BlockEvent:
    return BlockEvent(tuple(keys(ints)), Medium.CPU, removed=False)


def removed(ints: list[int]) -> BlockEvent:
    return BlockEvent(tuple(keys(ints)), Medium.CPU, removed=True)


def grant(to_store: list[int], ids: list[int], evicted: list[int]) -> StoreGrant:
    return StoreGrant(keys(to_store), ids, keys(evicted))


def store(m: PrimaryManager, ints: list[int]) -> StoreGrant:
    g = m.prepare_store(keys(ints))
    assert g is not None
    m.complete_store(keys(ints), success=True)
    m.check_invariants()
    return g


def arc_of(m: PrimaryManager) -> ARCPolicy:
    assert isinstance(m.policy, ARCPolicy)
    return m.policy


def lru_of(m: PrimaryManager) -> LRUPolicy:
    assert isinstance(m.policy, LRUPolicy)
    return m.policy


def where(m: PrimaryManager, i: int) -> str | None:
    return arc_of(m).location(key(i))


def snapshot(m: PrimaryManager, universe: list[int]) -> tuple[object, ...]:
    """Everything observable about ``m`` for the keys of ``universe``."""
    ks = keys(universe)
    policy = m.policy
    if isinstance(policy, LRUPolicy):
        order: object = policy.evictable_order()
    else:
        arc = arc_of(m)
        lists = [arc.order("t1"), arc.order("t2"), arc.order("b1"), arc.order("b2")]
        order = (lists, arc.statistics())
    return (
        m.statistics(),
        m.lookup(ks),
        [m.ref_count(k) for k in ks],
        [m.block_id(k) for k in ks],
        len(m),
        order,
    )


# ----------------------------------------------------------------- vLLM §12.1


def test_cpu_manager():
    """The LRU full scenario of vLLM's ``test_cpu_manager``."""
    m, events = make("lru", 4)

    assert m.prepare_store(keys([1, 2])) == grant([1, 2], [0, 1], [])
    assert m.lookup(keys([1, 2])) == [PENDING, PENDING]
    assert take(events) == []

    assert m.complete_store(keys([1, 2]), success=True) == keys([1, 2])
    assert take(events) == [stored([1, 2])]
    assert m.lookup(keys([1, 2, 3])) == [HIT, HIT, MISS]

    assert m.prepare_store(keys([2, 3, 4, 5])) == grant([3, 4, 5], [2, 3, 0], [1])
    assert take(events) == [removed([1])]

    assert m.prepare_store(keys([1, 6])) is None  # no space: 3, 4, 5 in flight

    m.complete_store(keys([2, 3, 4, 5]), success=True)
    assert m.lookup(keys([1, 2, 3, 4, 5, 0])) == [MISS, HIT, HIT, HIT, HIT, MISS]

    assert m.prepare_load(keys([2, 3])) == [1, 2]
    assert m.prepare_store(keys([6, 7, 8])) is None  # 2, 3 are being loaded
    m.complete_load(keys([2, 3]))  # 2, 3 become the most recent

    assert m.prepare_store(keys([6, 7, 8])) == grant([6, 7, 8], [1, 0, 3], [4, 5, 2])
    m.complete_store(keys([6, 7, 8]), success=True)

    m.touch(keys([3, 6, 7]))
    assert lru_of(m).evictable_order() == keys([8, 7, 6, 3])
    assert m.prepare_store(keys([9])) == grant([9], [3], [8])

    assert m.complete_store(keys([7, 9]), success=False) == keys([9])
    assert m.lookup(keys([7, 9])) == [HIT, MISS]

    assert take(events) == [stored([3, 4, 5]), removed([4, 5, 2]), stored([6, 7, 8]), removed([8])]
    assert all(e.medium is Medium.CPU and e.tier == PRIMARY_TIER for e in events)
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_eviction_removed_precedes_stored(policy):
    events: list[BlockEvent] = []
    seen_during_removal: list[tuple[bool, int]] = []

    def on_event(event: BlockEvent) -> None:  # observes the manager from inside the callback
        events.append(event)
        if event.removed:
            seen_during_removal.append((key(3) in m, len(m)))

    m = PrimaryManager(2, policy, on_event=on_event)
    store(m, [1, 2])
    take(events)
    store(m, [3])
    got = take(events)
    assert [e.removed for e in got] == [True, False]
    assert got == [removed([1]), stored([3])]
    assert all(e.medium == Medium.CPU for e in got)
    # the removal is announced before the new key takes the freed row
    assert seen_during_removal == [(False, 1)]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_already_stored_block_not_evicted_during_prepare_store(policy):
    m, _ = make(policy, 4)
    store(m, [1, 2])
    m.touch(keys([1]))  # 2 is now the LRU candidate
    g = m.prepare_store(keys([2, 3, 4, 5]))
    assert g == grant([3, 4, 5], [2, 3, 0], [1])
    m.complete_store(keys([2, 3, 4, 5]), success=True)
    assert m.lookup(keys([2])) == [HIT]
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_prepare_load_preserves_key_order(policy):
    m, _ = make(policy, 4)
    g = store(m, [0, 1, 2])
    row = dict(zip(g.keys_to_store, g.block_ids, strict=True))
    for perm in itertools.permutations(keys([0, 1, 2])):
        assert m.prepare_load(list(perm)) == [row[k] for k in perm]
        m.complete_load(keys([0, 1, 2]))  # order irrelevant
    m.check_invariants()


def test_evictable_block_count():
    """vLLM's ``test_evictable_cache_block_count``; flush replaces reset."""
    m, _ = make("lru", 4)

    def evictable() -> int:
        return m.statistics().evictable_blocks

    assert evictable() == 0
    m.prepare_store(keys([1, 2, 3]))
    assert evictable() == 0
    m.complete_store(keys([1, 2, 3]), success=True)
    assert evictable() == 3

    m.prepare_load(keys([1]))
    assert evictable() == 2
    m.prepare_load(keys([1]))  # second concurrent load: no double decrement
    assert evictable() == 2
    m.complete_load(keys([1]))
    assert evictable() == 2
    m.complete_load(keys([1]))
    assert evictable() == 3

    m.prepare_store(keys([4, 5, 6]))  # 1 free row, 2 evictions
    assert evictable() == 1
    m.complete_store(keys([4, 5, 6]), success=False)
    assert evictable() == 1

    assert m.evict_all_evictable() == keys([1])
    assert evictable() == 0

    store(m, [10, 11, 12])
    m.prepare_load(keys([10, 11, 12]))
    assert evictable() == 0

    evict_calls: list[int] = []
    real_evict = m.policy.evict

    def spy_evict(n, protected):
        evict_calls.append(n)
        return real_evict(n, protected)

    m.policy.evict = spy_evict  # type: ignore[method-assign]
    assert m.prepare_store(keys([14, 15])) is None
    assert evict_calls == [], "no evictable block: refused before asking the policy"

    m.complete_load(keys([10, 11, 12]))
    assert evictable() == 3
    assert m.prepare_store(keys([14, 15])) is not None
    assert evict_calls == [1]
    assert evictable() == 2
    m.complete_store(keys([14, 15]), success=True)
    assert evictable() == 4
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_usage_counters_follow_writes_and_reads(policy):
    """The counts behind vLLM's usage gauges (write = pending, read = pinned)."""
    m, _ = make(policy, 4)

    def counts() -> tuple[int, int, int, int, int]:
        s = m.statistics()
        return s.used_blocks, s.pending_blocks, s.pinned_blocks, s.evictable_blocks, s.free_blocks

    assert counts() == (0, 0, 0, 0, 4)
    m.prepare_store(keys([1, 2]))
    assert counts() == (2, 2, 0, 0, 2)
    m.complete_store(keys([1, 2]), success=True)
    assert counts() == (2, 0, 0, 2, 2)
    m.prepare_load(keys([1]))
    assert counts() == (2, 0, 1, 1, 2)
    m.complete_load(keys([1]))
    assert counts() == (2, 0, 0, 2, 2)
    m.prepare_store(keys([3, 4]))
    m.prepare_load(keys([2]))
    assert counts() == (4, 2, 1, 1, 0)
    m.complete_store(keys([3, 4]), success=False)
    assert counts() == (2, 0, 1, 1, 2)
    s = m.statistics()
    assert (s.stored_blocks, s.failed_stores, s.evictions) == (2, 2, 0)
    m.check_invariants()


# ----------------------------------------------------------------- ARC (vLLM TestARCPolicy)


def test_arc_basic():
    m, events = make("arc", 4)
    assert m.prepare_store(keys([1, 2])) == grant([1, 2], [0, 1], [])
    assert m.lookup(keys([1, 2])) == [PENDING, PENDING]
    assert take(events) == []
    m.complete_store(keys([1, 2]), success=True)
    assert take(events) == [stored([1, 2])]
    assert m.lookup(keys([1, 2, 3])) == [HIT, HIT, MISS]
    stats = arc_of(m).statistics()
    assert (stats.t1, stats.t2) == (2, 0)


def test_arc_t1_to_t2_promotion():
    m, _ = make("arc", 4)
    store(m, [1])
    assert where(m, 1) == "t1"
    m.touch(keys([1]))
    assert where(m, 1) == "t2"


def test_arc_touch_of_pending_block_is_not_a_second_use():
    m, _ = make("arc", 4)
    m.prepare_store(keys([1, 2]))
    m.touch(keys([1]))
    assert arc_of(m).order("t1") == keys([2, 1])
    m.complete_store(keys([1, 2]), success=True)
    assert where(m, 1) == "t1"


def test_arc_eviction_with_load():
    m, _ = make("arc", 4)
    assert store(m, [1, 2, 3, 4]) == grant([1, 2, 3, 4], [0, 1, 2, 3], [])
    assert m.prepare_load(keys([2, 3])) == [1, 2]
    assert m.prepare_store(keys([5, 6, 7])) is None
    m.complete_load(keys([2, 3]))
    # ARC does not reorder on load completion: T1 is still [1, 2, 3, 4].
    assert m.prepare_store(keys([5, 6, 7])) == grant([5, 6, 7], [2, 1, 0], [1, 2, 3])


def test_arc_adaptive_target():
    m, _ = make("arc", 2)
    store(m, [1, 2])
    assert arc_of(m).target_t1_size == 0.0
    store(m, [3])  # evicts 1 into B1
    assert where(m, 1) == "b1"
    m.touch(keys([1]))  # a ghost hit: recency matters more
    assert arc_of(m).target_t1_size == 1.0
    assert 1 not in m  # a ghost is no block


@pytest.mark.parametrize(("target", "victim", "ghost"), [(1, 1, "b1"), (3, 4, "b2")])
def test_arc_t1_t2_eviction_policy(target, victim, ghost):
    m, _ = make("arc", 4)
    store(m, [1, 2, 3, 4])
    m.touch(keys([3, 4]))  # T1 = [1, 2], T2 = [4, 3]
    stats = arc_of(m).statistics()
    assert (stats.t1, stats.t2) == (2, 2)
    arc_of(m).target_t1_size = target
    g = m.prepare_store(keys([5]))
    assert g is not None and g.evicted_keys == keys([victim])
    m.complete_store(keys([5]), success=True)
    assert where(m, victim) == ghost
    assert where(m, 5) == "t1"


def test_arc_batch_eviction_through_manager():
    m, _ = make("arc", 6)
    store(m, [1, 2, 3, 4, 5, 6])
    m.touch(keys([6, 5]))  # T1 = [1, 2, 3, 4], T2 = [5, 6]
    m.prepare_load(keys([2]))
    arc_of(m).target_t1_size = 2
    # |T1| 4 >= 2 -> 1; virtual 3 >= 2 -> 3 (2 pinned); virtual 2 >= 2 -> 4;
    # T1 exhausted -> T2's LRU 5.
    g = m.prepare_store(keys([7, 8, 9, 10]))
    assert g == grant([7, 8, 9, 10], [4, 3, 2, 0], [1, 3, 4, 5])
    assert arc_of(m).order("b1") == keys([1, 3, 4])
    assert arc_of(m).order("b2") == keys([5])
    m.check_invariants()


def test_arc_refuses_when_t1_below_target_even_with_ready_t1_blocks():
    m, events = make("arc", 4)
    store(m, [1, 2, 3, 4])
    m.touch(keys([4]))
    m.prepare_load(keys([4]))  # the only T2 block is pinned
    arc_of(m).target_t1_size = 4  # |T1| = 3 < 4: ARC only looks at T2
    take(events)
    before = snapshot(m, list(range(1, 7)))
    assert m.statistics().evictable_blocks == 3
    assert m.prepare_store(keys([5])) is None
    assert snapshot(m, list(range(1, 7))) == before
    assert events == []


def test_arc_ghost_list_bounds():
    m, _ = make("arc", 2)
    store(m, [1, 2])
    for i in range(3, 20):
        store(m, [i])
        if i % 3 == 0:
            m.touch(keys([i]))  # some blocks reach T2 and, later, B2
    arc = arc_of(m)
    stats = arc.statistics()
    assert stats.b1 <= 2 and stats.b2 <= 2
    assert stats.b1 == 2 and stats.b2 >= 1


def test_arc_touch_ordering():
    m, _ = make("arc", 4)
    store(m, [1, 2, 3, 4])
    m.touch(keys([3, 4]))
    m.touch(keys([1, 3, 4]))
    assert arc_of(m).order("t1") == keys([2])
    assert arc_of(m).order("t2") == keys([4, 3, 1])  # the first key ends most recent
    assert m.prepare_store(keys([5])) == grant([5], [1], [2])


def test_arc_failed_store():
    m, _ = make("arc", 4)
    store(m, [1, 2, 3, 4])
    g = m.prepare_store(keys([5]))
    assert g == grant([5], [0], [1])
    assert m.complete_store(keys([5]), success=False) == keys([5])
    assert m.lookup(keys([5])) == [MISS]
    assert where(m, 5) is None  # not resident, and no ghost either
    assert where(m, 1) == "b1"
    assert m.prepare_store(keys([6])) == grant([6], [0], [])


def test_arc_full_scenario():
    m, events = make("arc", 4)
    assert store(m, [1, 2]) == grant([1, 2], [0, 1], [])
    assert store(m, [3, 4, 5]) == grant([3, 4, 5], [2, 3, 0], [1])
    m.touch(keys([2, 3]))
    arc = arc_of(m)
    assert arc.order("t1") == keys([4, 5])
    assert arc.order("t2") == keys([3, 2])
    assert store(m, [6]) == grant([6], [3], [4])
    assert m.lookup(keys([2, 3])) == [HIT, HIT]
    assert take(events) == [
        stored([1, 2]),
        removed([1]),
        stored([3, 4, 5]),
        removed([4]),
        stored([6]),
    ]
    assert arc.order("b1") == keys([1, 4])


# ----------------------------------------------------------------- refusals change nothing


def _setup_mixed(policy: str) -> tuple[PrimaryManager, list[BlockEvent]]:
    """4 rows: 1 pinned, 2 and 3 ready, 4 in flight; no free row. The events list
    receives the manager's events from here on."""
    m, events = make(policy, 4)
    store(m, [1, 2, 3])
    m.prepare_load(keys([1]))
    m.prepare_store(keys([4]))
    m.touch(keys([3]))
    events.clear()
    return m, events


REFUSALS: list[tuple[str, Callable[[PrimaryManager], object], type[Exception] | None]] = [
    ("store_fast_refusal", lambda m: m.prepare_store(keys([5, 6, 7])), None),
    ("store_protected_refusal", lambda m: m.prepare_store(keys([2, 5, 6])), None),
    ("load_miss_after_hit", lambda m: m.prepare_load(keys([2, 3, 5])), NotLoadableError),
    ("load_pending", lambda m: m.prepare_load(keys([3, 4])), NotLoadableError),
    ("complete_unpinned", lambda m: m.complete_load(keys([1, 2])), NotPinnedError),
    ("complete_absent", lambda m: m.complete_load(keys([1, 9])), NotPinnedError),
    ("complete_pending", lambda m: m.complete_load(keys([4])), NotPinnedError),
    ("complete_too_many", lambda m: m.complete_load(keys([1, 1])), NotPinnedError),
]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize(("call", "error"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_call_changes_nothing(policy, call, error):
    m, events = _setup_mixed(policy)
    universe = list(range(1, 10))
    before = snapshot(m, universe)
    if error is None:
        assert call(m) is None
    else:
        with pytest.raises(error):
            call(m)
    assert snapshot(m, universe) == before
    assert events == []
    m.check_invariants()


def test_not_loadable_error_names_key_and_state():
    m, _ = _setup_mixed("lru")
    with pytest.raises(NotLoadableError) as miss:
        m.prepare_load(keys([2, 5, 6]))
    assert miss.value.key == key(5) and miss.value.state is MISS
    assert isinstance(miss.value, KeyError)
    assert "MISS" in str(miss.value)
    with pytest.raises(NotLoadableError) as pending:
        m.prepare_load(keys([4]))
    assert pending.value.key == key(4) and pending.value.state is PENDING
    with pytest.raises(NotPinnedError) as unpinned:
        m.complete_load(keys([1, 3]))
    assert unpinned.value.key == key(3)
    assert isinstance(unpinned.value, KeyError)


# ----------------------------------------------------------------- store / load details


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_store_of_present_keys_is_empty_grant_even_when_full(policy):
    m, events = make(policy, 2)
    store(m, [1])
    m.prepare_store(keys([2]))
    m.prepare_load(keys([1]))
    take(events)
    before = snapshot(m, [1, 2])
    assert m.prepare_store(keys([1, 2, 1])) == StoreGrant([], [], [])
    assert m.prepare_store([]) == StoreGrant([], [], [])
    assert snapshot(m, [1, 2]) == before
    assert events == []


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_key_named_twice_in_store_is_reserved_once(policy):
    m, _ = make(policy, 4)
    assert m.prepare_store(keys([1, 2, 1])) == grant([1, 2], [0, 1], [])
    assert m.statistics().pending_blocks == 2
    m.check_invariants()


def test_slots_fresh_ascending_then_last_freed_first():
    m, _ = make("lru", 5)
    assert m.prepare_store(keys([1, 2, 3])) == grant([1, 2, 3], [0, 1, 2], [])
    assert m.complete_store(keys([3, 1]), success=False) == keys([3, 1])  # frees 2, then 0
    assert m.prepare_store(keys([4, 5, 6])) == grant([4, 5, 6], [3, 4, 0], [])
    assert m.prepare_store(keys([7])) == grant([7], [2], [])
    assert m.prepare_store(keys([8])) is None
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_complete_store_ignores_ready_and_absent_keys(policy):
    m, events = make(policy, 4)
    store(m, [1])
    m.prepare_store(keys([2, 3]))
    take(events)
    assert m.complete_store(keys([9, 1, 3]), success=True) == keys([3])
    assert take(events) == [stored([3])]
    assert m.complete_store(keys([3, 9]), success=True) == []
    assert m.complete_store(keys([1, 3, 9]), success=False) == []
    assert take(events) == []
    assert m.lookup(keys([1, 2, 3])) == [HIT, PENDING, HIT]
    assert m.complete_store(keys([1, 2, 2]), success=False) == keys([2])
    assert m.lookup(keys([2])) == [MISS]
    assert take(events) == []  # an aborted write was never announced
    s = m.statistics()
    assert (s.stored_blocks, s.failed_stores, s.used_blocks) == (2, 1, 2)
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_same_key_loaded_twice_in_one_call(policy):
    m, _ = make(policy, 4)
    store(m, [1, 2])
    assert m.prepare_load(keys([1, 1, 2])) == [0, 0, 1]
    assert m.ref_count(key(1)) == 2
    assert m.statistics().pinned_blocks == 2
    m.complete_load(keys([1, 1]))
    assert m.ref_count(key(1)) == 0
    assert m.statistics().evictable_blocks == 1
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_pinned_and_pending_blocks_are_never_evicted(policy):
    m, _ = make(policy, 3)
    store(m, [1, 2])
    m.prepare_load(keys([1]))
    m.prepare_store(keys([3]))
    assert m.prepare_store(keys([4])) == grant([4], [1], [2])
    assert m.prepare_store(keys([5])) is None
    assert m.lookup(keys([1, 3])) == [HIT, PENDING]


def test_lru_complete_load_and_store_count_as_use():
    m, _ = make("lru", 4)
    store(m, [1, 2, 3])
    m.prepare_load(keys([1]))
    m.touch(keys([1]))  # pinned: not reordered
    assert lru_of(m).evictable_order() == keys([2, 3])
    m.complete_load(keys([1]))
    assert lru_of(m).evictable_order() == keys([2, 3, 1])
    assert m.prepare_store(keys([4, 5])) == grant([4, 5], [3, 1], [2])


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_lookup_does_not_change_recency(policy):
    m, _ = make(policy, 3)
    store(m, [1, 2, 3])
    for _ in range(3):
        assert m.lookup(keys([1])) == [HIT]
    assert m.prepare_store(keys([4])) == grant([4], [0], [1])


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_touch_first_key_ends_most_recent(policy):
    m, _ = make(policy, 3)
    store(m, [1, 2, 3])
    m.touch(keys([1, 2]))  # ARC: both to T2; LRU: order 3, 2, 1
    assert m.prepare_store(keys([4])) == grant([4], [2], [3])
    m.complete_store(keys([4]), success=True)
    if policy == "arc":
        arc_of(m).target_t1_size = 2  # |T1| = 1 < 2: evict from T2
    assert m.prepare_store(keys([5])) == grant([5], [1], [2])


# ----------------------------------------------------------------- flush


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_evict_all_evictable_keeps_pinned_and_pending(policy):
    m, events = make(policy, 5)
    store(m, [1, 2, 3])
    m.prepare_load(keys([2]))
    m.prepare_store(keys([4]))
    take(events)
    assert m.evict_all_evictable() == keys([1, 3])
    assert take(events) == [removed([1, 3])]
    assert m.lookup(keys([1, 2, 3, 4])) == [MISS, HIT, MISS, PENDING]
    s = m.statistics()
    assert s == PrimaryStats(
        num_blocks=5,
        used_blocks=2,
        evictable_blocks=0,
        pinned_blocks=1,
        pending_blocks=1,
        free_blocks=3,
        evictions=2,
        stored_blocks=3,
        failed_stores=0,
    )
    assert m.evict_all_evictable() == []
    assert events == []
    # freed rows are reused last-freed first, after the never-used row 4
    assert m.prepare_store(keys([5, 6, 7])) == grant([5, 6, 7], [4, 2, 0], [])
    m.check_invariants()
    if policy == "arc":
        assert arc_of(m).statistics().b1 == 0  # a flush leaves no ghosts


# ----------------------------------------------------------------- construction, accessors


def test_accessors():
    m, _ = make("lru", 4)
    store(m, [1])
    m.prepare_store(keys([2]))
    m.prepare_load(keys([1]))
    assert len(m) == 2
    assert key(1) in m and key(3) not in m
    assert (m.ref_count(key(1)), m.ref_count(key(2)), m.ref_count(key(3))) == (1, -1, None)
    assert (m.block_id(key(1)), m.block_id(key(2)), m.block_id(key(3))) == (0, 1, None)
    assert m.num_blocks == 4 and m.policy_name == "lru"


def test_zero_blocks_refuses_every_store():
    m, _ = make("arc", 0)
    assert m.prepare_store(keys([1])) is None
    assert m.prepare_store([]) == StoreGrant([], [], [])
    assert m.statistics().free_blocks == 0


def test_bad_construction():
    with pytest.raises(ValueError, match="num_blocks"):
        PrimaryManager(-1)
    with pytest.raises(ValueError, match="supported: lru, arc"):
        PrimaryManager(4, "mru")


def test_no_callback_is_fine():
    m = PrimaryManager(1)
    store(m, [1])
    store(m, [2])
    assert m.statistics().evictions == 1


@pytest.mark.parametrize("seed", range(6))
def test_lru_manager_matches_ordereddict_model(seed):
    """Random store / load / touch / abort / flush calls on an LRU manager: grants,
    victims and the evictable order match a reference OrderedDict LRU, and the
    intrusive list holds a row iff its ref count is 0."""
    rng = random.Random(seed)
    num_blocks = 24
    m, _ = make("lru", num_blocks)
    refs: dict[bytes, int] = {}
    model: OrderedDict[bytes, None] = OrderedDict()
    universe = keys(list(range(60)))
    for step in range(1500):
        op = rng.random()
        batch = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
        if op < 0.35:
            new = list(dict.fromkeys(k for k in batch if k not in refs))
            need = len(new) - (num_blocks - len(refs))
            expected: list[bytes] | None = []
            if need > 0:
                expected = [k for k in model if k not in set(batch)][:need]
                if len(expected) < need:
                    expected = None
            g = m.prepare_store(batch)
            if expected is None:
                assert g is None
                continue
            assert g is not None and g.evicted_keys == expected and g.keys_to_store == new
            for k in expected:
                del model[k], refs[k]
            refs.update(dict.fromkeys(new, -1))
            if rng.random() < 0.8:
                success = rng.random() < 0.85
                pending = [k for k in dict.fromkeys(batch) if refs[k] == -1]
                assert m.complete_store(batch, success) == pending
                for k in pending:
                    if success:
                        refs[k] = 0
                        model[k] = None
                    else:
                        del refs[k]
        elif op < 0.45:
            done = m.complete_store(batch, True)
            assert done == [k for k in dict.fromkeys(batch) if refs.get(k) == -1]
            for k in done:
                refs[k] = 0
                model[k] = None
        elif op < 0.6:
            if any(refs.get(k, -1) < 0 for k in batch):
                with pytest.raises(NotLoadableError):
                    m.prepare_load(batch)
                continue
            m.prepare_load(batch)
            for k in batch:
                if refs[k] == 0:
                    del model[k]
                refs[k] += 1
        elif op < 0.75:
            pinned = [k for k, r in refs.items() for _ in range(max(r, 0))]
            release = rng.sample(pinned, min(len(pinned), rng.randint(1, 5)))
            m.complete_load(release)
            for k in release:
                refs[k] -= 1
                if refs[k] == 0:
                    model[k] = None
        elif op < 0.97:
            m.touch(batch)
            for k in reversed(batch):
                if k in model:
                    model.move_to_end(k)
        else:
            flushed = m.evict_all_evictable()
            assert set(flushed) == set(model)
            for k in flushed:
                del refs[k]
            model.clear()
        assert lru_of(m).evictable_order() == list(model)
        if step % 50 == 0:
            m.check_invariants()
    m.check_invariants()


# ----------------------------------------------------------------- quarantine


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_quarantined_rows_are_neither_mapped_nor_reused_until_released(policy):
    """Rows of writes aborted for an ended session stay out of use until their time."""
    manager = PrimaryManager(3, policy)
    manager.prepare_store([b"a", b"b"])
    assert manager.abort_and_quarantine([b"a", b"b", b"absent"], until=10.0) == [b"a", b"b"]
    manager.check_invariants()
    assert manager.lookup([b"a", b"b"]) == [LookupResult.MISS] * 2
    stats = manager.statistics()
    assert (stats.used_blocks, stats.free_blocks, stats.quarantined_blocks) == (0, 1, 2)
    assert stats.failed_stores == 2
    # one free row: two keys cannot be stored, and no quarantined row is handed out
    assert manager.prepare_store([b"x", b"y"]) is None
    grant = manager.prepare_store([b"x"])
    assert grant is not None and grant.block_ids == [2]
    assert manager.release_quarantine(9.9) == 0
    assert manager.next_quarantine_release == 10.0
    assert manager.release_quarantine(10.0) == 2
    assert manager.next_quarantine_release is None
    manager.check_invariants()
    grant = manager.prepare_store([b"y", b"z"])
    assert grant is not None and sorted(grant.block_ids) == [0, 1]
    manager.check_invariants()


def test_quarantines_are_released_in_their_order():
    manager = PrimaryManager(4)
    manager.prepare_store([b"a", b"b", b"c"])
    manager.abort_and_quarantine([b"a"], until=1.0)
    manager.abort_and_quarantine([b"b", b"c"], until=2.0)
    assert manager.release_quarantine(1.5) == 1
    manager.check_invariants()
    assert manager.statistics().quarantined_blocks == 2
    assert manager.release_quarantine(5.0) == 2
    manager.check_invariants()
    assert manager.statistics().free_blocks == 4


def test_a_ready_or_pinned_key_is_never_quarantined():
    """Only writes in flight are aborted; a completed block stays where it is."""
    manager = PrimaryManager(2)
    manager.prepare_store([b"a", b"b"])
    manager.complete_store([b"a"], success=True)
    manager.prepare_load([b"a"])
    assert manager.abort_and_quarantine([b"a", b"b"], until=1.0) == [b"b"]
    assert manager.lookup([b"a"]) == [LookupResult.HIT]
    manager.check_invariants()


def test_a_later_quarantine_does_not_hold_back_an_earlier_one():
    """A lane-ended session's rows are quarantined through its lease, so quarantines
    no longer arrive in time order: one queued later but due sooner is released at
    its own time, not behind the longer one (the queue is kept sorted)."""
    manager = PrimaryManager(4)
    manager.prepare_store([b"lane", b"expired"])
    manager.abort_and_quarantine([b"lane"], until=20.0)  # through the lease
    manager.abort_and_quarantine([b"expired"], until=5.0)
    assert manager.next_quarantine_release == 5.0
    assert manager.release_quarantine(6.0) == 1
    assert manager.release_quarantine(19.0) == 0
    assert manager.release_quarantine(20.0) == 1
    manager.check_invariants()
