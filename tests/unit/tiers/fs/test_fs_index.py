"""One pool's fs tier index (kvtierd.tiers.fs.index) without files: reservations,
LRU eviction, reads that pin files, the scan merge, and the invariants checked
after every step."""

from __future__ import annotations

import pytest

from kvtierd.contract import LookupResult
from kvtierd.tiers.fs.index import BlockIndex, DiskBudget, TierFull

FILE = 100  # bytes of one block file

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class Files:
    """Stands for the pool directory: records which evicted keys' files were removed."""

    def __init__(self) -> None:
        self.removed: list[bytes] = []

    def remove_evicted(self, key: bytes) -> None:
        self.removed.append(key)


def make(capacity_files: int, budget: DiskBudget | None = None) -> tuple[BlockIndex, Files]:
    files = Files()
    index = BlockIndex("t", FILE, budget or DiskBudget(capacity_files * FILE), files.remove_evicted)
    index.merge_scanned([])
    index.mark_scanned()
    return index, files


def store(index: BlockIndex, *keys: bytes) -> None:
    for key in keys:
        assert index.reserve_write(key)
    index.end_writes(list(keys), [True] * len(keys))
    index.check_invariants()


def test_lookups_retry_until_the_scan_merged_its_files() -> None:
    index = BlockIndex("t", FILE, DiskBudget(10 * FILE), Files().remove_evicted)
    assert index.lookup([b"a"]) == [RETRY] and index.contains(b"a") is None
    index.merge_scanned([(1.0, b"a", FILE)])
    assert not index.ready
    index.mark_scanned()
    assert index.ready and index.lookup([b"a", b"b"]) == [HIT, MISS]
    counters = index.statistics().counters
    assert (counters["hits"], counters["misses"]) == (1, 1)


def test_a_reservation_charges_the_budget_until_it_ends() -> None:
    budget = DiskBudget(10 * FILE)
    index, _ = make(10, budget)
    assert index.reserve_write(b"a")
    assert not index.reserve_write(b"a")  # being written: not twice
    stats = index.statistics()
    assert (stats.writing, stats.reserved_bytes, budget.charged) == (1, FILE, FILE)
    index.check_invariants()
    index.end_writes([b"a"], [False])  # the write failed: nothing indexed, nothing charged
    assert index.statistics().writing == 0 and budget.charged == 0
    assert index.lookup([b"a"]) == [MISS]
    store(index, b"a")
    assert budget.charged == FILE and index.statistics().used_bytes == FILE
    assert not index.reserve_write(b"a")  # present: touched, not rewritten


def test_a_write_at_capacity_evicts_the_least_recently_used_outside_the_lock() -> None:
    index, files = make(2)
    store(index, b"old", b"new")
    index.touch([b"old"])  # now b"new" is the least recently used
    assert index.reserve_write(b"third")
    assert files.removed == [b"new"]
    assert index.take_removed() == [b"new"] and index.take_removed() == []
    assert index.removals(b"new")[0][1] == "evicted: least recently used at capacity"
    stats = index.statistics()
    assert stats.counters["evictions"] == 1 and stats.evicting == 0
    index.check_invariants()


def test_a_file_being_read_is_never_evicted() -> None:
    index, files = make(1)
    store(index, b"read-me")
    index.begin_reads([b"read-me"])
    with pytest.raises(TierFull, match="nothing of this pool is evictable"):
        index.reserve_write(b"newcomer")
    index.check_invariants()
    index.end_reads([b"read-me"])
    assert index.reserve_write(b"newcomer") and files.removed == [b"read-me"]


def test_a_failed_eviction_still_uncharges_its_file() -> None:
    budget = DiskBudget(FILE)
    files = Files()

    def failing(key: bytes) -> None:
        raise RuntimeError("the file system went away")

    index = BlockIndex("t", FILE, budget, failing)
    index.merge_scanned([])
    index.mark_scanned()
    store(index, b"a")
    with pytest.raises(RuntimeError):
        index.reserve_write(b"b")
    assert budget.charged == 0 and index.statistics().evicting == 0
    assert files.removed == []
    index.check_invariants()


def test_blocks_written_during_the_scan_are_more_recent_than_scanned_ones() -> None:
    budget = DiskBudget(2 * FILE)
    files = Files()
    index = BlockIndex("t", FILE, budget, files.remove_evicted)
    assert index.reserve_write(b"written")  # the scan has not ended yet
    index.end_writes([b"written"], [True])
    assert index.merge_scanned([(2.0, b"found-2", FILE), (1.0, b"found-1", FILE)]) == 3
    assert budget.over  # 3 files charged, room for 2
    index.evict_to_capacity()
    assert files.removed == [b"found-1"]  # the oldest scanned file goes first
    index.mark_scanned()
    assert index.lookup([b"found-1", b"found-2", b"written"]) == [MISS, HIT, HIT]
    index.check_invariants()


def test_a_corrupt_file_replaced_meanwhile_keeps_its_key() -> None:
    index, _ = make(4)
    store(index, b"a", b"b")
    index.drop_corrupt(b"a", "payload checksum mismatch", lambda: True)
    assert index.lookup([b"a"]) == [HIT]
    index.drop_corrupt(b"b", "payload checksum mismatch", lambda: False)
    assert index.lookup([b"b"]) == [MISS]
    assert index.removals(b"b")[0][1] == (
        "file failed verification (payload checksum mismatch); dropped"
    )
    assert index.statistics().counters["checksum_failures"] == 2
    index.drop_vanished(b"a")
    assert index.take_removed() == [b"b", b"a"]
    index.check_invariants()


def test_pools_share_one_budget() -> None:
    budget = DiskBudget(2 * FILE)
    first, _ = make(0, budget)
    second, second_files = make(0, budget)
    store(first, b"a", b"b")
    with pytest.raises(TierFull):  # the room is the other pool's, and it evicts only its own
        second.reserve_write(b"c")
    assert second_files.removed == [] and budget.charged == 2 * FILE
