"""What a structure really takes of the heap, for the tests that hold the daemon's
byte accounting to it (kvtierd.records, kvtierd.primary.footprint).

tracemalloc reports the bytes each allocation asked for; the allocators round
them up: pymalloc (requests up to 512 bytes) to a multiple of 16, glibc malloc
adds its 8-byte header and rounds to 16 (and maps large blocks whole pages).
:func:`retained_heap` counts each live allocation as the allocator holds it.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")
_PAGE = 4096
_MMAPPED_FROM = 32 << 10  # the daemon's mmap threshold (kvtierd.util.heap)


def held_bytes(requested: int) -> int:
    """What the allocator holds for a request of ``requested`` bytes."""
    if requested <= 512:
        return (requested + 15) // 16 * 16
    if requested < _MMAPPED_FROM:
        return (requested + 8 + 15) // 16 * 16
    return (requested + 16 + _PAGE - 1) // _PAGE * _PAGE


def retained_heap(build: Callable[[], _T]) -> tuple[_T, int]:
    """Calls ``build`` with tracemalloc on; returns what it built and the heap the
    allocations still alive afterwards hold (what ``build`` dropped is not counted:
    keep what is measured reachable only from the returned object)."""
    gc.collect()
    tracemalloc.start()
    try:
        built = build()
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    snapshot = snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    return built, sum(held_bytes(trace.size) for trace in snapshot.traces)
