"""Copies out of this process's own shared mappings that never die of SIGBUS.

A region file is writable by the clients that map it, so one of them can
truncate it; a page of the daemon's mapping past the new end then raises SIGBUS
when touched from user space, which kills the whole daemon (no Python handler
can resume). A system call that reads the same memory gets EFAULT instead.
:func:`gather` copies many ranges of one mapping with ``process_vm_readv`` on
this process: one system call (one release of the interpreter lock) per 1024
ranges, where a ``pread`` per range would wait for the lock again after each
read while the event loop is busy.

Invariant: ``base`` is the address of a mapping this process keeps mapped while
the call runs, or one already unmapped (then the copy comes back short: EFAULT,
never a crash).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Sequence

__all__ = ["address_of", "gather"]

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


def address_of(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (the export is released
    before returning: the buffer's owner may still be closed normally)."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return int(ctypes.addressof(anchor))
    finally:
        del anchor


def gather(base: int, ranges: Sequence[tuple[int, int]], into: bytearray) -> int:
    """Copies the memory ``[base + start, base + end)`` of each range, back to
    back, into ``into`` (at least their total length); returns the bytes copied.
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
