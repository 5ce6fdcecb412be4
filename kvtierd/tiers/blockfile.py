"""Reading and writing one block file (DESIGN.md §6), with no index and no locks.

These functions are the FS tier's data path. They run on an I/O thread of the
daemon or in an I/O worker process (:mod:`kvtierd.tiers.ioworker`), so they
touch nothing but the file system and the row they are given.

Invariants:

* :func:`write_block_file` makes a file visible only complete: it writes a temp
  file in the target directory (header + payload, optional fdatasync) and
  renames it into place; on any failure it removes the temp file and raises.
* :func:`read_block_file` fills ``row`` and returns only if the file's size,
  header (magic, version, checksum, pool fingerprint, key, payload length) and
  payload checksum all verify. Otherwise ``row`` may hold garbage and it raises
  :class:`CorruptFile` (naming the inode that failed, so the caller removes
  only that file), FileNotFoundError, or another OSError (a transient error:
  the file is kept).
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence

from kvtierd.tiers import fsformat
from kvtierd.tiers.fsformat import HEADER_SIZE, CorruptBlock

O_DIRECT = getattr(os, "O_DIRECT", 0)


class CorruptFile(CorruptBlock):
    """A block file failed verification; ``identity`` is its ``(st_dev, st_ino)``."""

    def __init__(self, reason: str, identity: tuple[int, int]) -> None:
        super().__init__(reason)
        self.identity = identity


def header_buffer() -> mmap.mmap:
    """A page-aligned buffer for one header (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, HEADER_SIZE)


def write_block_file(
    path: str,
    temp_path: str,
    key: bytes,
    fingerprint: bytes,
    row: memoryview,
    head: mmap.mmap,
    *,
    o_direct: bool,
    fsync: bool,
) -> None:
    """Writes ``row`` as the block file of ``key`` at ``path`` (its directory exists).

    ``temp_path`` must be a name no other writer uses, in the same directory.
    ``head`` is a :func:`header_buffer` owned by the calling thread.
    """
    head[:] = fsformat.encode_header(
        key=key,
        fingerprint=fingerprint,
        payload_length=len(row),
        payload_checksum=fsformat.payload_checksum(row),
    )
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(temp_path, flags | (O_DIRECT if o_direct else 0), 0o644)
    try:
        try:
            write_all(fd, [memoryview(head), row])
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(temp_path, path)
    except BaseException:
        unlink_quietly(temp_path)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path))


def read_block_file(
    path: str,
    key: bytes,
    fingerprint: bytes,
    row: memoryview,
    head: mmap.mmap,
    *,
    o_direct: bool,
) -> None:
    """Reads the block file of ``key`` into ``row`` and verifies it completely."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0))
    try:
        st = os.fstat(fd)
        try:
            expected = HEADER_SIZE + len(row)
            if st.st_size != expected:
                raise CorruptBlock(f"file is {st.st_size} bytes, expected {expected}")
            got = read_all(fd, [memoryview(head), row])
            if got != expected:
                raise CorruptBlock(f"short read: {got} of {expected} bytes")
            header = fsformat.decode_header(head)
            fsformat.verify_header(header, key=key, fingerprint=fingerprint, block_bytes=len(row))
            if fsformat.payload_checksum(row) != header.payload_checksum:
                raise CorruptBlock("payload checksum mismatch")
        except CorruptBlock as exc:
            raise CorruptFile(exc.reason, (st.st_dev, st.st_ino)) from None
    finally:
        os.close(fd)


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
    """pwritev until every byte is written (loops on short writes)."""
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        n = os.pwritev(fd, remaining(buffers, done), done)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def read_all(fd: int, buffers: Sequence[memoryview]) -> int:
    """preadv until the buffers are full or EOF; returns bytes read."""
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        n = os.preadv(fd, remaining(buffers, done), done)
        if n <= 0:
            break
        done += n
    return done


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
