"""The daemon's only way to read or write the bytes of a region's rows.

Invariant (docs/security.md, "A client that truncates its region"): **the daemon process never
dereferences a region mapping.** Every client of a pool holds the region file
writable, so one of them can ``ftruncate`` it; a page of a mapping past the new
end raises SIGBUS when touched from user space, and no Python handler can
resume from it: the daemon, every pool and every session of every user would
die. The bytes of a row are therefore copied only by system calls, which fail
with an error instead of a signal and never grow the file back:

* reads: ``preadv`` on the region file's descriptor (a read past the end just
  comes back short; about as fast as a copy out of the mapping), into a buffer
  of the caller's (see :func:`scratch`); without a descriptor (a tier built on
  a bare buffer, in tests) ``process_vm_readv`` on this process
  (:func:`kvtierd.primary.safecopy.gather`);
* writes: ``process_vm_writev`` (:func:`kvtierd.primary.safecopy.put`); a ``pwrite`` on
  the region file would re-grow a truncated tmpfs file with zeros, which a
  reader of the other rows would then load as if they were the blocks the
  daemon still lists;
* where a seccomp profile refuses those two calls (Docker's default without
  CAP_SYS_PTRACE), the same copies go through ``/proc/self/mem``
  (:class:`kvtierd.primary.safecopy.ProcSelfMem`): one WARNING, then that path for the
  process's life. Where that cannot be opened either (no ``/proc``), every
  write (and every read of a :class:`RegionRows` without a descriptor) fails
  with :class:`RowIoUnavailable` (one ERROR): promotions fail, the primary tier
  keeps serving; nothing falls back to the mapping.

A copy that comes back short raises :class:`RegionCutShort` (an OSError,
EFAULT): the caller fails that block only (a store is not cascaded, a
promotion is not served) and logs it, rate-limited, naming the pool and region.

Ownership: the :class:`~kvtierd.primary.region.Region` creates its one
:class:`RegionRows` and closes it first in :meth:`~kvtierd.primary.region.Region.close`.
:class:`RegionRows` holds an export of the mapping (the address it copies to
and from stays mapped, never reused by another mapping, until it is closed) and
borrows the region's descriptor (the region closes it only after this);
``close`` waits for the copies in flight (memory copies: microseconds to a few
milliseconds, never a wait on anything else) and refuses new ones, so no copy
runs against an address or a descriptor number that was released and handed
to something else.

Other places where kvtierd code still touches a mapping, and why that is safe:
the fs tier's I/O *worker processes* (``io_processes`` > 0) map the region
themselves and hash / write from it after checking the row against the file's
size: only a truncation racing a copy gets a SIGBUS, which kills that worker
only, whose requests then fail and which is replaced; the client library maps it in the
clients' own processes. (:func:`kvtierd.primary.region.touch_pages`, the pre-fault of
kernels without ``MADV_POPULATE_WRITE``, reads one byte per page with
``process_vm_readv``: a system call too.)
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

from kvtierd.primary import safecopy

__all__ = [
    "RegionClosed",
    "RegionCutShort",
    "RegionRows",
    "RowIoUnavailable",
    "scratch",
    "scratch_bytes",
]

log = logging.getLogger(__name__)

_SYSCALLS, _PROC_SELF_MEM, _NONE = "process_vm_readv/writev", "/proc/self/mem", "none"


class RegionCutShort(OSError):
    """A row could not be copied whole: the region file is shorter than the region
    (a client truncated it). Nothing past the cut was read or written."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EFAULT, message)


class RegionClosed(OSError):
    """The region was closed (its pool shut down): no copy runs any more."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EBADF, message)


class RowIoUnavailable(OSError):
    """Neither process_vm_readv/writev nor /proc/self/mem can be used here."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSYS, message)


class _Mechanism:
    """Which copy path this process uses: the system calls first; switched once to
    /proc/self/mem when they are refused, and to none when that cannot be opened.
    Guarded by ``lock``; only ever moves forward."""

    lock = threading.Lock()
    current = _SYSCALLS

    @classmethod
    def refused(cls, failed: str, exc: OSError) -> None:
        with cls.lock:
            if cls.current != failed:
                return  # another thread moved on already (and logged it)
            if failed == _SYSCALLS:
                cls.current = _PROC_SELF_MEM
                log.warning(
                    "process_vm_readv/writev refused (%s): region rows are copied through "
                    "/proc/self/mem from now on", exc,
                )  # fmt: skip
            else:
                cls.current = _NONE
                log.error(
                    "/proc/self/mem cannot be used either (%s): the daemon cannot write region "
                    "rows without risking SIGBUS, so every promotion from a secondary tier "
                    "fails from now on (stores read rows with pread and go on; the primary "
                    "tier keeps serving)", exc,
                )  # fmt: skip


class RegionRows:
    """Copies rows of one region in and out through system calls only (module
    docstring). Thread-safe: any I/O thread may copy; :meth:`close` once.

    Invariants: while ``_closed`` is False the export ``_anchor`` keeps the
    mapping at ``_base`` mapped; ``_in_flight`` (guarded by ``_idle``) counts the
    copies running, which all started before ``_closed`` was set; ``close``
    releases the export only when it reaches 0.
    """

    def __init__(
        self, buffer: memoryview, block_bytes: int, *, path: str, fd: int | None = None
    ) -> None:
        """``buffer``: the whole region (writable, ``block_bytes`` per row); its
        export is held until :meth:`close`. ``path`` names the region in errors.
        ``fd``: the region file's descriptor (borrowed: valid until :meth:`close`
        returns), which reads use."""
        view = buffer.cast("B") if buffer.format != "B" else buffer
        if block_bytes < 1 or len(view) % block_bytes:
            raise ValueError("the region's length is not a multiple of block_bytes")
        self.path = path
        self.block_bytes = block_bytes
        self.num_rows = len(view) // block_bytes
        self._anchor: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * len(view)).from_buffer(
            view
        )
        self._base = ctypes.addressof(self._anchor)
        self._fd = fd
        self._idle = threading.Condition(threading.Lock())
        self._in_flight = 0  # guarded by _idle
        self._closed = False  # guarded by _idle

    # -- copies --------------------------------------------------------------------------

    def read(self, row: int, into: memoryview) -> None:
        """Copies row ``row`` into ``into`` (exactly ``block_bytes`` long).

        Raises IndexError (a row outside the region), RegionCutShort, RegionClosed
        or RowIoUnavailable; ``into`` is then unspecified."""
        start = self._start(row, len(into))
        self._enter()
        try:
            if self._fd is not None:
                got = _pread_all(self._fd, into, start)
            else:
                got = _copy(
                    lambda: safecopy.gather(self._base, [(start, start + len(into))], into),
                    lambda: safecopy.ProcSelfMem.read(self._base + start, into),
                    f"cannot read row {row} of region {self.path}",
                )
        finally:
            self._exit()
        if got != len(into):
            raise RegionCutShort(
                f"row {row} of region {self.path} could not be read ({got} of {len(into)} "
                "bytes): the region file is shorter than the region (a client truncated it)"
            )

    def write(self, row: int, data: bytes | bytearray | memoryview, data_start: int = 0) -> None:
        """Copies ``data[data_start:]`` (exactly ``block_bytes`` long; ``data`` is
        ``bytes`` or a writable buffer: no copy of it is made) into row ``row``,
        never past the end of a truncated file and never growing it.

        Raises IndexError, RegionCutShort (the row was not written whole: its
        bytes are unspecified), RegionClosed or RowIoUnavailable."""
        length = len(data) - data_start
        start = self._start(row, length)
        self._enter()
        try:
            got = _copy(
                lambda: safecopy.put(self._base, start, data, data_start),
                lambda: safecopy.ProcSelfMem.write(self._base + start, data, data_start),
                f"cannot write row {row} of region {self.path}",
            )
        finally:
            self._exit()
        if got != length:
            raise RegionCutShort(
                f"row {row} of region {self.path} could not be written ({got} of {length} "
                "bytes): the region file is shorter than the region (a client truncated it)"
            )

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Refuses new copies, waits for those in flight, releases the export (the
        mapping may be unmapped after this returns). Idempotent."""
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: self._in_flight == 0)
            self._anchor = None

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals -----------------------------------------------------------------------

    def _start(self, row: int, length: int) -> int:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} outside region {self.path} ({self.num_rows} rows)")
        if length != self.block_bytes:
            raise ValueError(f"a row is {self.block_bytes} bytes, not {length}")
        return row * self.block_bytes

    def _enter(self) -> None:
        with self._idle:
            if self._closed:
                raise RegionClosed(f"region {self.path} is closed")
            self._in_flight += 1

    def _exit(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.notify_all()


def _copy(by_syscall: Callable[[], int], by_proc_self_mem: Callable[[], int], what: str) -> int:
    """Runs the copy with this process's current mechanism (moving on to the next
    one when it is refused); the bytes copied. Raises RowIoUnavailable."""
    while True:
        mechanism = _Mechanism.current
        try:
            if mechanism == _SYSCALLS:
                return by_syscall()
            if mechanism == _PROC_SELF_MEM:
                return by_proc_self_mem()
        except OSError as exc:  # the call is refused here: the next path
            _Mechanism.refused(mechanism, exc)
            continue
        raise RowIoUnavailable(what)


def _pread_all(fd: int, into: memoryview, offset: int) -> int:
    """``preadv`` until ``into`` is full or the file ends; the bytes read."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


_scratch = threading.local()
_scratch_lock = threading.Lock()
_scratch_bytes = 0  # bytes of live bounce buffers, all threads; guarded by _scratch_lock


def scratch(nbytes: int) -> memoryview:
    """This thread's bounce buffer, ``nbytes`` long: a row copied out of a region
    is hashed and sent from here, a verified block staged here before
    :meth:`RegionRows.write`. One buffer per thread, grown to the largest size
    asked and reused (a view of it is valid until this thread's next call), so the
    bytes held are at most (I/O threads) x (largest block_bytes): see
    :func:`scratch_bytes`. Anonymous and private (nobody else can truncate it) and
    page-aligned (O_DIRECT reads and writes it). Freed when its thread ends."""
    buffer: mmap.mmap | None = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = mmap.mmap(-1, max(nbytes, 1))
        _count_scratch(len(buffer))
        weakref.finalize(buffer, _count_scratch, -len(buffer))
        _scratch.buffer = buffer  # the one it replaces is freed when its last view goes
    return memoryview(buffer)[:nbytes]


def scratch_bytes() -> int:
    """Bytes held by the bounce buffers of every thread of this process now."""
    with _scratch_lock:
        return _scratch_bytes


def _count_scratch(delta: int) -> None:
    global _scratch_bytes
    with _scratch_lock:
        _scratch_bytes += delta
