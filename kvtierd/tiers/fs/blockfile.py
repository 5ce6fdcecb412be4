"""Reading and writing one block file (docs/design/formats.md), with no index and no locks.

These functions are the FS tier's data path. They run on an I/O thread of the
daemon or in an I/O worker process (:mod:`kvtierd.tiers.fs.ioworker`), so they
touch nothing but the file system and the row they are given. Every path is
resolved below an open :class:`~kvtierd.tiers.fs.safefs.PoolDir`: no symlink is
followed and no open can block.

Invariants:

* :func:`write_block_file` makes a file visible only complete: it writes a temp
  file in the target directory (header + payload, optional fdatasync) and
  renames it into place; on any failure it removes the temp file and raises an
  OSError whose ``filename`` is the block file's full path.
* :func:`read_block_file` fills ``row`` and returns only if the file is a
  regular file and its size, header (magic, version, checksum, pool
  fingerprint, key, payload length) and payload checksum -- or, for a tier with
  integrity keys, its MAC (:func:`~kvtierd.tiers.blockformat.check_payload`) --
  all verify. Otherwise
  ``row`` may hold garbage and it raises :class:`CorruptFile` (naming the inode
  that failed, so the caller removes only that file; a FIFO, socket, device,
  directory or symlink in its place is one too), FileNotFoundError, or another
  OSError (a transient error: the file is kept).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Callable, Sequence

from kvtierd.tiers import blockformat
from kvtierd.tiers.blockformat import HEADER_SIZE, CorruptBlock
from kvtierd.tiers.fs import fsformat
from kvtierd.tiers.fs.permissions import FILE_MODE
from kvtierd.tiers.fs.safefs import REGULAR, Identity, PoolDir, UnexpectedEntry
from kvtierd.tiers.integrity import KeyRing

O_DIRECT = getattr(os, "O_DIRECT", 0)


class CorruptFile(CorruptBlock):
    """A block file failed verification.

    ``identity`` is the ``(st_dev, st_ino)`` of what failed, if the caller may
    unlink it (when the path still names it); None when it must be left alone
    (a directory, or a symlinked directory on the way). ``kind`` is what was
    found at the path ("regular file" for a file whose contents failed).
    ``integrity``: it failed the keyed check (counted apart, ``integrity_failures``).
    """

    def __init__(
        self, reason: str, identity: Identity | None, kind: str = REGULAR, integrity: bool = False
    ) -> None:
        super().__init__(reason)
        self.identity = identity
        self.kind = kind
        self.integrity = integrity


def header_buffer() -> mmap.mmap:
    """A page-aligned buffer for one header (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, HEADER_SIZE)


def write_block_file(
    pool: PoolDir,
    rel: str,
    temp_name: str,
    key: bytes,
    fingerprint: bytes,
    row: memoryview,
    head: mmap.mmap,
    *,
    o_direct: bool,
    fsync: bool,
    keys: KeyRing | None = None,
) -> None:
    """Writes ``row`` as the block file of ``key`` at ``rel`` below ``pool``
    (missing directories on the way are created; symlinked ones are refused),
    its header sealed with ``keys`` (version 1 without).

    ``temp_name`` must be a name no other writer uses; it is created in the
    block file's directory. ``head`` is a :func:`header_buffer` owned by the
    calling thread.
    """
    head[:] = blockformat.block_header(key=key, fingerprint=fingerprint, payload=row, keys=keys)
    try:
        with pool.parent(rel, create=True) as (dir_fd, name):
            _write_and_rename(dir_fd, name, temp_name, [memoryview(head), row], o_direct, fsync)
    except UnexpectedEntry as exc:
        code = errno.ELOOP if exc.kind == "symlink" else errno.ENOTDIR
        raise OSError(code, f"{exc}: not followed", pool.full(rel)) from None
    except OSError as exc:  # name the block file, whichever step failed
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, pool.full(rel)) from None


def _write_and_rename(
    dir_fd: int,
    name: str,
    temp_name: str,
    buffers: Sequence[memoryview],
    o_direct: bool,
    fsync: bool,
) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
    fd = os.open(temp_name, flags, FILE_MODE, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, buffers)
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(temp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name, dir_fd=dir_fd)
        raise
    if fsync:
        os.fsync(dir_fd)


def read_block_file(
    pool: PoolDir,
    rel: str,
    key: bytes,
    fingerprint: bytes,
    row: memoryview,
    head: mmap.mmap,
    *,
    o_direct: bool,
    keys: KeyRing | None = None,
) -> None:
    """Reads the block file of ``key`` at ``rel`` below ``pool`` into ``row`` and
    verifies it completely (sealed under one of ``keys``; unkeyed without)."""
    try:
        fd, st = pool.open_file(rel)
    except UnexpectedEntry as exc:
        raise bad_entry(exc) from None
    try:
        if o_direct:  # after the fstat: O_DIRECT on a FIFO would fail the open (EINVAL)
            fcntl.fcntl(fd, fcntl.F_SETFL, O_DIRECT)  # also clears O_NONBLOCK
        try:
            expected = HEADER_SIZE + len(row)
            if st.st_size != expected:
                raise CorruptBlock(f"file is {st.st_size} bytes, expected {expected}")
            got = read_all(fd, [memoryview(head), row])
            if got != expected:
                raise CorruptBlock(f"short read: {got} of {expected} bytes")
            header = blockformat.decode_header(head)
            blockformat.verify_header(
                header, key=key, fingerprint=fingerprint, block_bytes=len(row)
            )
            blockformat.check_payload(head, header, row, keys)
        except CorruptBlock as exc:
            identity = (st.st_dev, st.st_ino)
            raise CorruptFile(exc.reason, identity, integrity=exc.integrity) from None
    finally:
        os.close(fd)


def check_header(
    fd: int, st: os.stat_result, rel: str, fingerprint: bytes, block_bytes: int
) -> blockformat.Header:
    """The one header check of a block file met by listing its pool directory (the
    start-up scan, ``fsck``): size, header, pool fingerprint, payload length, and
    the file's name against its key. ``fd`` is the open file at ``rel`` (relative
    to the pool directory), ``st`` its fstat. The payload is not read.

    Sizes are checked against the header before anything else is read, so a
    sparse 1 TiB file or a header claiming more payload than the file holds
    costs one header read. Raises CorruptBlock(reason).
    """
    if st.st_size < HEADER_SIZE:
        raise CorruptBlock(f"file is {st.st_size} bytes, shorter than a {HEADER_SIZE}-byte header")
    header = blockformat.decode_header(os.pread(fd, HEADER_SIZE, 0))
    holds = st.st_size - HEADER_SIZE
    if header.payload_length > holds:
        raise CorruptBlock(
            f"header claims {header.payload_length} payload bytes, the file holds {holds}"
        )
    blockformat.verify_header(header, key=None, fingerprint=fingerprint, block_bytes=block_bytes)
    if fsformat.block_rel_path(header.key) != rel:
        raise CorruptBlock(f"header names key {header.key.hex()}, not this file")
    if holds != block_bytes:
        raise CorruptBlock(f"file is {st.st_size} bytes, expected {HEADER_SIZE + block_bytes}")
    return header


def bad_entry(exc: UnexpectedEntry) -> CorruptFile:
    """The CorruptFile standing for something other than a regular file at a block
    file's path (its own identity: removable unless a directory), or for a
    directory on the way that is not one (left alone: the message names it)."""
    if exc.expected == REGULAR:
        identity = exc.identity if exc.removable else None
        return CorruptFile(f"a {exc.kind}, not a regular file", identity, exc.kind)
    return CorruptFile(str(exc) + ": not followed", None, exc.kind)


def remaining(buffers: Sequence[memoryview], done: int) -> list[memoryview]:
    """The parts of ``buffers`` after the first ``done`` bytes."""
    out = []
    for buf in buffers:
        if done >= len(buf):
            done -= len(buf)
            continue
        out.append(buf[done:] if done else buf)
        done = 0
    return out


def write_all(fd: int, buffers: Sequence[memoryview]) -> None:
    """pwritev until every byte is written (loops on short writes); EIO when a write
    makes no progress."""
    if _vectored(os.pwritev, fd, buffers) < sum(len(b) for b in buffers):
        raise OSError(errno.EIO, "write made no progress")


def read_all(fd: int, buffers: Sequence[memoryview]) -> int:
    """preadv until the buffers are full or EOF; returns bytes read."""
    return _vectored(os.preadv, fd, buffers)


def _vectored(
    call: Callable[[int, list[memoryview], int], int], fd: int, buffers: Sequence[memoryview]
) -> int:
    """``call(fd, the buffers past the bytes done, offset)`` (pwritev or preadv, from
    offset 0) until every byte of ``buffers`` moved or a call moved none; the bytes moved."""
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        n = call(fd, remaining(buffers, done), done)
        if n <= 0:
            break
        done += n
    return done


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
