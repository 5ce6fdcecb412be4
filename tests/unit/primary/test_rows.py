"""kvtierd.primary.rows: row copies that fail with an error, never SIGBUS, when a
client truncated the region file, and never grow it back."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator

import pytest

from kvtierd.primary import rows as regionrows
from kvtierd.primary import safecopy
from kvtierd.primary.region import Region
from kvtierd.primary.rows import (
    RegionClosed,
    RegionCutShort,
    RegionRows,
    RowIoUnavailable,
    scratch,
    scratch_bytes,
)

BLOCK = 16384
ROWS = 8


@pytest.fixture(params=["syscalls", "proc-self-mem"])
def mechanism(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with process_vm_readv/writev and with them refused (a seccomp
    profile: EPERM), when the copies go through /proc/self/mem."""
    monkeypatch.setattr(regionrows._Mechanism, "current", regionrows._SYSCALLS)
    if request.param == "proc-self-mem":

        def refused(*args: object) -> int:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(safecopy, "gather", refused)
        monkeypatch.setattr(safecopy, "put", refused)
    return str(request.param)


@pytest.fixture
def region_file() -> Iterator[tuple[int, mmap.mmap]]:
    """A region-like file in /dev/shm (tmpfs, as the daemon's), mapped shared."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    os.ftruncate(fd, ROWS * BLOCK)
    mapping = mmap.mmap(fd, ROWS * BLOCK)
    try:
        yield fd, mapping
    finally:
        try:
            mapping.close()
        except BufferError:
            pass
        os.close(fd)


def test_rows_round_trip_and_fail_past_a_truncation_without_growing_the_file(
    mechanism, region_file, caplog
):
    fd, mapping = region_file
    rows = RegionRows(memoryview(mapping), BLOCK, path="/dev/shm/test.region")
    data = bytes(range(256)) * (BLOCK // 256)
    rows.write(5, data)
    rows.write(6, b"\0" * 4096 + data, data_start=4096)  # a value after its header
    into = scratch(BLOCK)
    rows.read(5, into)
    assert bytes(into) == data
    rows.read(6, into)
    assert bytes(into) == data
    rows.write(1, bytearray(b"x" * BLOCK))  # a writable buffer (the bounce buffer)
    rows.read(1, into)
    assert bytes(into) == b"x" * BLOCK

    os.ftruncate(fd, 4 * BLOCK + 4096)  # a client cuts the file inside row 4
    rows.read(3, into)  # before the cut: fine
    with pytest.raises(RegionCutShort, match=r"row 5 of region /dev/shm/test.region"):
        rows.read(5, into)
    with pytest.raises(RegionCutShort, match="could not be written"):
        rows.write(4, data)  # the first page fits, the rest does not
    with pytest.raises(RegionCutShort):
        rows.write(7, data)
    assert os.fstat(fd).st_size == 4 * BLOCK + 4096  # a pwrite would have grown it
    if mechanism == "proc-self-mem":
        assert "copied through /proc/self/mem" in caplog.text
    rows.close()


def test_rows_outside_the_region_or_of_the_wrong_size_are_refused(mechanism, region_file):
    _, mapping = region_file
    rows = RegionRows(memoryview(mapping), BLOCK, path="r")
    with pytest.raises(IndexError, match="row 8 outside region r"):
        rows.read(ROWS, scratch(BLOCK))
    with pytest.raises(IndexError):
        rows.write(-1, bytes(BLOCK))
    with pytest.raises(ValueError, match="a row is 16384 bytes"):
        rows.write(0, bytes(BLOCK - 1))
    rows.close()


def test_close_waits_for_copies_in_flight_and_refuses_later_ones(region_file, monkeypatch):
    """No copy may run against an address that was unmapped (and maybe mapped again
    by something else): close() waits for the copies in flight, then refuses."""
    _, mapping = region_file
    rows = RegionRows(memoryview(mapping), BLOCK, path="r")
    entered, release = threading.Event(), threading.Event()
    real_gather = safecopy.gather

    def slow_gather(*args: object) -> int:
        entered.set()
        release.wait(10)
        return real_gather(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(regionrows._Mechanism, "current", regionrows._SYSCALLS)
    monkeypatch.setattr(safecopy, "gather", slow_gather)
    reader = threading.Thread(target=rows.read, args=(0, memoryview(bytearray(BLOCK))))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=rows.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a copy was in flight"
    release.set()
    closer.join(10)
    reader.join(10)
    assert not closer.is_alive()
    with pytest.raises(RegionClosed):
        rows.read(0, scratch(BLOCK))
    mapping.close()  # the export is released: the mapping can go


def test_without_any_safe_path_copies_fail_and_never_touch_the_mapping(
    region_file, monkeypatch, caplog
):
    _, mapping = region_file
    monkeypatch.setattr(regionrows._Mechanism, "current", regionrows._PROC_SELF_MEM)

    def no_proc(*args: object) -> int:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/self/mem")

    monkeypatch.setattr(safecopy.ProcSelfMem, "read", no_proc)
    rows = RegionRows(memoryview(mapping), BLOCK, path="r")
    with pytest.raises(RowIoUnavailable):
        rows.read(0, scratch(BLOCK))
    with pytest.raises(RowIoUnavailable):
        rows.write(0, bytes(BLOCK))
    assert "cannot be used either" in caplog.text
    rows.close()


def test_a_region_closes_its_rows_before_unmapping(tmp_path):
    region = Region.create(str(tmp_path), "pool", ROWS, BLOCK, prefault=False)
    rows = region.safe_rows()
    assert region.safe_rows() is rows
    rows.write(2, b"k" * BLOCK)
    assert bytes(region.row(2)) == b"k" * BLOCK
    region.close()
    assert rows.closed
    with pytest.raises(RegionClosed):
        rows.write(2, b"k" * BLOCK)


def test_scratch_is_per_thread_page_aligned_and_reused():
    first = scratch(BLOCK)
    assert safecopy.address_of(first) % mmap.PAGESIZE == 0  # O_DIRECT reads into it
    again = scratch(BLOCK // 2)
    assert safecopy.address_of(again) == safecopy.address_of(first)
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(safecopy.address_of(scratch(BLOCK))))
    thread.start()
    thread.join()
    assert other[0] != safecopy.address_of(first)


def test_bounce_buffers_are_bounded_by_threads_times_the_largest_row():
    """Every buffer bounded in bytes: one per thread, grown to the largest row
    asked, reused, and given back when its thread ends."""
    before = scratch_bytes()
    go = threading.Barrier(4)
    done = threading.Event()

    def io_thread() -> None:
        for size in (BLOCK, 4 * BLOCK, BLOCK, 2 * BLOCK) * 10:
            scratch(size)
        go.wait(10)
        done.wait(10)

    threads = [threading.Thread(target=io_thread) for _ in range(3)]
    for thread in threads:
        thread.start()
    go.wait(10)
    assert scratch_bytes() - before == 3 * 4 * BLOCK
    done.set()
    for thread in threads:
        thread.join(10)
    gc.collect()
    assert scratch_bytes() == before
