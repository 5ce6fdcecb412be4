"""FS-tier block I/O in worker processes (kvtierd.tiers.fs.blockio, .ioworker): real processes,
a real Region in /dev/shm, real files under tmp_path."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Exits, eventually, gone, stopped
from test_fs_tier import BLOCK, FILE_BYTES, Harness, block_path, region, run, temp_files

from kvtierd.contract import LookupResult
from kvtierd.primary.region import Region
from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import iowire
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.blockio import IoWorkers, WorkerDied, WorkerProcess
from kvtierd.tiers.integrity import IntegrityKey, KeyRing

__all__ = ["region"]  # the fixture, imported for these tests

FINGERPRINT = b"\x07" * blockformat.FINGERPRINT_BYTES


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` exited; AssertionError naming it after ``timeout`` seconds."""
    eventually(lambda: gone(pid), timeout, f"process {pid} exited", wake=Exits(pid))
    return True


def _write_request(
    region: Region, tmp_path: Path, key: bytes, row: int, keys: KeyRing | None = None
) -> tuple:
    rel = f"{key.hex()}.kvb"  # relative to the pool directory (tmp_path here)
    ref = (region.path, *region.identity(), BLOCK)
    params = (FINGERPRINT, False, False, keys and keys.wire(), str(tmp_path))
    return (iowire.WRITE, ref, params, [(row, rel, rel + ".1.tmp", key)])


def _read_request(
    region: Region, tmp_path: Path, key: bytes, row: int, keys: KeyRing | None = None
) -> tuple:
    ref = (region.path, *region.identity(), BLOCK)
    return (
        iowire.READ,
        ref,
        (FINGERPRINT, False, keys and keys.wire(), str(tmp_path)),
        [(row, f"{key.hex()}.kvb", key)],
    )


def _ring(*secrets: bytes) -> KeyRing:
    keys = tuple(IntegrityKey.of(secret) for secret in secrets)
    return KeyRing(keys[0], keys)


def test_a_worker_seals_with_the_keys_of_the_request_and_refuses_other_keys(
    region: Region, tmp_path: Path
) -> None:
    """The keys travel in each request (the worker process holds no configuration):
    a file sealed under one ring reads back under it, or under a rotation's ring
    that verifies it, and comes back refused (``integrity``) under any other."""
    first, second = os.urandom(32), os.urandom(32)
    data = os.urandom(BLOCK)
    region.row(0)[:] = data
    workers = IoWorkers(1, channels=1)
    try:
        assert workers.call(_write_request(region, tmp_path, b"key", 0, _ring(first))) == [None]
        header = blockformat.decode_header((tmp_path / f"{b'key'.hex()}.kvb").read_bytes())
        assert header.version == blockformat.KEYED_VERSION
        assert header.key_id == IntegrityKey.of(first).key_id
        for ring in (_ring(first), _ring(second, first)):  # the rotation verifies it too
            region.row(2)[:] = bytes(BLOCK)
            assert workers.call(_read_request(region, tmp_path, b"key", 2, ring)) == [None]
            assert bytes(region.row(2)) == data
        for ring, why in ((_ring(second), "not this tier's"), (None, "no integrity_key_file")):
            (reply,) = workers.call(_read_request(region, tmp_path, b"key", 2, ring))
            error = iowire.error_of(reply)
            assert isinstance(error, CorruptFile) and error.integrity, reply
            assert why in error.reason
    finally:
        workers.stop()


def test_a_worker_writes_and_reads_rows_of_the_daemons_region(
    region: Region, tmp_path: Path
) -> None:
    data = os.urandom(BLOCK)
    region.row(0)[:] = data
    workers = IoWorkers(1, channels=1)
    try:
        assert workers.call(_write_request(region, tmp_path, b"key", 0)) == [None]
        (worker_pid,) = workers.pids()
        assert worker_pid != os.getpid()
        assert (tmp_path / f"{b'key'.hex()}.kvb").stat().st_size == FILE_BYTES
        assert workers.call(_read_request(region, tmp_path, b"key", 3)) == [None]
        assert bytes(region.row(3)) == data
        # a file that fails verification comes back as CorruptFile, naming its inode
        (reply,) = workers.call(_read_request(region, tmp_path, b"key", 3)[:3] + (
            [(3, f"{b'key'.hex()}.kvb", b"another key")],
        ))  # fmt: skip
        error = iowire.error_of(reply)
        assert isinstance(error, CorruptFile) and "header names key" in error.reason
        st = (tmp_path / f"{b'key'.hex()}.kvb").stat()
        assert error.identity == (st.st_dev, st.st_ino)
        (reply,) = workers.call(_read_request(region, tmp_path, b"absent", 3))
        assert isinstance(iowire.error_of(reply), FileNotFoundError)
        # a row outside the region is refused, not written short
        (reply,) = workers.call(_write_request(region, tmp_path, b"far", region.num_blocks))
        assert "outside the region" in str(iowire.error_of(reply))
        assert not (tmp_path / f"{b'far'.hex()}.kvb").exists()
    finally:
        workers.stop()
    assert _wait_gone(worker_pid)


def test_a_worker_refuses_a_region_file_that_is_not_the_daemons(
    region: Region, tmp_path: Path
) -> None:
    workers = IoWorkers(1, channels=1)
    try:
        kind, (path, dev, ino, block), params, items = _write_request(region, tmp_path, b"k", 0)
        (reply,) = workers.call((kind, (path, dev, ino + 1, block), params, items))
        error = iowire.error_of(reply)
        assert isinstance(error, OSError) and error.errno == errno.ESTALE
        assert not list(tmp_path.iterdir())  # nothing written from a wrong mapping
    finally:
        workers.stop()


def test_a_dead_worker_fails_its_request_and_is_replaced(region: Region, tmp_path: Path) -> None:
    region.row(1)[:] = os.urandom(BLOCK)
    workers = IoWorkers(1, channels=2)
    try:
        assert workers.call(_write_request(region, tmp_path, b"a", 1)) == [None]
        (first,) = workers.pids()
        os.kill(first, signal.SIGKILL)
        assert _wait_gone(first)
        with pytest.raises(WorkerDied, match=f"pid {first}"):
            workers.call(_read_request(region, tmp_path, b"a", 2))
        assert workers.call(_read_request(region, tmp_path, b"a", 2)) == [None]
        (second,) = workers.pids()
        assert second != first
        assert bytes(region.row(2)) == bytes(region.row(1))
    finally:
        workers.stop()


def test_a_stopped_worker_is_killed_after_the_bound_and_replaced(
    region: Region, tmp_path: Path
) -> None:
    """Issue #29, finding 6: a worker stopped with SIGSTOP never answered and was
    never timed out. Past ``reply_timeout`` the request fails (ETIMEDOUT) only once
    the worker has been killed and has exited (it maps the region: it must not
    write a row after its blocks were reported failed), and the next request gets
    a new worker."""
    region.row(1)[:] = os.urandom(BLOCK)
    workers = IoWorkers(1, channels=1, reply_timeout=0.5)
    try:
        assert workers.call(_write_request(region, tmp_path, b"a", 1)) == [None]
        (first,) = workers.pids()
        os.kill(first, signal.SIGSTOP)
        eventually(lambda: stopped(first), 10, f"worker {first} stopped")
        started = time.monotonic()
        with pytest.raises(WorkerDied, match="did not answer within 0.5s") as failed:
            workers.call(_read_request(region, tmp_path, b"a", 2))
        assert failed.value.errno == errno.ETIMEDOUT
        assert 0.45 <= time.monotonic() - started < 10
        assert gone(first)  # already dead when the failure was reported
        assert workers.call(_read_request(region, tmp_path, b"a", 2)) == [None]
        (second,) = workers.pids()
        assert second != first and bytes(region.row(2)) == bytes(region.row(1))
    finally:
        workers.stop()


def test_a_tier_whose_worker_died_fails_those_blocks_then_recovers(
    region: Region, tmp_path: Path
) -> None:
    """The job reports the blocks failed (nothing indexed, no temp file left),
    and the next job runs in a new worker."""

    async def body(h: Harness) -> None:
        tier = await h.ready_tier(read_threads=1, write_threads=0)
        try:
            data = h.fill(0, 1)
            assert (await h.store(tier, [b"first"], [0])).success
            assert h.workers is not None
            for pid in h.workers.pids():
                os.kill(pid, signal.SIGKILL)
                assert _wait_gone(pid)
            h.fill(1, 2)
            failed = await h.store(tier, [b"second"], [1])
            assert not failed.success and failed.successful_keys is None
            assert tier.lookup([b"second"]) == [LookupResult.MISS]
            assert not block_path(tier, b"second").exists() and not temp_files(tier)
            assert tier.statistics().store_failures == 1
            loaded = await h.load(tier, [b"first"], [2])
            assert loaded.success and h.read(2) == data
        finally:
            tier.shutdown()

    run(region, tmp_path, body, io_processes=1)


def test_workers_exit_when_the_daemon_side_goes_away(region: Region, tmp_path: Path) -> None:
    """Stopping closes the sockets; a worker takes EOF as the order to exit, which is
    also what happens when the daemon dies (its socket ends close with it)."""
    region.row(0)[:] = os.urandom(BLOCK)
    workers = IoWorkers(2, channels=2)
    calls = [_write_request(region, tmp_path, b"x%d" % i, 0) for i in range(2)]

    threads = [threading.Thread(target=workers.call, args=(c,)) for c in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pids = workers.pids()
    assert len(pids) == 2  # each thread's channel lives in its own process
    workers.stop()
    assert all(_wait_gone(pid) for pid in pids)
    with pytest.raises(OSError, match="stopped"):
        workers.call(calls[0])


def test_a_worker_dies_with_the_thread_that_started_it() -> None:
    """Even with its socket still open: the kernel kills it (PR_SET_PDEATHSIG), which
    is what makes a SIGKILLed daemon take its workers along mid-request.
    IoWorkers starts every worker from one spawner thread that lives until stop()."""
    started: list[WorkerProcess] = []

    def start_and_end() -> None:
        worker = WorkerProcess("short-lived", 1)
        started.append(worker)
        # an empty request: its answer proves the worker set its death signal
        assert worker.call(0, (iowire.READ, ("/nonexistent", 0, 0, BLOCK), (), [])) == []

    thread = threading.Thread(target=start_and_end)
    thread.start()
    thread.join()
    (worker,) = started
    try:
        assert _wait_gone(worker.process.pid)
        assert worker.process.wait(timeout=5) == -signal.SIGKILL
    finally:
        worker.stop()
