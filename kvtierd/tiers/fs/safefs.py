"""Paths below an fs tier's pool directory, opened without blocking or following links.

Anyone who may write in a tier root can plant a FIFO, a device node, a Unix
socket, a directory or a symlink where the tier expects a block file or a
fan-out directory. Everything the tier does below a pool directory goes
through :class:`PoolDir`, which keeps these invariants:

* The pool directory and every directory below it are opened one component at
  a time (``openat``) with ``O_DIRECTORY | O_NOFOLLOW``: a symlink (or anything
  but a directory) on the way is :class:`UnexpectedEntry`, never followed, so
  nothing outside the root is ever opened, renamed or removed. The root itself
  and the directories above it are the operator's and are trusted.
* A file is opened with ``O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`` and
  then checked with ``fstat``: anything but a regular file is
  :class:`UnexpectedEntry` naming its type. The open itself cannot block (a
  FIFO opens at once in non-blocking mode; a socket fails with ENXIO).
* Nothing here removes a directory: :meth:`PoolDir.unlink_if_same` unlinks a
  non-directory only while the name still refers to the inode that was judged.
* Every file descriptor opened here is closed before the call returns, except
  the one a caller asked for (:meth:`PoolDir.open_file`, :meth:`PoolDir.parent`).

Fast path: on Linux 5.6+ a path below the pool directory is opened with one
``openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)`` instead of one ``openat``
per component (the kernel refuses any symlink on the way); when that fails for
any reason but ENOENT, the component-by-component walk runs to say exactly
what is wrong. Without ``openat2`` (older kernels, seccomp) the walk always runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtierd.tiers.fs.permissions import DIR_MODE, FILE_MODE  # nothing for others
from kvtierd.util.filekind import DIRECTORY, REGULAR, kind_of

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

Identity = tuple[int, int]  # (st_dev, st_ino)

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (asm-generic table)
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def _load_openat2() -> Callable[..., int] | None:
    """libc's ``syscall`` (to call openat2, which Python does not wrap), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall


_syscall = _load_openat2()
_have_openat2 = _syscall is not None  # False for good after ENOSYS, EPERM, EINVAL, E2BIG
_NO_OPENAT2 = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG)  # kernel or seccomp


def uses_openat2() -> bool:
    """Whether opens below a pool directory go through one ``openat2`` (True) or
    the component-by-component walk (False: no usable openat2 on this kernel)."""
    return _have_openat2 and _syscall is not None


@contextlib.contextmanager
def walk_only() -> Iterator[None]:
    """Within the block, opens take the component-by-component walk, as on a kernel
    without openat2 (what the module switches to by itself after ENOSYS or EPERM);
    the previous mode comes back after it. Single-threaded use (tests, tools)."""
    global _have_openat2
    before = _have_openat2
    _have_openat2 = False
    try:
        yield
    finally:
        _have_openat2 = before


def _open_beneath(dir_fd: int, rel: str, flags: int) -> int | None:
    """``rel`` below ``dir_fd`` opened in one ``openat2`` that follows no symlink;
    None when that is unavailable or failed (the caller walks the components to
    learn why). Raises FileNotFoundError when something on the way is missing."""
    global _have_openat2
    if not _have_openat2 or _syscall is None:
        return None
    how = _OpenHow(flags, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
    fd = _syscall(
        ctypes.c_long(_SYS_OPENAT2),  # variadic: pass every argument at its C width
        ctypes.c_long(dir_fd),
        ctypes.c_char_p(rel.encode()),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code == errno.ENOENT:
        raise _missing(rel)
    if code in _NO_OPENAT2:  # no (usable) openat2 here: walk from now on
        _have_openat2 = False
    return None


@dataclass(eq=False)
class UnexpectedEntry(Exception):
    """``path`` is a ``kind`` where a ``expected`` (regular file or directory) should be.

    ``identity`` is the entry's ``(st_dev, st_ino)`` from ``lstat`` (None when
    it vanished meanwhile); ``removable`` says whether it may be unlinked
    (anything but a directory).
    """

    path: str
    kind: str
    expected: str
    identity: Identity | None

    def __str__(self) -> str:
        return f"{self.path} is a {self.kind}, not a {self.expected}"

    @property
    def removable(self) -> bool:
        return self.kind != DIRECTORY and self.identity is not None


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry met by :meth:`PoolDir.walk`. ``dir_fd`` stays open only until the
    walk moves on; ``kind`` comes from the directory entry (or ``lstat``)."""

    rel: str  # relative to the pool directory, "/"-separated
    name: str
    dir_fd: int
    kind: str


class PoolDir:
    """An open pool directory; every path below it is resolved safely (module docstring).

    A context manager: the directory's descriptor is closed on exit. Not
    thread-safe as an object, but cheap: open one per request or operation.
    """

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.path = path
        self.fd = _open_dir(None, path, path, create=create)

    def __enter__(self) -> PoolDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def full(self, rel: str) -> str:
        """``rel`` as a full path (for messages)."""
        return os.path.join(self.path, rel)

    @contextlib.contextmanager
    def parent(self, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """``(descriptor of rel's directory, rel's last component)``; directories on
        the way are created when ``create``. Raises UnexpectedEntry, OSError."""
        *dirs, name = rel.split("/")
        fd = self.fd
        walked = self.path
        if dirs:
            try:
                fast = _open_beneath(self.fd, "/".join(dirs), DIR_FLAGS)
            except FileNotFoundError:
                if not create:
                    raise _missing(self.full(rel)) from None
                fast = None
            if fast is not None:
                try:
                    yield fast, name
                finally:
                    os.close(fast)
                return
        try:
            for part in dirs:
                walked = os.path.join(walked, part)
                child = _open_dir(fd, part, walked, create=create)
                if fd != self.fd:
                    os.close(fd)
                fd = child
            yield fd, name
        finally:
            if fd != self.fd:
                os.close(fd)

    def open_file(self, rel: str) -> tuple[int, os.stat_result]:
        """Opens the regular file ``rel`` read-only (``O_NONBLOCK`` still set):
        ``(descriptor, fstat)``. Raises UnexpectedEntry for anything else,
        FileNotFoundError, or another OSError (the file is kept)."""
        try:
            fd = _open_beneath(self.fd, rel, FILE_FLAGS)
        except FileNotFoundError:
            raise _missing(self.full(rel)) from None
        if fd is not None:
            return _checked_regular(fd, self.full(rel))
        with self.parent(rel) as (dir_fd, name):
            return open_regular(dir_fd, name, self.full(rel))

    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel`` (None: missing)."""
        with self.parent(rel) as (dir_fd, name):
            return _lstat(dir_fd, name)

    def unlink_if_same(self, rel: str, identity: Identity) -> bool:
        """Unlinks ``rel`` if it still names ``identity`` and is not a directory."""
        with self.parent(rel) as (dir_fd, name):
            return unlink_if_same(dir_fd, name, identity)

    def unlink(self, rel: str) -> None:
        """Unlinks ``rel`` unless it is missing or a directory."""
        with self.parent(rel) as (dir_fd, name):
            st = _lstat(dir_fd, name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)

    def rename(self, rel: str, new_name: str) -> None:
        """Renames ``rel`` to ``new_name`` in the same directory (metadata only)."""
        with self.parent(rel) as (dir_fd, name):
            os.rename(name, new_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def read_small(self, rel: str, limit_bytes: int) -> bytes | None:
        """The contents of the regular file ``rel`` (None: missing). Raises
        UnexpectedEntry, OSError, or ValueError when it holds more than
        ``limit_bytes`` (checked with fstat before reading)."""
        try:
            fd, st = self.open_file(rel)
        except FileNotFoundError:
            return None
        try:
            if st.st_size > limit_bytes:
                raise ValueError(
                    f"{self.full(rel)} is {st.st_size} bytes, more than the {limit_bytes} expected"
                )
            chunks: list[bytes] = []
            while len(data := os.read(fd, limit_bytes + 1 - sum(map(len, chunks)))) > 0:
                chunks.append(data)
                if sum(map(len, chunks)) > limit_bytes:
                    raise ValueError(f"{self.full(rel)} grew past {limit_bytes} bytes")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_new(self, name: str, data: bytes, temp_name: str) -> None:
        """Writes ``data`` as ``name`` in the pool directory itself: a new temp file
        (``O_EXCL``), then a rename over ``name``. The temp file is removed on failure."""
        fd = os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=self.fd)  # fmt: skip
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.rename(temp_name, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name, dir_fd=self.fd)
            raise

    def walk(self, on_error: Callable[[str, BaseException], None]) -> Iterator[Entry]:
        """Every entry of the pool directory's layout (``<file>``, ``<hh>/<file>``,
        ``<hh>/<hh>/<entry>``) in name order, without following any symlink.

        Directories at the first two levels are descended, not yielded; anything
        else there (symlinks included) is yielded; at the third level every
        entry is yielded and nothing is descended. ``on_error(path, exc)`` hears
        of a directory that could not be listed or opened (it is skipped).
        """
        yield from _walk(self.fd, "", self.path, 0, on_error)


def open_regular(dir_fd: int, name: str, path: str) -> tuple[int, os.stat_result]:
    """:meth:`PoolDir.open_file` for ``name`` in the open directory ``dir_fd``."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a socket; else: look at it
        st = _lstat(dir_fd, name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UnexpectedEntry(path, kind_of(st.st_mode), REGULAR, identity_of(st)) from None
        raise OSError(exc.errno, exc.strerror, path) from None
    return _checked_regular(fd, path)


def _checked_regular(fd: int, path: str) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` if ``fd`` is a regular file; else closes it and raises."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnexpectedEntry(path, kind_of(st.st_mode), REGULAR, identity_of(st))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular_entry(entry: Entry, path: str) -> tuple[int, os.stat_result]:
    """:func:`open_regular` of a walked entry; one the directory entry says is not
    a regular file is checked by ``lstat`` and never opened. Raises
    UnexpectedEntry naming what it is, FileNotFoundError if it is gone."""
    if entry.kind != REGULAR:
        bad = recheck(entry.dir_fd, entry.name, path, REGULAR)
        if bad is not None:
            raise bad
    return open_regular(entry.dir_fd, entry.name, path)


def recheck(dir_fd: int, name: str, path: str, expected: str) -> UnexpectedEntry | None:
    """What ``name`` in ``dir_fd`` is now, by ``lstat`` (no open): None if it is
    the ``expected`` type after all, else the UnexpectedEntry it is. Raises
    FileNotFoundError if it is gone."""
    st = _lstat(dir_fd, name)
    if st is None:
        raise _missing(path)
    kind = kind_of(st.st_mode)
    return None if kind == expected else UnexpectedEntry(path, kind, expected, identity_of(st))


def unlink_if_same(dir_fd: int, name: str, identity: Identity) -> bool:
    """Unlinks ``name`` in ``dir_fd`` if it still names ``identity`` and is not a
    directory; whether it did."""
    st = _lstat(dir_fd, name)
    if st is None or identity_of(st) != identity or stat.S_ISDIR(st.st_mode):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def identity_of(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_dir(dir_fd: int | None, name: str, path: str, *, create: bool) -> int:
    """Opens directory ``name`` (in ``dir_fd``, or by path when None) without
    following a symlink; creates it first when missing and ``create``."""
    for attempt in (1, 2):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create or attempt == 2:
                raise _missing(path) from None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise OSError(exc.errno, exc.strerror, path) from None
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise UnexpectedEntry(path, kind_of(st.st_mode), DIRECTORY, identity_of(st)) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _entry_kind(entry: os.DirEntry[str]) -> str:
    """The entry's type, from the directory entry where it tells (no syscall)."""
    if entry.is_file(follow_symlinks=False):
        return REGULAR
    if entry.is_dir(follow_symlinks=False):
        return DIRECTORY
    if entry.is_symlink():
        return "symlink"
    try:
        return kind_of(entry.stat(follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return "vanished entry"


def _walk(
    dir_fd: int,
    rel_dir: str,
    path: str,
    depth: int,
    on_error: Callable[[str, BaseException], None],
) -> Iterator[Entry]:
    try:
        with os.scandir(dir_fd) as it:
            entries = sorted(((e.name, _entry_kind(e)) for e in it), key=lambda e: e[0])
    except OSError as exc:
        on_error(path, exc)
        return
    for name, kind in entries:
        rel = f"{rel_dir}{name}"
        if kind != DIRECTORY or depth == 2:
            yield Entry(rel, name, dir_fd, kind)
            continue
        child_path = os.path.join(path, name)
        try:
            child = _open_dir(dir_fd, name, child_path, create=False)
        except FileNotFoundError:
            continue
        except (OSError, UnexpectedEntry) as exc:  # raced into something else
            on_error(child_path, exc)
            continue
        try:
            yield from _walk(child, f"{rel}/", child_path, depth + 1, on_error)
        finally:
            os.close(child)
