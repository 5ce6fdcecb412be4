"""Eviction policies on their own, driven the way PrimaryManager drives them
(docs/design/semantics.md, "Eviction policies": vLLM's LRUCachePolicy and ARCCachePolicy)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvtierd.contract import EVICTION_POLICIES
from kvtierd.primary.policies import (
    ARCPolicy,
    ArcStats,
    CachePolicy,
    LRUPolicy,
    make_policy,
)


def keys(ints: list[int]) -> list[bytes]:
    return [str(i).encode() + b"\0\0\0\0" for i in ints]


def key(i: int) -> bytes:
    return keys([i])[0]


def no_row(k: bytes, default: int | None = None) -> int | None:
    return default  # a RowOf: dict.get's signature


def no_key(row: int) -> bytes | None:
    return None


class Table:
    """Stands in for the manager's block table (rows, ref counts) and drives the
    policy hooks."""

    def __init__(self, name: str, capacity: int = 4, rows: int = 2048) -> None:
        self.refs: dict[bytes, int] = {}
        self.row_of: dict[bytes, int] = {}
        self.key_of: list[bytes | None] = [None] * rows
        self.free = list(range(rows - 1, -1, -1))
        self.calls = 0
        # ARC's capacity bounds its ghosts; LRU needs one slot per row.
        self.policy = make_policy(
            name,
            capacity if name == "arc" else rows,
            self.ref_count,
            self.row_of.get,
            self.key_of.__getitem__,
        )

    def ref_count(self, k: bytes) -> int:
        self.calls += 1
        return self.refs[k]

    def map_row(self, k: bytes) -> None:
        """Gives ``k`` a free row, as the manager's block table does on a reservation."""
        row = self.free.pop()
        self.row_of[k] = row
        self.key_of[row] = k

    def unmap_row(self, k: bytes) -> None:
        """Frees ``k``'s row (evicted or removed)."""
        row = self.row_of.pop(k)
        self.key_of[row] = None
        self.free.append(row)
        del self.refs[k]

    def store(self, ints: list[int]) -> None:
        """Insert (ref -1), then complete (ref 0)."""
        for k in keys(ints):
            self.refs[k] = -1
            self.map_row(k)
            self.policy.insert(k)
        for k in keys(ints):
            self.refs[k] = 0
            self.policy.mark_evictable(k)

    def reserve(self, ints: list[int]) -> None:
        for k in keys(ints):
            self.refs[k] = -1
            self.map_row(k)
            self.policy.insert(k)

    def pin(self, ints: list[int]) -> None:
        for k in keys(ints):
            if self.refs[k] == 0:
                self.refs[k] = 1
                self.policy.mark_non_evictable(k)
            else:
                self.refs[k] += 1

    def unpin(self, ints: list[int]) -> None:
        for k in keys(ints):
            self.refs[k] -= 1
            if self.refs[k] == 0:
                self.policy.mark_evictable(k)

    def evict(self, n: int, protected: list[int] | None = None) -> list[bytes] | None:
        victims = self.policy.evict(n, set(keys(protected or [])))
        for k in victims or ():
            self.unmap_row(k)
        return victims

    def remove(self, ints: list[int]) -> None:
        for k in keys(ints):
            self.policy.remove(k)
            self.unmap_row(k)

    @property
    def lru(self) -> LRUPolicy:
        assert isinstance(self.policy, LRUPolicy)
        return self.policy

    @property
    def arc(self) -> ARCPolicy:
        assert isinstance(self.policy, ARCPolicy)
        return self.policy


def arc_state(policy: ARCPolicy) -> tuple[list[bytes], ...]:
    return (policy.order("t1"), policy.order("t2"), policy.order("b1"), policy.order("b2"))


# ----------------------------------------------------------------- registry


def test_registry_names():
    assert EVICTION_POLICIES == ("lru", "arc")
    assert isinstance(make_policy("lru", 4, lambda k: 0, no_row, no_key), LRUPolicy)
    assert isinstance(make_policy("arc", 4, lambda k: 0, no_row, no_key), ARCPolicy)
    for name in EVICTION_POLICIES:
        policy = make_policy(name, 7, lambda k: 0, no_row, no_key)
        assert isinstance(policy, CachePolicy)
        assert policy.capacity == 7


@pytest.mark.parametrize("name", ["LRU", "fifo", "", None])
def test_registry_unknown_name_lists_supported(name):
    with pytest.raises(ValueError, match=r"supported: lru, arc"):
        make_policy(name, 4, lambda k: 0, no_row, no_key)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_negative_capacity_rejected(name):
    with pytest.raises(ValueError, match="capacity"):
        make_policy(name, -1, lambda k: 0, no_row, no_key)


# ----------------------------------------------------------------- shared


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_evict_zero_is_empty(name):
    t = Table(name)
    t.store([1])
    assert t.evict(0) == []
    assert t.evict(1) == keys([1])


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_evict_only_ready_unprotected(name):
    t = Table(name)
    t.store([1, 2, 3])
    t.reserve([4])
    t.pin([1])
    # 1 pinned, 4 pending, 2 protected: only 3 can go.
    assert t.evict(2, protected=[2]) is None
    assert t.evict(1, protected=[2]) == keys([3])
    assert t.evict(1, protected=[2]) is None
    t.unpin([1])
    # LRU: 1 re-entered at the MRU end; ARC: readiness does not reorder T1.
    assert t.evict(2) == (keys([2, 1]) if name == "lru" else keys([1, 2]))


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_clear_forgets_everything(name):
    t = Table(name)
    t.store([1, 2])
    t.policy.clear()
    assert t.policy.evict(1, set()) is None


# ----------------------------------------------------------------- LRU


def test_lru_insert_is_not_evictable_until_completed():
    t = Table("lru")
    t.reserve([1])
    assert t.lru.evictable_order() == []
    assert t.evict(1) is None
    t.refs[key(1)] = 0
    t.policy.mark_evictable(key(1))
    assert t.lru.evictable_order() == keys([1])


def test_lru_completion_appends_at_mru_end():
    t = Table("lru")
    t.store([1, 2, 3])
    assert t.lru.evictable_order() == keys([1, 2, 3])
    t.pin([1])
    assert t.lru.evictable_order() == keys([2, 3])
    t.unpin([1])
    assert t.lru.evictable_order() == keys([2, 3, 1])


def test_lru_touch_reverse_order_first_key_most_recent():
    t = Table("lru")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([1, 2]))
    assert t.lru.evictable_order() == keys([3, 4, 2, 1])
    t.policy.touch(keys([4, 3, 2]))
    assert t.lru.evictable_order() == keys([1, 2, 3, 4])


def test_lru_touch_ignores_pinned_pending_and_absent():
    t = Table("lru")
    t.store([1, 2, 3])
    t.pin([1])
    t.reserve([4])
    t.policy.touch(keys([1, 4, 9, 2]))
    assert t.lru.evictable_order() == keys([3, 2])
    t.unpin([1])  # re-enters at the MRU end, whatever the touch said
    assert t.lru.evictable_order() == keys([3, 2, 1])


def test_lru_evict_lru_first_skipping_protected():
    t = Table("lru")
    t.store([1, 2, 3, 4])
    assert t.evict(2, protected=[1, 3]) == keys([2, 4])
    assert t.lru.evictable_order() == keys([1, 3])


def test_lru_failed_evict_changes_nothing():
    t = Table("lru")
    t.store([1, 2, 3])
    assert t.evict(3, protected=[2]) is None
    assert t.lru.evictable_order() == keys([1, 2, 3])
    assert len(t.lru) == 3


def test_lru_remove_any_state():
    t = Table("lru")
    t.store([1, 2])
    t.reserve([3])
    t.remove([3])
    t.remove([1])
    assert t.lru.evictable_order() == keys([2])


# ----------------------------------------------------------------- ARC


def test_arc_insert_into_t1_and_out_of_ghosts():
    t = Table("arc", capacity=2)
    t.store([1, 2])
    t.policy.touch(keys([2]))
    assert t.evict(2) == keys([1, 2])  # 1 from T1 -> B1, 2 from T2 -> B2
    assert arc_state(t.arc) == ([], [], keys([1]), keys([2]))
    t.reserve([1, 2])
    assert arc_state(t.arc) == (keys([1, 2]), [], [], [])
    assert t.arc.statistics() == ArcStats(t1=2, t2=0, b1=0, b2=0, target_t1_size=0.0)


def test_arc_touch_promotes_ready_t1_to_t2():
    t = Table("arc")
    t.store([1, 2])
    t.policy.touch(keys([1]))
    assert t.arc.location(key(1)) == "t2"
    assert t.arc.location(key(2)) == "t1"


def test_arc_touch_pinned_t1_promotes():
    t = Table("arc")
    t.store([1])
    t.pin([1])
    t.policy.touch(keys([1]))
    assert t.arc.location(key(1)) == "t2"


def test_arc_touch_pending_t1_stays_in_t1_at_mru():
    t = Table("arc")
    t.reserve([1, 2, 3])
    t.policy.touch(keys([1]))
    assert arc_state(t.arc) == (keys([2, 3, 1]), [], [], [])


def test_arc_touch_t2_reverse_order_first_key_most_recent():
    t = Table("arc")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([3, 4]))
    assert t.arc.order("t2") == keys([4, 3])
    t.policy.touch(keys([1, 3, 4]))
    assert t.arc.order("t1") == keys([2])
    assert t.arc.order("t2") == keys([4, 3, 1])


def test_arc_touch_absent_key_is_ignored():
    t = Table("arc")
    t.store([1])
    before = (arc_state(t.arc), t.arc.statistics())
    t.policy.touch(keys([7]))
    assert (arc_state(t.arc), t.arc.statistics()) == before


def _ghosts(t: Table, b1: list[int], b2: list[int]) -> None:
    """Puts ``b1`` in B1 and ``b2`` in B2 (capacity permitting), nothing resident."""
    t.store(b1 + b2)
    t.policy.touch(keys(b2))
    t.arc.target_t1_size = 0
    assert t.evict(len(b1) + len(b2)) == keys(b1) + keys(list(reversed(b2)))


def test_arc_b1_hit_raises_target_by_ratio():
    t = Table("arc", capacity=8)
    _ghosts(t, b1=[1], b2=[2, 3, 4])
    t.policy.touch(keys([1]))
    assert t.arc.target_t1_size == 3.0  # max(1, |B2| / |B1|) = 3
    assert t.arc.order("b1") == keys([1])
    t.policy.touch(keys([1]))
    assert t.arc.target_t1_size == 6.0
    t.policy.touch(keys([1]))
    assert t.arc.target_t1_size == 8.0  # capped at capacity


def test_arc_b1_hit_raises_target_by_at_least_one_and_refreshes():
    t = Table("arc", capacity=8)
    _ghosts(t, b1=[1, 2, 3], b2=[4])
    t.policy.touch(keys([1]))
    assert t.arc.target_t1_size == 1.0  # max(1, 1/3)
    assert t.arc.order("b1") == keys([2, 3, 1])


def test_arc_b2_hit_lowers_target_by_ratio_floored_at_zero():
    t = Table("arc", capacity=8)
    _ghosts(t, b1=[1, 2, 3, 4], b2=[5, 6])
    t.arc.target_t1_size = 5
    t.policy.touch(keys([6]))
    assert t.arc.target_t1_size == 3.0  # max(1, 4/2) = 2
    assert t.arc.order("b2") == keys([5, 6])  # refreshed at the MRU end
    t.policy.touch(keys([5]))
    assert t.arc.target_t1_size == 1.0
    t.policy.touch(keys([5]))
    assert t.arc.target_t1_size == 0.0


def test_arc_target_setter_validates():
    t = Table("arc", capacity=4)
    with pytest.raises(ValueError, match="target_t1_size"):
        t.arc.target_t1_size = 5
    with pytest.raises(ValueError, match="target_t1_size"):
        t.arc.target_t1_size = -0.5


def test_arc_evicts_t1_while_t1_at_least_target():
    t = Table("arc")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([3, 4]))  # T1 = [1, 2], T2 = [4, 3]
    t.arc.target_t1_size = 1
    assert t.evict(1) == keys([1])
    assert t.arc.location(key(1)) == "b1"


def test_arc_evicts_t2_while_t1_below_target():
    t = Table("arc")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([3, 4]))  # T1 = [1, 2], T2 = [4, 3]
    t.arc.target_t1_size = 3
    assert t.evict(1) == keys([4])
    assert t.arc.location(key(4)) == "b2"


def test_arc_virtual_t1_size_switches_to_t2_mid_batch():
    t = Table("arc", capacity=8)
    t.store([1, 2, 3, 4, 5])
    t.policy.touch(keys([5, 4]))  # T1 = [1, 2, 3], T2 = [4, 5]
    t.arc.target_t1_size = 2
    # |T1| 3 >= 2 -> 1; virtual 2 >= 2 -> 2; virtual 1 < 2 -> T2's LRU 4.
    assert t.evict(3) == keys([1, 2, 4])
    assert arc_state(t.arc) == (keys([3]), keys([5]), keys([1, 2]), keys([4]))


def test_arc_target_is_truncated_to_int():
    t = Table("arc")
    t.store([1, 2])
    t.policy.touch(keys([2]))  # T1 = [1], T2 = [2]
    t.arc.target_t1_size = 1.9
    assert t.evict(1) == keys([1])  # 1 >= int(1.9)


def test_arc_batch_eviction_scans_t1_and_t2_once():
    t = Table("arc", capacity=1000)
    t.store(list(range(1000)))
    t.policy.touch(keys(list(range(500, 1000))))  # T2 = [999, 998, ..., 500]
    t.pin([0, 2])
    t.calls = 0
    victims = t.evict(600, protected=[4])
    expected_t1 = [i for i in range(500) if i not in (0, 2, 4)]
    expected_t2 = list(range(999, 999 - (600 - len(expected_t1)), -1))
    assert victims == keys(expected_t1) + keys(expected_t2)
    # one pass over T1 and the T2 prefix, not one rescan per victim
    assert t.calls <= 500 + len(expected_t2)


def test_arc_batch_eviction_falls_back_after_t1_iterator_exhausted():
    t = Table("arc")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([4, 3]))  # T1 = [1, 2], T2 = [3, 4]
    t.pin([2])
    # T1 has only 1; the rest comes from T2 in LRU order.
    assert t.evict(3) == keys([1, 3, 4])
    assert arc_state(t.arc) == (keys([2]), [], keys([1]), keys([3, 4]))


def test_arc_never_falls_back_to_t1_below_target():
    t = Table("arc")
    t.store([1, 2, 3])
    t.policy.touch(keys([3]))  # T1 = [1, 2], T2 = [3]
    t.pin([3])
    t.arc.target_t1_size = 3
    # Ready T1 blocks exist, but |T1| < target sends ARC to T2 only (upstream quirk).
    assert t.evict(1) is None
    t.arc.target_t1_size = 2
    assert t.evict(1) == keys([1])


def test_arc_batch_eviction_failure_is_atomic():
    t = Table("arc")
    t.store([1, 2, 3, 4])
    t.policy.touch(keys([4]))
    assert t.evict(1) == keys([1])  # B1 = [1]
    t.reserve([5])
    t.pin([3])
    t.arc.target_t1_size = 0.5
    before = (arc_state(t.arc), t.arc.statistics())
    assert t.evict(3) is None  # only 2 and 4 are ready
    assert (arc_state(t.arc), t.arc.statistics()) == before


def test_arc_ghost_lists_trimmed_lru_first():
    t = Table("arc", capacity=2)
    for i in range(1, 6):
        t.store([i])
        if len(t.refs) > 2:
            t.evict(1)
    assert t.arc.order("b1") == keys([2, 3])
    t.store([10, 11])
    t.policy.touch(keys([10, 11, 4, 5]))  # all resident -> T2
    t.arc.target_t1_size = 2
    assert t.evict(4) == keys([5, 4, 11, 10])  # |T2| < target: T2 only
    assert t.arc.order("b2") == keys([11, 10])
    assert t.arc.statistics().b1 <= 2


def test_arc_remove_leaves_ghosts_and_adds_none():
    t = Table("arc")
    t.store([1, 2, 3])
    assert t.evict(1) == keys([1])
    t.policy.touch(keys([3]))
    t.remove([2, 3])
    assert arc_state(t.arc) == ([], [], keys([1]), [])


def test_arc_clear_resets_target():
    t = Table("arc", capacity=2)
    _ghosts(t, b1=[1], b2=[])
    t.policy.touch(keys([1]))
    assert t.arc.target_t1_size == 1.0
    t.policy.clear()
    assert t.arc.statistics() == ArcStats(t1=0, t2=0, b1=0, b2=0, target_t1_size=0.0)


def test_arc_ready_hooks_do_not_reorder():
    t = Table("arc")
    t.store([1, 2, 3])
    t.pin([1])
    t.unpin([1])
    assert t.arc.order("t1") == keys([1, 2, 3])


# ----------------------------------------------------------------- LRU list vs a model


def test_lru_rows_hooks_match_key_hooks():
    t = Table("lru")
    t.store([1, 2, 3, 4])
    rows = [t.row_of[k] for k in keys([2, 4])]
    for k in keys([2, 4]):
        t.refs[k] = 1
    t.lru.mark_non_evictable_rows(rows)
    assert t.lru.evictable_order() == keys([1, 3])
    for k in keys([4, 2]):
        t.refs[k] = 0
    t.lru.mark_evictable_rows(rows[::-1])
    assert t.lru.evictable_order() == keys([1, 3, 4, 2])
    assert len(t.lru) == 4
    t.lru.remove_rows([t.row_of[key(3)]])
    t.remove([3])
    assert t.lru.evictable_order() == keys([1, 4, 2])
    assert t.lru.evictable_rows() == [t.row_of[k] for k in keys([1, 4, 2])]


def test_lru_clear_then_reuse():
    t = Table("lru")
    t.store([1, 2])
    t.policy.clear()
    assert len(t.lru) == 0 and t.lru.evictable_order() == []
    t.refs.clear()
    t.row_of.clear()
    t.store([3, 4])
    assert t.evict(1) == keys([3])


@pytest.mark.parametrize("seed", range(8))
def test_lru_list_matches_ordereddict_model(seed):
    """Random stores, pins, unpins, touches, evictions and removals: the intrusive
    list orders exactly as the OrderedDict LRU it replaced."""
    rng = random.Random(seed)
    t = Table("lru", rows=48)
    model: OrderedDict[bytes, None] = OrderedDict()
    next_id = 0
    for _ in range(3000):
        present = list(t.refs)
        op = rng.random()
        if op < 0.25 and len(t.refs) < 48:
            n = min(rng.randint(1, 6), 48 - len(t.refs))
            ints = list(range(next_id, next_id + n))
            next_id += n
            if rng.random() < 0.2:
                t.reserve(ints)
            else:
                t.store(ints)
                model.update(dict.fromkeys(keys(ints)))
        elif op < 0.35 and present:
            pending = [k for k in present if t.refs[k] == -1]
            for k in pending[: rng.randint(1, 4)]:
                t.refs[k] = 0
                t.policy.mark_evictable(k)
                model[k] = None
        elif op < 0.5 and present:
            for k in rng.sample(present, min(len(present), rng.randint(1, 5))):
                if t.refs[k] == 0:
                    t.refs[k] = 1
                    t.policy.mark_non_evictable(k)
                    del model[k]
                elif t.refs[k] > 0:
                    t.refs[k] += 1
        elif op < 0.65 and present:
            for k in rng.sample(present, min(len(present), rng.randint(1, 5))):
                if t.refs[k] > 0:
                    t.refs[k] -= 1
                    if t.refs[k] == 0:
                        t.policy.mark_evictable(k)
                        model[k] = None
        elif op < 0.85:
            pool = present + keys([next_id + 1000])
            touched = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
            if rng.random() < 0.6:
                # Slices of the current order, forward or reversed: runs and blocks.
                order = list(model)
                touched = []
                for _ in range(rng.randint(1, 3)):
                    a = rng.randrange(len(order) + 1)
                    piece = order[a : a + rng.randint(1, 12)]
                    touched += piece[::-1] if rng.random() < 0.5 else piece
                if rng.random() < 0.3:
                    touched.insert(rng.randint(0, len(touched)), rng.choice(pool))
            t.policy.touch(touched)
            for k in reversed(touched):
                if k in model:
                    model.move_to_end(k)
        elif op < 0.95:
            n = rng.randint(0, 6)
            protected = set(rng.sample(present, min(len(present), rng.randint(0, 4))))
            expected: list[bytes] | None = [k for k in model if k not in protected][:n]
            if len(expected) < n:  # type: ignore[arg-type]
                expected = None
            got = t.policy.evict(n, protected)
            assert got == expected
            for k in got or ():
                del model[k]
                t.unmap_row(k)
        elif present:
            k = rng.choice(present)
            t.remove([int(k.rstrip(b"\0"))])
            model.pop(k, None)
        assert t.lru.evictable_order() == list(model)
        assert len(t.lru) == len(model)
        assert all(t.lru.is_evictable_row(t.row_of[k]) == (k in model) for k in t.refs)
