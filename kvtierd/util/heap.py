"""The C heap's hold on memory the daemon freed (glibc malloc; docs/design/memory.md).

Python objects above 512 bytes, protobuf arenas, gRPC's buffers and packed events
come from glibc's ``malloc``. Two of its habits kept a daemon that had served large
calls at its peak (measured: 310 MiB of anonymous memory after 20 cycles of
65,536 new 256-byte keys, of which under 100 MiB were live):

* the threshold above which a block is mapped on its own (and unmapped when
  freed) starts at 128 KiB and rises, up to 32 MiB, each time such a block is
  freed: after the first large request, requests of megabytes are carved out of
  the heap, and what other allocations settle after them pins those pages;
* freed pages inside the heap go back to the kernel only from its top.

:func:`tune_malloc` fixes the threshold (:data:`MMAP_THRESHOLD`): a block that
large is mapped and unmapped alone. :class:`HeapTrimmer` hands the heap's free
pages back (``malloc_trim(0)``, which also returns free pages in the middle of
the heap) after the resident memory grew, on its own thread: ctypes releases the
GIL, and the trim takes milliseconds (measured 0.4-2.3 ms with the threshold
fixed), during which the loop's own ``malloc`` calls may wait for the heap's lock.

Elsewhere than glibc (musl) both are no-ops. Nothing here knows the daemon.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 10  # blocks this large or larger are mapped alone
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
TRIM_INTERVAL = 1.0  # seconds between two looks at the resident memory
TRIM_AFTER_GROWTH = 4 << 20  # bytes the resident memory grew since the last trim


PAGE_BYTES = 4096
_SMALL = 512  # CPython's own allocator serves requests up to this many bytes


def allocated_bytes(requested: int) -> int:
    """What a request of ``requested`` bytes holds of memory once the threshold is
    fixed (:func:`tune_malloc`): CPython's allocator rounds small ones to 16
    bytes; glibc adds its 8-byte header and rounds to 16, and maps a block of
    the threshold or more whole pages, with a 16-byte header."""
    if requested <= _SMALL:
        return (requested + 15) // 16 * 16
    if requested < MMAP_THRESHOLD:
        return (requested + 8 + 15) // 16 * 16
    return (requested + 16 + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


_LIBC = _glibc()


def tune_malloc(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold at ``threshold`` (which also stops it from
    rising); False where this is not glibc or it refused."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> bool:
    """``malloc_trim(0)``: the heap's free pages go back to the kernel. Blocks for
    milliseconds: call it off the event loop. True when memory was released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def resident_anonymous_bytes() -> int:
    """The process's resident memory not backed by a file or shared memory
    (``/proc/self/statm``: resident minus shared pages; one small read)."""
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class HeapTrimmer:
    """Trims the heap after the resident memory grew; driven by :meth:`tick`.

    A trim is started when the resident memory grew by ``after_growth`` since the
    last trim ended, and again at each later look for as long as the previous
    trim released something: a trim that ran while a large call still held its
    buffers is followed by one after they were freed, and a quiet daemon stops
    trimming.

    Invariant: at most one trim runs at a time, on its own short-lived thread;
    ``_baseline`` is the resident memory measured when the last trim ended (or at
    start, or lower since). Event-loop only, but for the thread it starts, which
    writes ``_baseline`` and ``_again`` once, before it ends.
    """

    def __init__(
        self,
        *,
        interval: float = TRIM_INTERVAL,
        after_growth: int = TRIM_AFTER_GROWTH,
        resident: Callable[[], int] = resident_anonymous_bytes,
        release: Callable[[], bool] = trim,
    ) -> None:
        self._interval = interval
        self._after_growth = after_growth
        self._resident = resident
        self._release = release
        self._next_look = 0.0
        self._baseline = resident()
        self._again = False  # the last trim released memory: look again
        self._thread: threading.Thread | None = None
        self.trims = 0  # trims started, ever

    def tick(self, now: float) -> bool:
        """Looks at the resident memory at most every ``interval`` seconds of ``now``;
        starts a trim when it is due (see the class) and none runs. Returns
        whether one was started."""
        if now < self._next_look:
            return False
        self._next_look = now + self._interval
        if self._thread is not None and self._thread.is_alive():
            return False
        resident = self._resident()
        if resident < self._baseline:
            self._baseline = resident  # memory went back by itself (a pool closed)
        if not self._again and resident - self._baseline < self._after_growth:
            return False
        self.trims += 1
        self._thread = threading.Thread(target=self._trim, name="kvtierd-heap-trim", daemon=True)
        self._thread.start()
        return True

    def _trim(self) -> None:
        try:
            released = bool(self._release())
        except Exception:  # never fatal: the memory just stays with the process
            log.debug("malloc_trim failed", exc_info=True)
            released = False
        self._baseline = self._resident()
        self._again = released

    def join(self, timeout: float | None = None) -> None:
        """Waits for a trim in progress (tests; shutdown need not)."""
        if self._thread is not None:
            self._thread.join(timeout)
