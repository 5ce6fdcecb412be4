"""The shared-memory region of one pool: ``num_blocks`` rows of ``block_bytes``.

Ownership (the contract every other process relies on):

* The daemon *creates* the region file, exactly once per pool, under
  ``memory.shm_dir`` with the name :func:`region_file_name` (pool name made safe,
  plus a hash of it). Clients (engine workers) only *attach* to a file the daemon
  announced in OpenSession (``kvtierd_client.region``); they never create, resize
  or unlink it.
* The daemon is the only process that unlinks it: in :meth:`Region.close` at pool
  shutdown, or when it replaces a stale file at creation. Workers that still have
  it mapped keep their mapping (Unix semantics); the memory is freed when the last
  mapping goes.
* Liveness marker: the creating daemon holds ``flock(LOCK_EX)`` on the file for
  the region's whole lifetime. The kernel drops the lock when the process dies,
  however it dies (SIGKILL included).

Stale-file protocol (a daemon that died without ``close()`` leaves its file):
``open(O_CREAT|O_EXCL)`` fails with EEXIST -> open the existing file and try
``flock(LOCK_EX|LOCK_NB)``. If the lock is taken, a live kvtierd owns the file:
:class:`RegionInUseError`, the file is left alone. If we get the lock, nobody
owns it: log a WARNING, unlink it and create a fresh file with ``O_EXCL`` again.
The old bytes are never reused: a crashed daemon's index is gone, so its rows
mean nothing, and its clients may still be writing into the old inode.
Before unlinking we check that the path still names the inode we locked, so a
racing daemon's brand-new file is never removed. (A residual window of a few
microseconds remains between another daemon's ``O_EXCL`` create and its
``flock``; two daemons sharing one ``shm_dir`` and pool name is a
misconfiguration that this protocol reports, not a supported setup.)

Why ``posix_fallocate``: a tmpfs file grown with ``ftruncate`` alone is sparse.
If the tmpfs (or /dev/shm) later runs out of space, the process that first
touches a missing page gets SIGBUS, which kills an engine worker in the middle
of a copy. Allocating every page at creation turns that into ENOSPC here, where
it becomes a clear :class:`InsufficientSpaceError`. (A memory cgroup limit
smaller than the tmpfs is not visible to statvfs; there the allocation is
charged to the daemon's cgroup at creation time, again instead of later.)
Pre-faulting (``MADV_POPULATE_WRITE``) then maps every page so that the first
copies do not run at page-fault speed (~1.1 GB/s instead of ~6.8 GB/s here).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import mmap
import operator
import os
import re
import stat
import threading
import time
import weakref
from typing import Any

from kvtierd.primary import safecopy
from kvtierd.primary.rows import RegionRows
from kvtierd.util import filekind
from kvtierd.util.flocks import flock_holder
from kvtierd.util.units import format_bytes

log = logging.getLogger(__name__)

ROW_ALIGNMENT = 4096  # block_bytes must be a multiple of this (the page size)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

_NAME_LIMIT = 80
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_OPEN_FLAGS = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
# Opening an existing file at a region path: anyone who can write shm_dir may
# have planted it, so never block (a FIFO) and never follow a link.
_PROBE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_CREATE_ATTEMPTS = 3  # stale file removed, then someone else's file appeared: give up


def region_file_name(pool_name: str) -> str:
    """The file name of ``pool_name``'s region: safe in any directory, unique per name.

    ``kvtierd-<name with chars outside [A-Za-z0-9._-] as '_', at most 80>-<12 hex of
    sha256(name)>.region``. The hash keeps names that sanitize alike apart.
    """
    safe = _UNSAFE_CHARS.sub("_", pool_name)[:_NAME_LIMIT]
    digest = hashlib.sha256(pool_name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"kvtierd-{safe}-{digest}.region"


def is_region_file_name(name: str) -> bool:
    """Whether ``name`` has the shape of :func:`region_file_name` (any pool)."""
    return name.startswith("kvtierd-") and name.endswith(".region")


class RegionError(Exception):
    """A region file could not be created."""


class InsufficientSpaceError(RegionError):
    """The region's directory has less free space than the region needs."""

    def __init__(self, directory: str, needed_bytes: int, available_bytes: int) -> None:
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"a region of {format_bytes(needed_bytes)} ({needed_bytes} bytes) does not fit in "
            f"{directory}: only {format_bytes(available_bytes)} ({available_bytes} bytes) are "
            f"free there. Ask for fewer blocks, free space in {directory}, or give it more "
            "(for a tmpfs: mount -o remount,size=...)"
        )


class RegionInUseError(RegionError):
    """Another live kvtierd holds the region file (its flock is taken)."""


class Region:
    """One pool's region file, created, mapped and owned by this daemon.

    Lifetime: :meth:`create` -> rows handed out with :meth:`row` / :meth:`buffer`
    -> :meth:`close` (unlinks the file). Only the daemon holds a ``Region``.

    Threads: :meth:`safe_rows` is how I/O threads (tiers) read and write rows:
    the daemon never dereferences the mapping itself (a client can truncate the
    file under it: SIGBUS; :mod:`kvtierd.primary.rows`). :meth:`row` and
    :meth:`buffer` are zero-copy views for tests and for the addresses the
    journal copies from; :meth:`close` runs once at shutdown, after the tiers
    stopped using the rows.
    """

    def __init__(
        self,
        *,
        path: str,
        fd: int,
        mapping: mmap.mmap,
        num_blocks: int,
        block_bytes: int,
        allocate_seconds: float,
        prefault_seconds: float,
    ) -> None:
        """Internal: use :meth:`create` (or
        :func:`kvtierd.primary.warm.adoption.adopt_region`, which takes over the file a
        previous daemon left). Takes ownership of ``fd``
        (flocked) and ``mapping``."""
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        # Invariant: size == num_blocks * block_bytes == len(self._mmap) while open
        self.size = num_blocks * block_bytes
        self.allocate_seconds = allocate_seconds  # posix_fallocate
        self.prefault_seconds = prefault_seconds  # MADV_POPULATE_WRITE or page touching
        self._fd = fd  # holds flock(LOCK_EX): the liveness marker; -1 once closed
        self._inode = _identity(os.fstat(fd))
        self._mmap: mmap.mmap | None = mapping  # None once closed
        self._views: list[weakref.ref[memoryview]] = []  # guarded by _lock
        self._views_pruned_at = 0  # guarded by _lock
        self._lock = threading.Lock()
        # the one way the daemon copies row bytes (never through the mapping); _lock
        self._safe_rows: RegionRows | None = None
        # memory.warm_restart: close() leaves the file for the next daemon to adopt
        self.keep_file = False

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        pool_name: str,
        num_blocks: int,
        block_bytes: int,
        *,
        mode: int = 0o660,
        gid: int | None = None,
        prefault: bool = True,
        stale_reason: str = "",
    ) -> Region:
        """Creates, allocates, maps and (optionally) pre-faults ``pool_name``'s region.

        The file is ``directory/region_file_name(pool_name)``, exactly ``mode``
        (the umask neither weakens nor widens it), group ``gid`` when given, and
        ``num_blocks * block_bytes`` bytes, all allocated and zero.

        Raises:
            ValueError: ``num_blocks < 1`` or ``block_bytes`` not a positive multiple of 4096.
            RegionInUseError: another live kvtierd holds the file.
            InsufficientSpaceError: ``directory`` cannot hold the region.
            OSError: anything else the kernel refused (permissions, ``gid``...).

        On any failure nothing is left behind: the mapping and fd are closed and
        the file this call created is unlinked.

        ``stale_reason``: why a stale file at the path is not adopted (warm restart);
        it goes into the one warning that reports its removal.
        """
        _check_geometry(num_blocks, block_bytes)
        directory = os.fspath(directory)
        path = os.path.join(directory, region_file_name(pool_name))
        size = num_blocks * block_bytes
        fd = _create_locked(path, mode, stale_reason)
        inode = _identity(os.fstat(fd))
        mapping: mmap.mmap | None = None
        try:
            _check_free_space(directory, size)
            os.fchmod(fd, mode)
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, size)
            allocate_seconds = _allocate(fd, size, directory)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=_PROT_RW)
            prefault_seconds = _prefault(mapping) if prefault else 0.0
        except BaseException:
            _discard(path, inode, fd, mapping)
            raise
        log.debug(
            "region %s: %s allocated in %.3fs, prefaulted in %.3fs",
            path, format_bytes(size), allocate_seconds, prefault_seconds,
        )  # fmt: skip
        return cls(
            path=path,
            fd=fd,
            mapping=mapping,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            allocate_seconds=allocate_seconds,
            prefault_seconds=prefault_seconds,
        )

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def fileno(self) -> int:
        """The daemon's own descriptor (it holds the liveness flock: never hand it
        out; ``security.region_access`` opens a new one from it)."""
        if self._fd < 0:
            raise ValueError(f"region {self.path} is closed")
        return self._fd

    def identity(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the region file (I/O workers check it when they map it)."""
        return self._inode

    def buffer(self) -> memoryview:
        """The whole region as one flat, writable, zero-copy memoryview (``size`` bytes).

        Valid until :meth:`close`, which releases it.
        """
        return self._track(self._mapping()[:])

    def safe_rows(self) -> RegionRows:
        """The region's :class:`~kvtierd.primary.rows.RegionRows`: how the daemon
        reads and writes row bytes (system calls only: a client that truncates
        the file makes a copy fail, never the daemon die of SIGBUS). One per
        region, closed by :meth:`close` before the mapping goes."""
        with self._lock:
            if self._safe_rows is None:
                self._safe_rows = RegionRows(
                    self._mapping(), self.block_bytes, path=self.path, fd=self.fileno()
                )
            return self._safe_rows

    def row(self, block_id: int) -> memoryview:
        """Row ``block_id`` (``block_bytes`` bytes, writable, zero-copy). For
        clients and tests: the daemon's own code copies rows with :meth:`safe_rows`.

        Raises IndexError unless ``0 <= block_id < num_blocks``. Valid until :meth:`close`.
        """
        block_id = operator.index(block_id)
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(
                f"block id {block_id} is outside region {self.path} (0..{self.num_blocks - 1})"
            )
        start = block_id * self.block_bytes
        return self._track(self._mapping()[start : start + self.block_bytes])

    def close(self) -> None:
        """Releases the views handed out, unmaps, unlinks the file (unless
        ``keep_file``: warm restart) and drops the flock.

        Idempotent. If a caller still holds a buffer derived from a view (a numpy
        array, say), the mapping cannot be closed now: that is logged and the
        mapping is left to the garbage collector; the file is unlinked anyway.
        """
        with self._lock:
            safe_rows = self._safe_rows
        if safe_rows is not None:
            safe_rows.close()  # waits for the copies in flight, then lets the mapping go
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        self._release_views()
        try:
            mapping.close()
        except BufferError:
            log.warning(
                "region %s: buffers derived from its rows are still alive; the mapping "
                "is left to the garbage collector",
                self.path,
            )
        if not self.keep_file:
            _unlink_if_same(self.path, self._inode)
        os.close(self._fd)  # drops the flock: the file is gone, the marker with it
        self._fd = -1

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Region {self.path} {self.num_blocks} x {self.block_bytes} bytes "
            f"({format_bytes(self.size)}) {state}>"
        )

    # -- internals --------------------------------------------------------------

    def _mapping(self) -> memoryview:
        mapping = self._mmap
        if mapping is None:
            raise ValueError(f"region {self.path} is closed")
        return memoryview(mapping)

    def _track(self, view: memoryview) -> memoryview:
        """Remembers ``view`` (weakly) so that :meth:`close` can release it."""
        with self._lock:
            self._views.append(weakref.ref(view))
            if len(self._views) > 2 * self._views_pruned_at + 64:
                self._views = [ref for ref in self._views if ref() is not None]
                self._views_pruned_at = len(self._views)
        return view

    def _release_views(self) -> None:
        with self._lock:
            views, self._views = self._views, []
        for ref in views:
            view = ref()
            if view is None:
                continue
            try:
                view.release()
            except BufferError:  # something was built on top of it; close() reports it
                pass


_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _check_geometry(num_blocks: int, block_bytes: int) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    if (
        isinstance(block_bytes, bool)
        or not isinstance(block_bytes, int)
        or block_bytes < ROW_ALIGNMENT
        or block_bytes % ROW_ALIGNMENT
    ):
        raise ValueError(
            f"block_bytes must be a positive multiple of {ROW_ALIGNMENT}, got {block_bytes!r}"
        )


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _create_locked(path: str, mode: int, stale_reason: str = "") -> int:
    """A new, empty file at ``path`` created with O_EXCL, its fd holding flock(LOCK_EX).

    An existing file is removed first if it is stale (see the module docstring).
    """
    for _ in range(_CREATE_ATTEMPTS):
        try:
            fd = os.open(path, _OPEN_FLAGS, mode)
        except FileExistsError:
            _remove_if_stale(path, stale_reason)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Another daemon locked our new file in the instant before we did and now
            # owns the path (it may already have replaced it): leave the path alone.
            os.close(fd)
            raise RegionInUseError(
                f"region file {path} was taken by another kvtierd while this one created it"
            ) from None
        except BaseException:
            _discard(path, _identity(os.fstat(fd)), fd, None)
            raise
        return fd
    raise RegionInUseError(
        f"region file {path} keeps reappearing after stale files were removed: "
        "another kvtierd is creating it in the same directory"
    )


def _remove_if_stale(path: str, reason: str = "") -> None:
    """Unlinks ``path`` if no live daemon holds its flock; RegionInUseError otherwise.

    Returns without unlinking if the path vanished or now names another file.
    """
    try:
        fd = os.open(path, _PROBE_FLAGS)
    except FileNotFoundError:
        return
    except OSError:
        # ELOOP (a symlink), ENXIO (a socket), EACCES (another user's file we may
        # not read), ...: not a region file this daemon could have left
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        raise _not_a_region(path, st) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _not_a_region(path, st)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegionInUseError(held_by_another(path, fd)) from None
        if not _path_names(path, _identity(st)):
            return  # replaced under us: try the create again
        if reason:
            log.warning(
                "starting cold: %s; removing region file %s (%s), its contents are "
                "discarded, not reused",
                reason, path, format_bytes(st.st_size),
            )  # fmt: skip
        else:
            log.warning(
                "removing stale region file %s (%s, %d bytes) left by a kvtierd that did not "
                "shut down; its contents are discarded, not reused",
                path, format_bytes(st.st_size), st.st_size,
            )  # fmt: skip
        os.unlink(path)
    finally:
        os.close(fd)  # drops our lock on the old inode


def held_by_another(path: str, fd: int) -> str:
    """What to say when the flock of the region file ``path`` (open as ``fd``) is
    taken: which process holds it (``/proc/locks``), and what to do."""
    holder = flock_holder(fd)
    who = f"pid {holder}" if holder is not None else "a process /proc/locks does not name"
    return (
        f"region file {path} is held by another live kvtierd, {who} (it holds the "
        "file's flock): a daemon replaced by a takeover holds its regions until it has "
        "exited, so wait for that; else it is a second daemon using this memory.shm_dir: "
        "stop it"
    )


def _not_a_region(path: str, st: os.stat_result) -> RegionError:
    """The error for a file at a region path that no kvtierd of this user made."""
    kind = filekind.describe(path, st.st_mode)
    return RegionError(
        f"{path} exists and is {kind} owned by uid {st.st_uid}, not a region file this "
        f"kvtierd (uid {os.geteuid()}) left behind; it is left alone. Remove it, or give "
        "memory.shm_dir a directory only kvtierd can write"
    )


def _path_names(path: str, inode: tuple[int, int]) -> bool:
    try:
        return _identity(os.lstat(path)) == inode
    except FileNotFoundError:
        return False


def _discard(path: str, inode: tuple[int, int], fd: int, mapping: mmap.mmap | None) -> None:
    """Undoes a failed create: unmaps, unlinks the file it created, closes ``fd``."""
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # an export survived in a traceback; the GC unmaps it
            log.warning("region %s: mapping left to the garbage collector", path)
    _unlink_if_same(path, inode)
    os.close(fd)


def _unlink_if_same(path: str, inode: tuple[int, int]) -> None:
    """Unlinks ``path`` only if it still names ``inode`` (never someone else's file)."""
    if _path_names(path, inode):
        _unlink_quietly(path)
    else:
        log.warning("region file %s was removed or replaced by someone else", path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_free_space(directory: str, size: int) -> None:
    available = _free_bytes(directory)
    if available < size:
        raise InsufficientSpaceError(directory, size, available)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _allocate(fd: int, size: int, directory: str) -> float:
    """Allocates every page of the file (ENOSPC now, not SIGBUS later); seconds taken."""
    start = time.perf_counter()
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise InsufficientSpaceError(directory, size, _free_bytes(directory)) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        log.debug("posix_fallocate is not supported in %s (%s); pages stay sparse", directory, exc)
    return time.perf_counter() - start


def _prefault(mapping: mmap.mmap) -> float:
    """Maps every page of ``mapping`` writable, preserving its bytes; seconds taken.

    MADV_POPULATE_WRITE where the kernel has it (>= 5.14); on EINVAL (older kernels)
    touch one byte per page instead. Other errors propagate.
    """
    start = time.perf_counter()
    try:
        madvise_populate_write(mapping)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        log.debug("MADV_POPULATE_WRITE unsupported (%s); touching every page", exc)
        touch_pages(mapping)
    return time.perf_counter() - start


def madvise_populate_write(mapping: mmap.mmap) -> None:
    """``madvise(MADV_POPULATE_WRITE)`` over the whole mapping, through ctypes.

    Public: replacing it simulates a kernel that refuses it (EINVAL: the fallback).

    ctypes releases the GIL for the call; ``mmap.madvise`` holds it for the
    whole call (measured: 4.7 s for 2 GiB here, during which a region created on
    a worker thread froze the event loop just the same). Raises OSError.
    """
    anchor = ctypes.c_char.from_buffer(mapping)  # an export: the mapping stays open
    try:
        if _libc().madvise(ctypes.addressof(anchor), len(mapping), MADV_POPULATE_WRITE):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del anchor


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def touch_pages(mapping: Any) -> None:
    """Faults every page of ``mapping`` in: the pre-fault of kernels without
    MADV_POPULATE_WRITE. The bytes stay as they were.

    It reads one byte per page with ``process_vm_readv`` (1024 pages a call), never
    touching the mapping from user space: a client of the socket group could open
    the region file by path and truncate it meanwhile, and a touch past the end
    would kill the daemon with SIGBUS; the read just stops short. Where the call
    is refused (seccomp) the pages fault in at first use instead (only speed).
    """
    view = memoryview(mapping)
    try:
        base = safecopy.address_of(view)
        page_starts = range(0, len(view), mmap.PAGESIZE)
        scratch = bytearray(safecopy.IOV_MAX)
        for first in range(0, len(page_starts), safecopy.IOV_MAX):
            chunk = [(start, start + 1) for start in page_starts[first : first + safecopy.IOV_MAX]]
            try:
                if safecopy.gather(base, chunk, scratch) < len(chunk):
                    return  # the file was cut short meanwhile: nothing more to fault in
            except OSError as exc:
                log.debug("process_vm_readv refused (%s); pages fault in at first use", exc)
                return
    finally:
        view.release()
