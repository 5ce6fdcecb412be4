"""Hostile or odd entries in an fs tier's pool directory (issue #15, item 4).

A FIFO, socket, device, directory or symlink where a block file or a fan-out
directory belongs must never hang the tier, never lead outside the root and
never be served: a promotion of that key is a quick MISS (counted, logged with
the path and its type), the start-up scan always completes, and a directory is
never removed. Block I/O runs both on the tier's I/O threads and in worker
processes. Real files under tmp_path, a real Region in /dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import eventually
from test_fs_tier import BLOCK_IO, Harness, block_path, region, run

from kvtierd.contract import LookupResult
from kvtierd.primary.region import Region
from kvtierd.tiers import iopool
from kvtierd.tiers.fs import FsTier, FsTierError, blockio, fsformat, scan
from kvtierd.tiers.iopool import IoPool

__all__ = ["region"]  # the fixture, imported for these tests

HIT, MISS = LookupResult.HIT, LookupResult.MISS
QUICK_S = 5.0  # a promotion or scan that takes longer than this is hanging


def plant_fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def plant_socket(path: Path, outside: Path) -> None:
    os.mknod(path, stat.S_IFSOCK | 0o600)


def plant_directory(path: Path, outside: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"must survive")


def plant_symlink(path: Path, outside: Path) -> None:
    """A symlink to a *valid* copy of the block file outside the root: following
    it would serve bytes from outside the tier."""
    target = outside / path.name
    path.symlink_to(target)


def plant_char_device(path: Path, outside: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


PLANTERS = pytest.mark.parametrize(
    ("plant", "kind"),
    [
        (plant_fifo, "FIFO"),
        (plant_socket, "socket"),
        (plant_directory, "directory"),
        (plant_symlink, "symlink"),
        (plant_char_device, "character device"),
    ],
    ids=["fifo", "socket", "directory", "symlink", "char-device"],
)


def pool_path(tier: FsTier) -> Path:
    return Path(tier.pool_dir)


def gone(path: Path) -> bool:
    """Whether nothing (not even a dangling symlink) is at ``path``."""
    return not os.path.lexists(path)


def replace_with(path: Path, plant: Callable[[Path, Path], None], outside: Path) -> None:
    """Moves the block file at ``path`` outside the root and plants something else."""
    outside.mkdir(exist_ok=True)
    shutil.move(path, outside / path.name)
    plant(path, outside)


@BLOCK_IO
@PLANTERS
def test_a_planted_entry_is_a_quick_counted_miss_and_removed_unless_a_directory(
    region: Region,
    tmp_path: Path,
    io_processes: int,
    plant: Callable[[Path, Path], None],
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Scenario: a block was cascaded; someone replaces its file. The promotion
    fails that key alone, at once; the tier drops it from its index."""
    root, outside = tmp_path / "root", tmp_path / "outside"

    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        try:
            data = [h.fill(i, 40 + i) for i in range(2)]
            assert (await h.store(tier, [b"victim", b"fine"], [0, 1])).success
            path = block_path(tier, b"victim")
            replace_with(path, plant, outside)
            loaded = await asyncio.wait_for(h.load(tier, [b"victim", b"fine"], [4, 5]), QUICK_S)
            assert not loaded.success and loaded.successful_keys == (b"fine",)
            assert h.read(5) == data[1] and h.read(4) != data[0]  # never served
            assert tier.lookup([b"victim", b"fine"]) == [MISS, HIT]
            stats = tier.statistics()
            assert (stats.checksum_failures, stats.load_failures) == (1, 1)
            assert f"bad block file {path}: a {kind}, not a regular file" in caplog.text
            if kind == "directory":
                assert (path / "inside").read_bytes() == b"must survive"
            else:
                assert gone(path)
            assert (outside / path.name).stat().st_size == tier.file_bytes  # untouched
        finally:
            tier.shutdown()

    run(region, root, body, io_processes=io_processes)


@BLOCK_IO
def test_a_symlinked_fan_out_directory_is_never_followed(
    region: Region, tmp_path: Path, io_processes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: <pool>/ab/cd is replaced by a symlink to a directory outside the
    root holding valid files. Reads through it are MISSes; writes through it are
    refused (ELOOP, reported with the path); nothing outside changes."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    first, second = b"\xab\xcd\x01", b"\xab\xcd\x02"  # both under ab/cd/

    async def body(h: Harness) -> None:
        tier = await h.ready_tier()
        try:
            h.fill(0, 1)
            h.fill(1, 2)
            assert (await h.store(tier, [first], [0])).success
            fan_out = block_path(tier, first).parent
            shutil.move(fan_out, outside)
            fan_out.symlink_to(outside)
            before = sorted(p.name for p in outside.iterdir())

            loaded = await asyncio.wait_for(h.load(tier, [first], [4]), QUICK_S)
            assert not loaded.success
            assert tier.lookup([first]) == [MISS]
            assert f"{fan_out} is a symlink, not a directory: not followed" in caplog.text
            stored = await asyncio.wait_for(h.store(tier, [second], [1]), QUICK_S)
            assert not stored.success and tier.statistics().store_failures == 1
            assert "ELOOP" in caplog.text and str(block_path(tier, second)) in caplog.text
            assert sorted(p.name for p in outside.iterdir()) == before
            assert fan_out.is_symlink()  # reported, not removed
        finally:
            tier.shutdown()

    run(region, root, body, io_processes=io_processes)


@BLOCK_IO
def test_the_start_up_scan_completes_past_planted_entries(
    region: Region, tmp_path: Path, io_processes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: while the daemon was down, block files were replaced by a FIFO, a
    socket, a directory and a symlink, and a fan-out directory by a symlink to
    valid files outside. The scan ends (lookups answer, no RETRY forever), indexes
    none of them, removes what is not a directory, and the good block loads."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    planted = {
        b"fifo": plant_fifo,
        b"sock": plant_socket,
        b"dir-": plant_directory,
        b"link": plant_symlink,
    }
    linked_key = b"\x12\x34\x56"  # its fan-out dir 12/34 becomes a symlink

    async def body(h: Harness) -> None:
        first = await h.ready_tier()
        keys = [*planted, linked_key, b"good"]
        data = [h.fill(i, 60 + i) for i in range(len(keys))]
        assert (await h.store(first, keys, list(range(len(keys))))).success
        first.shutdown()
        for key, plant in planted.items():
            replace_with(block_path(first, key), plant, outside)
        fan_out = block_path(first, linked_key).parent
        shutil.move(fan_out, outside / "fan-out")
        fan_out.symlink_to(outside / "fan-out")

        second = h.tier()
        second.start()
        try:
            await asyncio.wait_for(second.wait_ready(), QUICK_S)
            assert second.lookup(keys) == [MISS] * 5 + [HIT]
            report = second.scan_report
            assert (report.files, report.bad_entries, report.removed_corrupt) == (5, 4, 0)
            assert second.statistics().checksum_failures == 4
            for key in planted:
                path = block_path(first, key)
                assert path.is_dir() if key == b"dir-" else gone(path)
            assert f"{fan_out} is a symlink: not followed" in caplog.text
            assert (outside / "fan-out" / block_path(first, linked_key).name).is_file()
            loaded = await asyncio.wait_for(h.load(second, [b"good"], [7]), QUICK_S)
            assert loaded.success and h.read(7) == data[-1]
        finally:
            second.shutdown()

    run(region, root, body, io_processes=io_processes)


def test_a_symlinked_pool_directory_or_planted_pool_json_refuses_the_pool(
    region: Region, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool directory itself is never followed through a symlink, and a FIFO
    as pool.json does not hang the start (which runs on the daemon's loop)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()

    async def body(h: Harness) -> None:
        tier = h.tier()
        pool_dir = pool_path(tier)
        pool_dir.symlink_to(outside)
        with pytest.raises(FsTierError, match="is a symlink, not a directory: not followed"):
            tier.start()
        assert not list(outside.iterdir())  # no pool.json written outside the root
        assert "refusing the pool" in caplog.text
        pool_dir.unlink()

        pool_dir.mkdir()
        os.mkfifo(pool_dir / fsformat.POOL_FILE)
        outcome: list[BaseException | None] = []

        def start() -> None:
            try:
                h.tier().start()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=start, daemon=True)  # if it hangs, it is left
        thread.start()
        await h.loop.run_in_executor(None, thread.join, QUICK_S)
        assert outcome, "start() hung on the FIFO"
        assert isinstance(outcome[0], FsTierError)
        assert "pool.json is a FIFO, not a regular file; remove it" in str(outcome[0])

    run(region, root, body)


# -- shutdown stays bounded while I/O is stuck --------------------------------------------


def test_iopool_shutdown_leaves_a_stuck_thread_behind_after_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = IoPool(loop, read_threads=1, write_threads=0, name="stuck-test")
        started, gate = threading.Event(), threading.Event()
        done: asyncio.Future[list[iopool.Outcome]] = loop.create_future()

        def stuck() -> int:
            started.set()
            gate.wait()
            return 1

        pool.submit_read([stuck], done.set_result)
        await loop.run_in_executor(None, started.wait)
        begin = time.monotonic()
        await loop.run_in_executor(None, pool.shutdown, 0.2)
        assert time.monotonic() - begin < QUICK_S  # the stuck task never ends by itself
        assert "stuck-test-r0 still run a task after 0.2s" in caplog.text
        gate.set()  # the file system answers at last: the batch still reports once
        assert (await asyncio.wait_for(done, QUICK_S))[0].value == 1

    asyncio.run(main())


def test_tier_shutdown_is_bounded_with_a_scan_and_a_worker_stuck(
    region: Region, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: the index scan is stuck, and the I/O worker process running a
    promotion is stopped (SIGSTOP: as stuck as a hung mount). Shutdown of the tier
    and of the workers returns within its bounds; the stuck promotion then
    reports failed, once."""
    monkeypatch.setattr(scan, "SCAN_JOIN_S", 0.2)
    monkeypatch.setattr(iopool, "JOIN_S", 0.2)
    monkeypatch.setattr(blockio, "STOP_WAIT_S", 0.2)
    gate = threading.Event()

    async def body(h: Harness) -> None:
        tier = await h.ready_tier(read_threads=1, write_threads=0)
        assert h.workers is not None
        h.fill(0, 1)
        assert (await h.store(tier, [b"k"], [0])).success
        (pid,) = h.workers.pids()
        os.kill(pid, signal.SIGSTOP)
        # stopped before the read is sent (on a busy machine the signal waits for the
        # worker to be scheduled: once, it answered the read first)
        await h.loop.run_in_executor(
            None, eventually, lambda: _state(pid) == "T", QUICK_S, "the worker stopped"
        )  # fmt: skip
        job = h.job([b"k"], [3], True)
        tier.submit_load(job)
        await h.loop.run_in_executor(
            None, eventually, lambda: tier.statistics().queued_jobs == 0, QUICK_S,
            "an I/O thread took the read",
        )  # fmt: skip
        scanning = h.tier(before_scan=gate.wait)
        scanning.start()
        try:
            begin = time.monotonic()
            await h.loop.run_in_executor(None, scanning.shutdown)
            await h.loop.run_in_executor(None, tier.shutdown)
            await h.loop.run_in_executor(None, h.workers.stop)
            assert time.monotonic() - begin < QUICK_S  # the stuck scan and worker never end
            result = await asyncio.wait_for(h.waiters[job.job_id], QUICK_S)
            assert not result.success  # the killed worker failed it
            assert h.calls[job.job_id] == 1
        finally:
            gate.set()

    run(region, tmp_path, body, io_processes=1)


def _state(pid: int) -> str:
    """The scheduler state letter of process ``pid`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
