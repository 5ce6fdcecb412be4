"""The C heap's trims (kvtierd.util.heap): when a trim starts, that one runs at a time,
and what an allocation holds. The trimmer is driven with given times and a given
resident size; the real malloc_trim runs once."""

from __future__ import annotations

import threading

from kvtierd.util.heap import (
    MMAP_THRESHOLD,
    HeapTrimmer,
    allocated_bytes,
    resident_anonymous_bytes,
    trim,
    tune_malloc,
)

MIB = 1 << 20


class Memory:
    """The resident size the trimmer reads, and the trims it asked for (each
    releases ``releases`` bytes and says whether it released anything)."""

    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.trims = 0
        self.releases = 0

    def read(self) -> int:
        return self.resident

    def release(self) -> bool:
        self.trims += 1
        self.resident -= self.releases
        return self.releases > 0


def trimmer(memory: Memory) -> HeapTrimmer:
    return HeapTrimmer(
        interval=1.0, after_growth=4 * MIB, resident=memory.read, release=memory.release
    )


def settle(heap: HeapTrimmer) -> None:
    heap.join(timeout=10)


def test_a_trim_starts_once_the_resident_memory_grew_by_the_threshold():
    memory = Memory(100 * MIB)
    heap = trimmer(memory)
    memory.resident += 3 * MIB
    assert not heap.tick(10.0)
    memory.resident += 1 * MIB
    assert not heap.tick(10.5), "looked again before the interval passed"
    assert heap.tick(11.0)
    settle(heap)
    assert memory.trims == 1 == heap.trims


def test_trims_go_on_while_they_release_memory_and_stop_when_they_do_not():
    """A trim that ran while a large call still held its buffers released little;
    the next look trims again, until a trim releases nothing."""
    memory = Memory(100 * MIB)
    heap = trimmer(memory)
    memory.resident += 40 * MIB
    memory.releases = 2 * MIB
    assert heap.tick(1.0)
    settle(heap)
    assert heap.tick(2.0), "the last trim released memory: trim again"
    settle(heap)
    memory.releases = 0
    assert heap.tick(3.0)
    settle(heap)
    assert not heap.tick(4.0) and not heap.tick(5.0)
    assert memory.trims == 3


def test_memory_that_went_back_by_itself_lowers_the_baseline():
    memory = Memory(100 * MIB)
    heap = trimmer(memory)
    memory.resident = 60 * MIB  # a pool closed
    assert not heap.tick(1.0)
    memory.resident = 63 * MIB
    assert not heap.tick(2.0), "3 MiB over the new baseline: no trim"
    memory.resident = 64 * MIB
    assert heap.tick(3.0)
    settle(heap)


def test_one_trim_at_a_time():
    memory = Memory(100 * MIB)
    running, finish = threading.Event(), threading.Event()

    def slow_release() -> bool:
        running.set()
        finish.wait(10)
        return True

    heap = HeapTrimmer(
        interval=1.0, after_growth=4 * MIB, resident=memory.read, release=slow_release
    )
    memory.resident += 8 * MIB
    assert heap.tick(1.0)
    assert running.wait(10)
    assert not heap.tick(2.0) and not heap.tick(3.0), "a trim is still running"
    finish.set()
    settle(heap)
    assert heap.tick(4.0) and heap.trims == 2
    settle(heap)


def test_a_failing_trim_is_not_fatal():
    memory = Memory(100 * MIB)

    def broken() -> bool:
        raise OSError("no")

    heap = HeapTrimmer(interval=1.0, after_growth=4 * MIB, resident=memory.read, release=broken)
    memory.resident += 8 * MIB
    assert heap.tick(1.0)
    settle(heap)
    assert not heap.tick(2.0), "the failed trim set a new baseline and asked for no follow-up"


def test_what_an_allocation_holds():
    assert allocated_bytes(1) == 16 and allocated_bytes(289) == 304  # CPython's allocator
    assert allocated_bytes(513) == 528 and allocated_bytes(1000) == 1008  # glibc: +8, to 16
    assert allocated_bytes(MMAP_THRESHOLD) == MMAP_THRESHOLD + 4096  # mapped: whole pages
    assert allocated_bytes(61440 - 16) == 61440


def test_this_glibc_takes_the_threshold_and_trims():
    """On this (glibc) machine the tuning is applied and a trim runs."""
    assert tune_malloc()
    garbage = [bytearray(1000) for _ in range(10000)]
    del garbage
    trim()  # True or False: whether pages went back depends on the heap
    assert resident_anonymous_bytes() > 0
