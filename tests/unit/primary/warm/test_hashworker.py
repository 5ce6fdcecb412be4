"""kvtierd.primary.warm.hashworker and kvtierd.primary.warm.rowsums: the journal's row
checksums computed in a real helper process from its own mapping of a /dev/shm file, equal to the
daemon's own ways of computing them; a truncated file or a dead worker never
yields a checksum of bytes that were not read, and never stops the hashing."""

from __future__ import annotations

import mmap
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.primary.warm import rowsums
from kvtierd.primary.warm.hashworker import HashWorker, WorkerDied
from kvtierd.primary.warm.rowsums import (
    RowChecksums,
    checksum_spans,
    read_row_checksum,
    row_checksum,
)

BLOCK = 1 << 20
ROWS = 8


@pytest.fixture
def region() -> Iterator[tuple[int, memoryview]]:
    """A region file in /dev/shm of ROWS distinct rows: (descriptor, mapping)."""
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.unlink(path)
    os.ftruncate(fd, ROWS * BLOCK)
    mapping = mmap.mmap(fd, ROWS * BLOCK)
    view = memoryview(mapping)
    for row in range(ROWS):
        view[row * BLOCK : (row + 1) * BLOCK] = os.urandom(4096) * (BLOCK // 4096)
    yield fd, view
    view.release()
    mapping.close()
    os.close(fd)


@pytest.mark.parametrize("checksum_bytes", [64 << 10, 0], ids=["sampled", "whole-rows"])
def test_worker_checksums_equal_the_daemons_and_stop_at_the_files_end(region, checksum_bytes):
    fd, view = region
    spans = checksum_spans(BLOCK, checksum_bytes)
    worker = HashWorker("t", fd, BLOCK, ROWS, spans)
    try:
        # the daemon's own priority: niced, a saturated node left it no CPU
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        expected = [row_checksum(view[r * BLOCK : (r + 1) * BLOCK], spans) for r in range(ROWS)]
        assert worker.checksums([3, 0, 7, 3]) == [
            expected[3],
            expected[0],
            expected[7],
            expected[3],
        ]
        scratch = bytearray(BLOCK)
        assert expected[5] == read_row_checksum(fd, 5, BLOCK, spans, scratch)  # adoption's way
        view[5 * BLOCK + spans[-1][0]] ^= 0xFF  # a covered byte changes: so does the sum
        assert worker.checksums([5]) != [expected[5]]
        os.ftruncate(fd, 3 * BLOCK + 100)  # a client cuts the file in row 3
        assert worker.checksums([2, 3, 6]) == [expected[2], None, None]  # not touched: alive
        assert worker.process.poll() is None
    finally:
        worker.stop()
    assert worker.process.returncode == 0  # exited at EOF


def test_a_dead_worker_fails_its_request_and_the_batch_is_hashed_in_the_daemon(region, monkeypatch):
    fd, view = region
    spans = checksum_spans(BLOCK, 64 << 10)
    expected = [row_checksum(view[r * BLOCK : (r + 1) * BLOCK], spans) for r in range(ROWS)]
    worker = HashWorker("t", fd, BLOCK, ROWS, spans)
    os.kill(worker.pid, signal.SIGBUS)  # what a truncation racing its hashing does
    worker.process.wait(10)
    with pytest.raises(WorkerDied, match="died with exit status -7"):
        worker.checksums([0])
    worker.stop()

    monkeypatch.setattr(rowsums, "WORKER_RESPAWN_S", 0.0)
    sums = RowChecksums("t", view, fd, BLOCK, spans)
    try:
        assert sums.compute([1, 2]) == expected[1:3]
        first = sums.worker_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert sums.compute([4]) == [expected[4]]  # hashed here: the worker was gone
        assert sums.compute([6]) == [expected[6]]  # ... and a new one started
        assert sums.worker_pid not in (None, first) and sums.workers_started == 2
    finally:
        sums.close()


def test_the_worker_dies_with_the_thread_that_started_it(region):
    """PR_SET_PDEATHSIG: the journal thread owns its worker; if the thread ends
    without stopping it (the daemon killed), the kernel kills the worker."""
    fd, view = region
    started: list[HashWorker] = []

    def journal_thread() -> None:
        started.append(HashWorker("t", fd, BLOCK, ROWS, checksum_spans(BLOCK, 0)))
        assert len(started[0].checksums([0])) == 1  # it runs

    thread = threading.Thread(target=journal_thread)
    thread.start()
    thread.join()
    assert started[0].process.wait(10) == -signal.SIGKILL


def test_the_worker_maps_the_region_afresh_so_its_page_tables_stay_bounded(region, monkeypatch):
    """In-process (the worker's own class): past REMAP_EVERY_BYTES of rows hashed the
    mapping is replaced, which frees the page tables the hashing filled; the sums
    do not change."""
    from array import array

    from kvtierd.primary.warm import hashworker

    fd, view = region
    spans = checksum_spans(BLOCK, 64 << 10)
    monkeypatch.setattr(hashworker, "REMAP_EVERY_BYTES", 3 * BLOCK)
    hasher = hashworker._RowHasher(fd, BLOCK, ROWS, spans)
    first = hasher.reply(array("I", [0, 1, 2, 3]))
    mapping = hasher._mapping
    assert hasher.reply(array("I", [0, 1, 2, 3])) == first  # past the bound: remapped
    assert hasher._mapping is not mapping and mapping.closed
    expected = [row_checksum(view[r * BLOCK : (r + 1) * BLOCK], spans) for r in range(4)]
    assert array("Q", first[:32]).tolist() == expected and first[32:] == b"\x01" * 4


def test_the_worker_never_holds_the_regions_liveness_lock(region):
    """The daemon's flock on its region file says "a live kvtierd owns this". The
    worker used to get a copy of the daemon's descriptor (the same open file
    description, so the same lock): a worker outliving a SIGKILLed daemon by a
    moment (on a busy machine its death waits for the CPU) made the next
    daemon refuse the pool ("held by another live kvtierd"). It gets the file
    opened anew now: its descriptor holds no lock (the kernel's fdinfo)."""
    import fcntl

    fd, _ = region
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the daemon's region holds it
    worker = HashWorker("t", fd, BLOCK, ROWS, checksum_spans(BLOCK, 0))
    try:
        assert worker.checksums([0]) != [None]  # running, mapped
        argv = Path(f"/proc/{worker.pid}/cmdline").read_bytes().split(b"\0")
        worker_fd = argv[
            5
        ].decode()  # python -m kvtierd.primary.warm.hashworker PID SOCK REGION_FD ...
        with open(f"/proc/{worker.pid}/fdinfo/{worker_fd}") as info:
            held = [line for line in info if line.startswith("lock:")]
        with open(f"/proc/self/fdinfo/{fd}") as info:
            assert any(line.startswith("lock:") for line in info)  # the check can see one
        assert held == []
    finally:
        worker.stop()
