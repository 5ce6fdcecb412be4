"""Copies out of and into this process's own shared mappings that never die of SIGBUS.

A region file is writable by the clients that map it, so one of them can
truncate it; a page of the daemon's mapping past the new end then raises SIGBUS
when touched from user space, which kills the whole daemon (no Python handler
can resume). A system call that reads or writes the same memory gets EFAULT
instead, and neither grows the file back (a ``pwrite`` on the file would).

* :func:`gather` copies many ranges of one mapping out with ``process_vm_readv``
  on this process: one system call (one release of the interpreter lock) per
  1024 ranges, where a ``pread`` per range would wait for the lock again after
  each read while the event loop is busy.
* :func:`put` copies one buffer into a mapping with ``process_vm_writev``.
* :class:`ProcSelfMem` does either through ``/proc/self/mem`` (``preadv`` /
  ``pwrite`` at the address), where a seccomp profile refuses the two calls
  above (Docker's default without CAP_SYS_PTRACE); a page past the end of the
  file fails the same way (EIO).

Invariant: ``base`` is the address of a mapping this process keeps mapped while
the call runs (:class:`kvtierd.primary.rows.RegionRows` holds it so), or one
already unmapped (then the copy comes back short: EFAULT, never a crash).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Sequence

__all__ = ["ProcSelfMem", "address_of", "gather", "put"]

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
    ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.argtypes = _process_vm_readv.argtypes
_process_vm_writev.restype = ctypes.c_ssize_t


def address_of(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (the export is released
    before returning: the buffer's owner may still be closed normally)."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return int(ctypes.addressof(anchor))
    finally:
        del anchor


def gather(base: int, ranges: Sequence[tuple[int, int]], into: bytearray | memoryview) -> int:
    """Copies the memory ``[base + start, base + end)`` of each range, back to
    back, into ``into`` (a writable buffer at least their total length); returns
    the bytes copied.
    Fewer than the total means a range could not be read (a truncated file, an
    unmapped region): the ranges before it were copied whole, none after it.
    Raises OSError when the system call itself is refused (EPERM from a seccomp
    profile that allows it only with CAP_SYS_PTRACE, ENOSYS): use ``pread``."""
    pid = os.getpid()  # this process's (a forked child reads its own copy)
    dest = (ctypes.c_char * len(into)).from_buffer(into)
    try:
        dest_address = ctypes.addressof(dest)
        copied = 0
        for first in range(0, len(ranges), IOV_MAX):
            chunk = ranges[first : first + IOV_MAX]
            remote = (_IoVec * len(chunk))(
                *(_IoVec(base + start, end - start) for start, end in chunk)
            )
            length = sum(end - start for start, end in chunk)
            local = _IoVec(dest_address + copied, length)
            got = int(_process_vm_readv(pid, ctypes.byref(local), 1, remote, len(chunk), 0))
            if got < 0:
                err = ctypes.get_errno()
                if err in (errno.EFAULT, errno.ENOMEM, errno.ESRCH):
                    return copied  # a range not mapped (any more): short
                # EPERM / ENOSYS: the call is refused here (a seccomp profile)
                raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
            copied += got
            if got < length:
                return copied
        return copied
    finally:
        del dest


def put(base: int, start: int, data: bytes | bytearray | memoryview, data_start: int = 0) -> int:
    """Copies ``data[data_start:]`` to the memory at ``base + start`` of this
    process; returns the bytes copied. Fewer means the destination could not be
    written whole (a truncated file: the pages past its end are not written and
    the file does not grow). ``data`` is ``bytes`` or a writable buffer. Raises
    OSError when the system call itself is refused (EPERM from a seccomp
    profile, ENOSYS): use :class:`ProcSelfMem`."""
    length = len(data) - data_start
    if length <= 0:
        return 0
    source, keep = _source_address(data)
    source += data_start
    try:
        local = _IoVec(source, length)
        remote = _IoVec(base + start, length)
        got = int(
            _process_vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        )
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EFAULT, errno.ENOMEM, errno.ESRCH):
                return 0
            raise OSError(err, f"process_vm_writev: {os.strerror(err)}")
        return got
    finally:
        del keep


def _source_address(data: bytes | bytearray | memoryview) -> tuple[int, object]:
    """The address of ``data``'s first byte and the object that keeps it valid
    (drop it after the copy). ``bytes`` (read-only) by its ``c_char_p`` (no
    copy); anything else must be a writable, contiguous buffer."""
    if isinstance(data, bytes):
        pointer = ctypes.c_char_p(data)
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        if address is None:  # pragma: no cover - a bytes object always has a buffer
            raise ValueError("no address for an empty buffer")
        return address, pointer
    view = memoryview(data).cast("B")
    anchor = (ctypes.c_char * len(view)).from_buffer(view)
    return ctypes.addressof(anchor), (anchor, view)


class ProcSelfMem:
    """``/proc/self/mem`` opened once for the process: reads and writes of its own
    memory at an address, through ``preadv`` / ``pwrite`` (file offset = address).
    The fallback where ``process_vm_readv`` / ``process_vm_writev`` are refused;
    the same guarantees (a page past a truncated file's end fails with EIO; the
    file never grows). Thread-safe (positional I/O on one descriptor)."""

    _fd = -1  # opened by the first call; guarded by _lock; never closed (the process's)
    _lock = threading.Lock()

    @classmethod
    def _descriptor(cls) -> int:
        with cls._lock:
            if cls._fd < 0:
                cls._fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
            return cls._fd

    @classmethod
    def read(cls, address: int, into: memoryview) -> int:
        """Copies ``len(into)`` bytes at ``address`` into ``into``; the bytes copied
        (fewer: a page could not be read). Raises OSError if /proc/self/mem cannot
        be opened (no /proc)."""
        fd = cls._descriptor()
        done = 0
        while done < len(into):
            try:
                got = os.preadv(fd, [into[done:]], address + done)
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.EFAULT):
                    return done
                raise
            if got <= 0:
                return done
            done += got
        return done

    @classmethod
    def write(cls, address: int, data: bytes | bytearray | memoryview, data_start: int = 0) -> int:
        """Copies ``data[data_start:]`` to ``address``; the bytes copied (fewer: a
        page could not be written). Raises OSError if /proc/self/mem cannot be opened."""
        fd = cls._descriptor()
        view = memoryview(data).cast("B")[data_start:]
        done = 0
        while done < len(view):
            try:
                got = os.pwrite(fd, view[done:], address + done)
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.EFAULT):
                    return done
                raise
            if got <= 0:
                return done
            done += got
        return done
