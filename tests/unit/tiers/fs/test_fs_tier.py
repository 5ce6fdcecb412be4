"""The FS tier (kvtierd.tiers.fs): real files under tmp_path, a real Region in /dev/shm.

Every test drives the tier inside ``asyncio.run`` and waits for ``on_done`` through
futures; scans, reads and writes are held with threading.Events at the tier's public
hooks (``before_scan``, ``block_io``), never with sleeps.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtierd.contract import LookupResult
from kvtierd.primary.region import Region
from kvtierd.tiers import blockformat
from kvtierd.tiers.base import JobResult, TierJob
from kvtierd.tiers.configured import PoolBinding
from kvtierd.tiers.fs import FsTier, FsTierError, PoolMismatchError, fsformat, iowire, safefs
from kvtierd.tiers.fs.blockio import BlockIo, InlineIo, IoWorkers, WorkerStalled
from kvtierd.tiers.fs.fsck import fsck
from kvtierd.tiers.fs.iowire import Reply
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.fs.tier import FsTierProbes, SharedParts
from kvtierd.tiers.iopool import IoPool, PoolShutDown

BLOCK = 16384
ROWS = 8
FILE_BYTES = blockformat.HEADER_SIZE + BLOCK
POOL = "test/pool:1"
LONG_KEY = bytes(range(200))


@pytest.fixture
def region() -> Iterator[Region]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="kvtierd-fs-test-", dir=base)
    reg = Region.create(directory, POOL, ROWS, BLOCK, prefault=False)
    try:
        yield reg
    finally:
        reg.close()
        shutil.rmtree(directory, ignore_errors=True)


class Harness:
    """Builds tiers on the running loop and turns on_done callbacks into futures."""

    def __init__(
        self, region: Region, root: Path, o_direct: str = "auto", io_processes: int = 0
    ) -> None:
        self.region = region
        self.o_direct = o_direct
        # io_processes > 0: block I/O in worker processes, as the daemon does by default
        self.workers = IoWorkers(io_processes, channels=4) if io_processes else None
        self.root = root
        self.loop = asyncio.get_running_loop()
        self.waiters: dict[int, asyncio.Future[JobResult]] = {}
        self.calls: Counter[int] = Counter()
        self.next_job = 0

    def on_done(self, result: JobResult) -> None:
        assert threading.current_thread() is threading.main_thread()
        self.calls[result.job_id] += 1
        self.waiters[result.job_id].set_result(result)

    def tier(
        self,
        *,
        capacity_bytes: int = 1 << 30,
        before_scan: Callable[[], object] | None = None,
        block_io: BlockIo | None = None,
        **settings: Any,
    ) -> FsTier:
        """An FsTier of this harness's pool under ``root``: ``settings`` are FsTierSettings
        fields (read_threads, o_direct, ...), ``before_scan`` and ``block_io`` its probes."""
        options: dict[str, Any] = dict(read_threads=2, write_threads=2, o_direct=self.o_direct)
        options.update(settings)
        region_file = (self.region.path, *self.region.identity()) if self.workers else None
        return FsTier(
            "fs",
            FsTierSettings(root=str(self.root), capacity=capacity_bytes, **options),
            PoolBinding(POOL, BLOCK, {"layout": "test"}, self.region.buffer(), region_file),
            on_done=self.on_done,
            loop=self.loop,
            parts=SharedParts(workers=self.workers),
            probes=FsTierProbes(before_scan=before_scan, block_io=block_io),
        )

    async def ready_tier(self, **kw: Any) -> FsTier:
        tier = self.tier(**kw)
        tier.start()
        await tier.wait_ready()
        tier.index.check_invariants()
        return tier

    def gated(self, op: str) -> GatedIo:
        """Block I/O in the daemon (inline) that holds every ``op`` request at a gate."""
        return GatedIo(InlineIo(self.region.safe_rows()), op)

    def job(self, keys: list[bytes], rows: list[int], promotion: bool) -> TierJob:
        self.next_job += 1
        self.waiters[self.next_job] = self.loop.create_future()
        return TierJob(self.next_job, tuple(keys), tuple(rows), promotion)

    async def store(self, tier: FsTier, keys: list[bytes], rows: list[int]) -> JobResult:
        job = self.job(keys, rows, False)
        assert tier.submit_store(job)
        result = await self.waiters[job.job_id]
        tier.index.check_invariants()
        return result

    async def load(self, tier: FsTier, keys: list[bytes], rows: list[int]) -> JobResult:
        job = self.job(keys, rows, True)
        tier.submit_load(job)
        result = await self.waiters[job.job_id]
        tier.index.check_invariants()
        return result

    def fill(self, row: int, seed: int) -> bytes:
        data = (bytes([seed % 251]) + os.urandom(BLOCK - 1))[:BLOCK]
        self.region.row(row)[:] = data
        return data

    def read(self, row: int) -> bytes:
        return bytes(self.region.row(row))


def run(
    region: Region, root: Path, body: Any, o_direct: str = "auto", io_processes: int = 0
) -> Any:
    async def main() -> Any:
        harness = Harness(region, root, o_direct, io_processes)
        try:
            return await body(harness)
        finally:
            if harness.workers is not None:
                harness.workers.stop()

    return asyncio.run(main())


class GatedIo:
    """Block I/O that holds each request of one kind (``iowire.READ`` or ``WRITE``)
    until ``gate`` is set; ``started`` is set when the first one arrives."""

    def __init__(self, inner: BlockIo, op: str) -> None:
        self.inner = inner
        self.op = op
        self.started = threading.Event()
        self.gate = threading.Event()

    def call(self, request: tuple[Any, ...]) -> list[Reply]:
        if request[0] == self.op:
            self.started.set()
            self.gate.wait()
        return self.inner.call(request)


# Where the block file I/O runs: on the tier's I/O threads, or in worker processes.
BLOCK_IO = pytest.mark.parametrize("io_processes", [0, 2], ids=["inline-io", "worker-io"])


def _o_direct_works(directory: Path) -> bool:
    """Whether ``directory``'s filesystem takes O_DIRECT (tmpfs does not)."""
    probe = directory / "o-direct-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


def block_path(tier: FsTier, key: bytes) -> Path:
    return Path(tier.pool_dir) / fsformat.block_rel_path(key)


def temp_files(tier: FsTier) -> list[Path]:
    return list(Path(tier.pool_dir).rglob("*.tmp"))


def disk_bytes(tier: FsTier) -> int:
    return sum(p.stat().st_size for p in Path(tier.pool_dir).rglob("*.kvb"))


# -- store / load / restart ------------------------------------------------------------


@BLOCK_IO
@pytest.mark.parametrize("o_direct", ["on", "auto", "off"])
def test_store_then_load_into_other_rows_is_bit_exact(
    region: Region, tmp_path: Path, o_direct: str, io_processes: int
) -> None:
    keys = [b"k0", b"\x00\x01", LONG_KEY, b"k3"]
    works = _o_direct_works(tmp_path)
    if o_direct == "on" and not works:
        pytest.skip(f"{tmp_path} is on a filesystem without O_DIRECT")

    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        # on: always (where supported); auto: only where supported and measured faster
        expected = {"on": True, "off": False, "auto": tier.use_o_direct and works}
        assert tier.use_o_direct == expected[o_direct]
        try:
            data = [h.fill(i, i) for i in range(4)]
            stored = await h.store(tier, keys, [0, 1, 2, 3])
            assert stored.success
            assert stored.bytes_moved == 4 * FILE_BYTES
            assert tier.lookup(keys + [b"absent"]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
            again = await h.store(tier, keys[:1], [0])  # present: not rewritten
            assert again.success and again.bytes_moved == 0
            loaded = await h.load(tier, keys, [4, 5, 6, 7])
            assert loaded.success
            assert loaded.successful_keys == tuple(keys)
            assert [h.read(i) for i in range(4, 8)] == data
            stats = tier.statistics()
            assert stats.blocks == 4 and stats.used_bytes == 4 * FILE_BYTES
            assert stats.bytes_written == 4 * FILE_BYTES
            assert stats.bytes_read == 4 * FILE_BYTES
            assert (stats.hits, stats.misses) == (4, 1)
        finally:
            tier.shutdown()
        assert set(h.calls.values()) == {1}
        long_file = block_path(tier, LONG_KEY)
        assert long_file.is_file() and len(long_file.stem) == 64  # sha256-named

    run(region, tmp_path, body, o_direct, io_processes)


@BLOCK_IO
def test_load_of_a_missing_file_fails_without_checksum_failure(
    region: Region, tmp_path: Path, io_processes: int
) -> None:
    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        try:
            h.fill(0, 1)
            assert (await h.store(tier, [b"a"], [0])).success
            block_path(tier, b"a").unlink()
            result = await h.load(tier, [b"a", b"never"], [1, 2])
            assert not result.success and result.successful_keys is None
            stats = tier.statistics()
            assert stats.checksum_failures == 0 and stats.load_failures == 2
            assert tier.lookup([b"a"]) == [LookupResult.MISS]  # ENOENT dropped it
        finally:
            tier.shutdown()

    run(region, tmp_path, body, io_processes=io_processes)


def test_lookup_retries_until_scan_ends_and_restart_finds_blocks(
    region: Region, tmp_path: Path
) -> None:
    async def body(h: Harness) -> None:
        first = await h.ready_tier()
        data = [h.fill(i, 10 + i) for i in range(3)]
        assert (await h.store(first, [b"a", b"b", b"c"], [0, 1, 2])).success
        first.shutdown()
        for i in range(3):
            h.region.row(i)[:] = bytes(BLOCK)

        gate = threading.Event()
        second = h.tier(before_scan=gate.wait)
        second.start()
        try:
            assert second.lookup([b"a", b"zz"]) == [LookupResult.RETRY] * 2
            assert not second.ready
            gate.set()
            await second.wait_ready()
            assert second.lookup([b"a", b"zz"]) == [LookupResult.HIT, LookupResult.MISS]
            assert second.statistics().used_bytes == 3 * FILE_BYTES
            loaded = await h.load(second, [b"a", b"b", b"c"], [5, 6, 7])
            assert loaded.success
            assert [h.read(i) for i in (5, 6, 7)] == data
        finally:
            gate.set()
            second.shutdown()

    run(region, tmp_path, body)


def test_start_removes_temp_and_corrupt_files(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        first = await h.ready_tier()
        h.fill(0, 1)
        h.fill(1, 2)
        assert (await h.store(first, [b"good", b"bad"], [0, 1])).success
        first.shutdown()
        bad = block_path(first, b"bad")
        _poke(bad, 10, b"\xff")  # a header field: the header checksum fails
        temp = Path(first.pool_dir) / "ab" / "cd" / "abcd.kvb.1234.tmp"
        temp.parent.mkdir(parents=True)
        temp.write_bytes(b"partial")

        second = await h.ready_tier()
        try:
            assert not temp.exists() and not bad.exists()
            assert second.scan_report.removed_temp == 1
            assert second.scan_report.removed_corrupt == 1
            assert second.statistics().checksum_failures == 1
            assert second.lookup([b"good", b"bad"]) == [LookupResult.HIT, LookupResult.MISS]
        finally:
            second.shutdown()

    run(region, tmp_path, body)


# -- corruption at load time -----------------------------------------------------------


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip_payload(tier: FsTier, path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(blockformat.HEADER_SIZE + 1234)
        byte = f.read(1)
        f.seek(blockformat.HEADER_SIZE + 1234)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(tier: FsTier, path: Path) -> None:
    os.truncate(path, FILE_BYTES - 4096)


def _other_key(tier: FsTier, path: Path) -> None:
    shutil.copyfile(block_path(tier, b"other"), path)  # a valid file, for another key


def _other_pool(tier: FsTier, path: Path) -> None:
    raw = path.read_bytes()
    header = blockformat.decode_header(raw[: blockformat.HEADER_SIZE])
    forged = blockformat.encode_header(
        key=header.key,
        fingerprint=b"\x42" * blockformat.FINGERPRINT_BYTES,
        payload_length=header.payload_length,
        payload_checksum=header.payload_checksum,
    )
    path.write_bytes(forged + raw[blockformat.HEADER_SIZE :])


@BLOCK_IO
@pytest.mark.parametrize("o_direct", ["auto", "off"])
@pytest.mark.parametrize("corrupt", [_flip_payload, _truncate, _other_key, _other_pool])
def test_corrupt_file_fails_its_key_only_and_is_removed(
    region: Region,
    tmp_path: Path,
    corrupt: Any,
    o_direct: str,
    io_processes: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        try:
            data = [h.fill(i, 30 + i) for i in range(3)]
            result = await h.store(tier, [b"victim", b"fine", b"other"], [0, 1, 2])
            assert result.success
            path = block_path(tier, b"victim")
            corrupt(tier, path)
            loaded = await h.load(tier, [b"victim", b"fine"], [4, 5])
            assert not loaded.success
            assert loaded.successful_keys == (b"fine",)
            assert h.read(5) == data[1]
            assert not path.exists()
            stats = tier.statistics()
            assert stats.checksum_failures == 1 and stats.load_failures == 1
            assert tier.lookup([b"victim"]) == [LookupResult.MISS]
            assert str(path) in caplog.text
        finally:
            tier.shutdown()

    run(region, tmp_path, body, o_direct, io_processes)


# -- capacity and backpressure ------------------------------------------------------------


def test_capacity_evicts_least_recently_used_first(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        tier = await h.ready_tier(capacity_bytes=3 * FILE_BYTES)
        try:
            for i in range(4):
                h.fill(i, i)
            for i in range(3):  # one job each: blocks of one job finish in any order
                assert (await h.store(tier, [b"k%d" % i], [i])).success
            tier.lookup([b"k0"])  # k0 is now more recent than k1
            assert (await h.store(tier, [b"k3"], [3])).success
            assert tier.lookup([b"k0", b"k1", b"k2", b"k3"]) == [
                LookupResult.HIT,
                LookupResult.MISS,
                LookupResult.HIT,
                LookupResult.HIT,
            ]
            assert not block_path(tier, b"k1").exists()
            assert disk_bytes(tier) <= 3 * FILE_BYTES
            stats = tier.statistics()
            assert stats.evictions == 1 and stats.used_bytes == 3 * FILE_BYTES
        finally:
            tier.shutdown()

    run(region, tmp_path, body)


@BLOCK_IO
def test_a_job_larger_than_the_capacity_writes_every_block_and_keeps_the_last(
    region: Region, tmp_path: Path, io_processes: int
) -> None:
    """A job's blocks travel to the disk in groups; a block that does not fit while
    earlier blocks of its group wait to be written gets room once they are written
    (by evicting them), exactly as if they were written one at a time."""

    async def body(h: Harness) -> None:
        tier = await h.ready_tier(capacity_bytes=2 * FILE_BYTES)
        try:
            data = [h.fill(i, 50 + i) for i in range(4)]
            keys = [b"g%d" % i for i in range(4)]
            result = await h.store(tier, keys, [0, 1, 2, 3])
            assert result.success and result.bytes_moved == 4 * FILE_BYTES
            assert tier.lookup(keys) == [LookupResult.MISS] * 2 + [LookupResult.HIT] * 2
            assert disk_bytes(tier) == 2 * FILE_BYTES and not temp_files(tier)
            assert tier.statistics().evictions == 2
            assert (await h.load(tier, keys[2:], [4, 5])).success
            assert [h.read(4), h.read(5)] == data[2:]
        finally:
            tier.shutdown()

    run(region, tmp_path, body, io_processes=io_processes)


def test_a_slow_eviction_unlink_blocks_neither_lookups_nor_the_budget(
    region: Region, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unlinking an evicted file can take milliseconds; it happens outside the tier
    lock (which the event loop takes for every lookup), and its bytes stay charged
    until the file is gone, so the disk never holds more than the capacity."""
    unlinking, gate = threading.Event(), threading.Event()
    real_unlink = safefs.PoolDir.unlink

    def slow_unlink(self: safefs.PoolDir, rel: str) -> None:
        if ".evicted" in rel:
            unlinking.set()
            gate.wait()
        real_unlink(self, rel)

    monkeypatch.setattr(safefs.PoolDir, "unlink", slow_unlink)

    async def body(h: Harness) -> None:
        tier = await h.ready_tier(capacity_bytes=FILE_BYTES)
        try:
            h.fill(0, 1)
            data = h.fill(1, 2)
            assert (await h.store(tier, [b"old"], [0])).success
            job = h.job([b"new"], [1], False)
            assert tier.submit_store(job)
            assert await h.loop.run_in_executor(None, unlinking.wait, 10)  # renamed aside
            answers = await asyncio.wait_for(
                h.loop.run_in_executor(None, tier.lookup, [b"old", b"new"]), timeout=5
            )
            assert answers == [LookupResult.MISS, LookupResult.MISS]  # old is out, new not in
            assert tier.statistics().evictions == 1
            assert tier.budget.charged == FILE_BYTES  # the doomed file is still charged
            gate.set()
            assert (await h.waiters[job.job_id]).success
            assert tier.lookup([b"new"]) == [LookupResult.HIT]
            assert tier.budget.charged == FILE_BYTES and disk_bytes(tier) == FILE_BYTES
            assert not temp_files(tier)
            assert (await h.load(tier, [b"new"], [3])).success and h.read(3) == data
        finally:
            gate.set()
            tier.shutdown()

    run(region, tmp_path, body)


def test_a_file_being_read_is_never_evicted(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        reads = h.gated(iowire.READ)
        tier = await h.ready_tier(capacity_bytes=FILE_BYTES, block_io=reads)
        try:
            data = h.fill(0, 7)
            h.fill(1, 8)
            assert (await h.store(tier, [b"read-me"], [0])).success
            load = h.job([b"read-me"], [2], True)
            tier.submit_load(load)
            await h.loop.run_in_executor(None, reads.started.wait)
            refused = await h.store(tier, [b"newcomer"], [1])
            assert not refused.success  # the only evictable file is being read
            assert tier.index.statistics().reading == 1
            reads.gate.set()
            assert (await h.waiters[load.job_id]).success and h.read(2) == data
            assert (await h.store(tier, [b"newcomer"], [1])).success  # now it may go
            assert tier.lookup([b"read-me", b"newcomer"]) == [
                LookupResult.MISS,
                LookupResult.HIT,
            ]
        finally:
            reads.gate.set()
            tier.shutdown()

    run(region, tmp_path, body)


def test_a_job_queued_at_shutdown_fails_every_block(region: Region, tmp_path: Path) -> None:
    """Blocks travel in groups per I/O task; a group the pool never ran still
    reports each of its blocks failed (the job reports once, nothing loaded)."""

    async def body(h: Harness) -> None:
        reads = h.gated(iowire.READ)
        tier = await h.ready_tier(read_threads=1, write_threads=0, block_io=reads)
        try:
            for i in range(4):
                h.fill(i, i)
            keys = [b"q%d" % i for i in range(4)]
            assert (await h.store(tier, keys, [0, 1, 2, 3])).success
            running = h.job(keys[:1], [4], True)
            tier.submit_load(running)
            await h.loop.run_in_executor(None, reads.started.wait)
            queued = h.job(keys[1:], [5, 6, 7], True)
            tier.submit_load(queued)
            stopping = h.loop.run_in_executor(None, tier.shutdown)
            result = await asyncio.wait_for(h.waiters[queued.job_id], timeout=10)
            assert not result.success and result.successful_keys is None
            # transient (kvtierd.tiers.failures): the blocks are not in question
            assert result.transient_keys == queued.keys
            assert result.transient_cause == PoolShutDown.cause
            reads.gate.set()
            await stopping
            assert (await h.waiters[running.job_id]).success
            assert h.calls[queued.job_id] == 1 and h.calls[running.job_id] == 1
        finally:
            reads.gate.set()
            tier.shutdown()

    run(region, tmp_path, body)


class DyingIo:
    """Block I/O whose next request of kind ``op`` fails as a whole, as when its I/O
    worker is killed (stalled past io_worker_timeout): ``after`` False, before the
    worker touched anything; True, after it did the request's work (files renamed)
    but before it answered. A worker cannot be stopped at that point on demand."""

    def __init__(self, inner: BlockIo) -> None:
        self.inner = inner
        self.failing: tuple[str, bool] | None = None  # (op, after)

    def call(self, request: tuple[Any, ...]) -> list[Reply]:
        failing, self.failing = self.failing, None
        if failing is None or failing[0] != request[0]:
            self.failing = failing
            return self.inner.call(request)
        if failing[1]:
            self.inner.call(request)
        raise WorkerStalled(errno.ETIMEDOUT, "I/O worker kvtierd-io-1 (pid 1) did not answer")


@BLOCK_IO
def test_a_worker_killed_under_a_request_removes_no_block_file(
    region: Region, tmp_path: Path, io_processes: int
) -> None:
    """Issue #40, item 5: a worker timeout is a transient failure, never corruption. A
    read keeps its files and index entries and reports its keys transient; a write
    keeps (and indexes) the whole files the worker renamed before it was killed and
    removes only its temp files."""

    async def body(h: Harness) -> None:
        inner = h.workers or InlineIo(h.region.safe_rows())
        dying = DyingIo(inner)
        tier = await h.ready_tier(block_io=dying)
        try:
            data = [h.fill(row, row) for row in range(4)]
            assert (await h.store(tier, [b"a", b"b"], [0, 1])).success
            files = {key: block_path(tier, key).read_bytes() for key in (b"a", b"b")}

            dying.failing = (iowire.READ, False)
            result = await h.load(tier, [b"a", b"b"], [4, 5])
            assert not result.success and result.successful_keys is None
            assert result.transient_keys == (b"a", b"b") and result.missing_keys == ()
            assert result.transient_cause == WorkerStalled.cause
            assert {key: block_path(tier, key).read_bytes() for key in files} == files
            assert tier.contains(b"a") and tier.contains(b"b")

            dying.failing = (iowire.WRITE, True)  # renamed, then killed before answering
            result = await h.store(tier, [b"c", b"d"], [2, 3])
            assert result.success  # the tier holds both: whole files, verified when read
            assert tier.contains(b"c") and tier.contains(b"d")

            dying.failing = (iowire.WRITE, False)  # killed before it wrote anything
            h.fill(6, 6)
            result = await h.store(tier, [b"e"], [6])
            assert not result.success and not tier.contains(b"e")
            assert not block_path(tier, b"e").exists()

            assert temp_files(tier) == []
            loaded = await h.load(tier, [b"a", b"b", b"c", b"d"], [4, 5, 6, 7])
            assert loaded.success
            assert [h.read(row) for row in (4, 5, 6, 7)] == data
            stats = tier.statistics()
            assert stats.checksum_failures == 0 and stats.blocks == 4
        finally:
            tier.shutdown()

    run(region, tmp_path, body, io_processes=io_processes)


def test_write_fails_when_nothing_fits(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        tier = await h.ready_tier(capacity_bytes=FILE_BYTES - 1)
        try:
            h.fill(0, 0)
            result = await h.store(tier, [b"big"], [0])
            assert not result.success
            assert tier.statistics().store_failures == 1
            assert disk_bytes(tier) == 0
        finally:
            tier.shutdown()

    run(region, tmp_path, body)


def test_backpressure_drops_writes_over_the_limits(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        writes = h.gated(iowire.WRITE)
        tier = await h.ready_tier(max_queue_jobs=1, max_queue_bytes=2 * BLOCK, block_io=writes)
        try:
            too_big = h.job([b"a", b"b", b"c"], [0, 1, 2], False)
            assert not tier.submit_store(too_big)  # 3 blocks > 2 * BLOCK bytes
            first = h.job([b"a"], [0], False)
            assert tier.submit_store(first)
            second = h.job([b"b"], [1], False)
            assert not tier.submit_store(second)  # one job pending already
            stats = tier.statistics()
            assert stats.dropped_writes == 2
            assert (stats.queued_jobs, stats.queued_bytes) == (1, BLOCK)
            writes.gate.set()
            assert (await h.waiters[first.job_id]).success
            await tier.drain()
            assert h.calls == Counter({first.job_id: 1})
        finally:
            writes.gate.set()
            tier.shutdown()

    run(region, tmp_path, body)


# -- start-up errors ------------------------------------------------------------------------


def test_unusable_root_is_a_clear_error(region: Region, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")

    async def body(h: Harness) -> None:
        for root in (a_file, a_file / "below"):
            h.root = root
            with pytest.raises(FsTierError, match=str(root)):
                h.tier().start()

    run(region, tmp_path, body)


def test_pool_json_mismatch_is_detected(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        tier.shutdown()
        pool_file = Path(tier.pool_dir) / fsformat.POOL_FILE
        desc = json.loads(pool_file.read_text())
        assert desc["pool_name"] == POOL and desc["block_bytes"] == BLOCK
        desc["block_bytes"] = 2 * BLOCK
        pool_file.write_text(json.dumps(desc))
        with pytest.raises(PoolMismatchError, match=str(pool_file)):
            h.tier().start()

    run(region, tmp_path, body)


# -- fsck -------------------------------------------------------------------------------------


def test_fsck_finds_and_removes_a_corrupt_file(region: Region, tmp_path: Path) -> None:
    async def body(h: Harness) -> FsTier:
        tier = await h.ready_tier()
        for i in range(3):
            h.fill(i, i)
        assert (await h.store(tier, [b"x", b"y", b"z"], [0, 1, 2])).success
        tier.shutdown()
        return tier

    tier = run(region, tmp_path, body)
    bad = block_path(tier, b"y")
    _flip_payload(tier, bad)
    seen: list[int] = []

    report = fsck(tmp_path, progress=lambda n, _path: seen.append(n))
    assert report.pools == 1 and report.files_checked == 3 and seen == [1, 2, 3]
    assert [path for path, _ in report.bad] == [str(bad)] and bad.exists()

    report = fsck(tmp_path, remove=True)
    assert report.removed == 1 and not bad.exists()
    report = fsck(tmp_path)
    assert report.clean and report.files_checked == 2


# -- the I/O pool ------------------------------------------------------------------------------


def test_iopool_reports_errors_and_fails_queued_tasks_at_shutdown() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = IoPool(loop, read_threads=1, write_threads=0)
        started, gate = threading.Event(), threading.Event()
        results: dict[str, asyncio.Future[list[Any]]] = {
            n: loop.create_future() for n in ("boom", "slow", "queued")
        }

        def boom() -> None:
            raise OSError("disk on fire")

        def slow() -> int:
            started.set()
            gate.wait()
            return 7

        pool.submit_read([boom, lambda: 1], results["boom"].set_result)
        outcomes = await results["boom"]
        assert isinstance(outcomes[0].error, OSError) and outcomes[1].value == 1

        pool.submit_read([slow], results["slow"].set_result)
        await loop.run_in_executor(None, started.wait)
        pool.submit_read([lambda: 2], results["queued"].set_result)
        stopping = loop.run_in_executor(None, pool.shutdown)
        queued = await results["queued"]  # failed by shutdown while slow still runs
        assert isinstance(queued[0].error, PoolShutDown)
        gate.set()
        await stopping
        assert (await results["slow"])[0].value == 7
        await pool.drain()

    asyncio.run(main())
