"""A shared fs root (kvtierd.tiers.fs.shared) with two FsTier instances in one process.

Each tier stands for one daemon: its own index, I/O threads and region rows,
one root directory. Real files under tmp_path; the shared-root thread runs for
real, or a rescan is called directly where a test needs it at a known moment.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import eventually_async
from fake_clock import FakeClock
from shm_leftovers import shm_tempdir
from test_fs_tier import BLOCK, FILE_BYTES, POOL, ROWS, Harness, run

from kvtierd.contract import LookupResult
from kvtierd.primary.region import Region
from kvtierd.tiers.fs import FsTier, fsformat
from kvtierd.tiers.fs.index import BlockIndex, DiskBudget, IndexedPool
from kvtierd.tiers.fs.settings import DEFAULTS
from kvtierd.tiers.fs.shared import MAX_WANTED, SharedRoot
from kvtierd.tiers.fs.unserved import UnservedPools

HIT, MISS = LookupResult.HIT, LookupResult.MISS
LONG_S = 3600.0  # a rescan interval no test waits for


@pytest.fixture
def region() -> Iterator[Region]:
    directory = shm_tempdir("kvtierd-fs-shared-test-")
    reg = Region.create(directory, POOL, ROWS, BLOCK, prefault=False)
    try:
        yield reg
    finally:
        reg.close()
        shutil.rmtree(directory, ignore_errors=True)


def shared_tier(harness: Harness, **kw: Any) -> Any:
    options: dict[str, Any] = dict(
        shared=True, shared_negative_ttl=0.05, shared_rescan_interval=LONG_S
    )
    options.update(kw)
    return harness.ready_tier(**options)


async def until(condition: Any, timeout: float = 10.0) -> None:
    await eventually_async(condition, timeout, "condition not met")


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + fsformat.BLOCK_SUFFIX))


def test_a_miss_is_looked_for_off_the_loop_and_the_next_lookup_hits(region: Region, tmp_path):
    async def body(h: Harness) -> None:
        a: FsTier = await shared_tier(h)
        b: FsTier = await shared_tier(h)
        data = h.fill(0, 7)
        assert (await h.store(a, [b"k1"], [0])).success
        assert b.lookup([b"k1"]) == [MISS]  # answered from the index, at once
        await until(lambda: b.index.contains(b"k1"))
        assert b.lookup([b"k1"]) == [HIT]
        h.region.row(1)[:] = bytes(len(data))
        assert (await h.load(b, [b"k1"], [1])).success
        assert h.read(1) == data
        stats = b.statistics()
        assert stats.foreign_files_found == 1 and stats.shared_rechecks == 1
        a.shutdown()
        b.shutdown()

    run(region, tmp_path, body)


def test_the_negative_cache_and_the_queue_bound(region: Region, tmp_path):
    async def body(h: Harness) -> None:
        tier: FsTier = await shared_tier(h, shared_negative_ttl=LONG_S)
        assert tier.lookup([b"absent"]) == [MISS]
        await until(lambda: tier.statistics().shared_rechecks == 1)
        for _ in range(20):
            assert tier.lookup([b"absent"]) == [MISS]
        answered = threading.Event()
        assert tier.shared.want([b"absent"], answered.set) == 0  # negative-cached
        # nothing queued or being checked for it (a check the lookups queued would be)
        assert answered.is_set() and tier.statistics().shared_rechecks == 1
        tier.shutdown()

    run(region, tmp_path, body)
    index = BlockIndex("fs", FILE_BYTES, DiskBudget(1 << 30), lambda key: None)
    pool = IndexedPool("fs", str(tmp_path), b"f" * 16, 4096, index)
    times = dataclasses.replace(DEFAULTS, shared_negative_ttl=1.0, shared_rescan_interval=LONG_S)
    idle = SharedRoot(pool, times)
    keys = [i.to_bytes(4, "big") for i in range(MAX_WANTED + 10)]
    assert idle.want(keys) == MAX_WANTED  # bounded: the rest answer MISS unqueued
    assert idle.want(keys) == 0  # queued already


def test_a_rescan_accounts_every_file_and_evicts_whoever_wrote_them(region: Region, tmp_path):
    async def body(h: Harness) -> None:
        writer: FsTier = await shared_tier(h)  # a large budget of its own
        bounded: FsTier = await shared_tier(h, capacity_bytes=3 * FILE_BYTES)
        for i in range(6):
            h.fill(i % 8, i)
            assert (await h.store(writer, [b"w%d" % i], [i % 8])).success
        assert len(block_files(tmp_path)) == 6
        assert bounded.statistics().used_bytes == 0
        bounded.shared.rescan()  # type: ignore[union-attr]
        stats = bounded.statistics()
        assert stats.used_bytes <= 3 * FILE_BYTES and stats.foreign_files_found == 6
        assert stats.evictions == 3 and stats.shared_rescans == 1
        assert len(block_files(tmp_path)) == 3  # the other daemon's files, evicted
        # the writer's next promotion of an evicted file: MISS, dropped from its index
        left = {path.name for path in block_files(tmp_path)}
        gone = [
            k for k in (b"w%d" % i for i in range(6)) if fsformat.block_file_name(k) not in left
        ]
        result = await h.load(writer, gone[:1], [0])
        assert not result.success
        assert writer.statistics().shared_files_vanished == 1
        writer.shared.rescan()  # type: ignore[union-attr]
        assert writer.statistics().blocks == 3
        bounded.index.check_invariants()
        writer.index.check_invariants()
        writer.shutdown()
        bounded.shutdown()

    run(region, tmp_path, body)


def test_drop_absent_spares_keys_used_since_the_rescan_began_and_reads():
    removed: list[bytes] = []
    clock = FakeClock()
    index = BlockIndex("fs", FILE_BYTES, DiskBudget(1 << 30), removed.append, clock=clock)
    index.mark_scanned()
    for key in (b"old", b"read", b"fresh"):
        assert index.adopt(key, FILE_BYTES)
    since = clock.advance(1.0)  # a rescan begins
    index.touch([b"fresh"])  # used since
    index.begin_reads([b"read"])
    assert index.drop_absent([b"old", b"read", b"fresh", b"unknown"], since) == 1
    assert index.contains(b"old") is False
    assert index.contains(b"read") and index.contains(b"fresh")
    index.end_reads([b"read"])
    assert not index.adopt(b"fresh", FILE_BYTES)  # indexed already: nothing changes
    index.check_invariants()
    assert removed == []  # dropping a vanished file removes nothing on disk


@pytest.mark.parametrize("bad", ["temp", "torn"])
def test_temp_names_and_torn_files_are_never_adopted(region: Region, tmp_path, bad):
    async def body(h: Harness) -> None:
        writer: FsTier = await shared_tier(h)
        h.fill(0, 1)
        assert (await h.store(writer, [b"x"], [0])).success
        writer.shutdown()
        (path,) = block_files(tmp_path)
        if bad == "temp":
            path.rename(path.with_name(path.name + ".abc-1" + fsformat.TEMP_SUFFIX))
        else:
            os.truncate(path, FILE_BYTES - 1)
        reader: FsTier = await shared_tier(h)
        assert reader.lookup([b"x"]) == [MISS]
        await until(lambda: reader.statistics().shared_rechecks == 1)
        reader.shared.rescan()  # type: ignore[union-attr]
        stats = reader.statistics()
        assert stats.foreign_files_found == 0 and stats.blocks == 0
        assert stats.checksum_failures == (1 if bad == "torn" else 0)
        assert reader.lookup([b"x"]) == [MISS]
        reader.shutdown()

    run(region, tmp_path, body)


def test_unserved_pools_are_charged_until_a_pool_here_serves_them(tmp_path):
    budget = DiskBudget(10 * FILE_BYTES)
    unserved = UnservedPools("fs", str(tmp_path), budget, interval=LONG_S)
    for pool, files in (("other-1", 3), ("mine-2", 2)):
        directory = tmp_path / pool / "ab" / "cd"
        directory.mkdir(parents=True)
        for i in range(files):
            (directory / f"{pool}{i}{fsformat.BLOCK_SUFFIX}").write_bytes(bytes(FILE_BYTES))
        (directory / f"x{fsformat.TEMP_SUFFIX}").write_bytes(bytes(FILE_BYTES))  # never counted
    os.symlink(tmp_path / "other-1", tmp_path / "link")  # never followed
    assert unserved.recount_if_due()
    assert budget.unserved == budget.charged == 5 * FILE_BYTES
    assert not unserved.recount_if_due()  # not due yet
    unserved.serve("mine-2")  # a pool attaches: its files are its own index's now
    assert budget.unserved == budget.charged == 3 * FILE_BYTES
    assert budget.try_charge(7 * FILE_BYTES) and not budget.try_charge(1)
    budget.release(7 * FILE_BYTES)
    with pytest.raises(AssertionError):
        budget.release(1)  # the unserved charge is never released by a pool


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_planted_entry_at_a_keys_path_is_never_followed_or_waited_on(
    region: Region, tmp_path, planted
):
    async def body(h: Harness) -> None:
        elsewhere = tmp_path / "elsewhere"
        other = Harness(h.region, elsewhere)
        writer: FsTier = await shared_tier(other)  # a valid file of the key, outside the root
        h.fill(0, 3)
        assert (await other.store(writer, [b"k"], [0])).success
        writer.shutdown()
        (valid,) = block_files(elsewhere)
        root = tmp_path / "root"
        reader: FsTier = await shared_tier(Harness(h.region, root))
        path = Path(reader.pool_dir) / fsformat.block_rel_path(b"k")
        path.parent.mkdir(parents=True)
        if planted == "symlink":
            path.symlink_to(valid)
        else:
            os.mkfifo(path)
        assert reader.lookup([b"k"]) == [MISS]
        await until(lambda: reader.statistics().shared_rechecks == 1)
        stats = reader.statistics()
        assert stats.foreign_files_found == 0 and stats.checksum_failures == 1
        assert not path.exists() and not path.is_symlink()  # removed, the target kept
        assert valid.exists()
        assert reader.lookup([b"k"]) == [MISS]
        reader.shutdown()

    run(region, tmp_path, body)


def test_a_key_being_checked_is_not_queued_again(tmp_path, monkeypatch):
    """Lookups that come while the key's check is on disk (the fast lane answers 30
    lookups in a few ms) queue no second check: the check's answer is the next."""
    index = BlockIndex("fs", FILE_BYTES, DiskBudget(1 << 30), lambda key: None)
    pool = IndexedPool("fs", str(tmp_path), b"f" * 16, 4096, index)
    times = dataclasses.replace(DEFAULTS, shared_negative_ttl=LONG_S, shared_rescan_interval=LONG_S)
    shared = SharedRoot(pool, times)
    on_disk, release = threading.Event(), threading.Event()
    checked: list[list[bytes]] = []

    def slow_check(keys: list[bytes]) -> None:
        checked.append(list(keys))
        on_disk.set()
        release.wait(10)
        shared._remember_absent(keys)

    monkeypatch.setattr(shared, "_check_keys", slow_check)
    shared.start()
    try:
        assert shared.want([b"k"]) == 1
        assert on_disk.wait(10)
        assert shared.want([b"k"]) == 0  # taken by the check in progress
        release.set()
        answered = threading.Event()
        assert shared.want([b"k"], answered.set) == 0  # being checked, or negative-cached
        # its check answered; a second one, had a lookup queued it, would have run first
        assert answered.wait(10)
        assert checked == [[b"k"]]
    finally:
        release.set()
        shared.stop()
