"""``kvtierctl fsck``: verify every block file under an fs tier root, in bounded memory.

Invariants:

* Nothing is followed through a symlink and nothing is opened in a way that
  can block (:mod:`~kvtierd.tiers.fs.safefs`): a FIFO, socket, device, directory
  or symlink where a block file belongs is reported bad without being read; a
  symlink where a pool or fan-out directory belongs is reported, not entered.
* A file's size is checked against its header before a byte of payload is
  read: a header claiming more payload than the file holds, or a file that is
  not exactly header + one block (a sparse 1 TiB file, say) is reported at once.
* A payload is hashed in :data:`CHUNK_BYTES` pieces through one reused buffer,
  so memory stays bounded whatever the files hold.
* ``remove=True`` unlinks what it reported, if the path still names what was
  judged, and never a directory. Temp files are counted, never removed (a live
  daemon may be writing them); a daemon treats a removed file as a miss.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvtierd.tiers.blockformat import FINGERPRINT_BYTES, HEADER_SIZE, CorruptBlock
from kvtierd.tiers.fs import blockfile, fsformat, safefs
from kvtierd.tiers.fs.fsformat import BLOCK_SUFFIX, POOL_FILE, TEMP_SUFFIX
from kvtierd.tiers.fs.safefs import DIRECTORY, Entry, Identity, PoolDir, UnexpectedEntry
from kvtierd.util import filekind

CHUNK_BYTES = 1 << 20  # payload bytes read and hashed at a time
_POOL_DIR_NAME = re.compile(r"-[0-9a-f]{16}$")  # <pool>-<fingerprint16>


@dataclass(slots=True)
class FsckReport:
    """What :func:`fsck` found: ``bad`` lists ``(path, reason)``."""

    root: str
    pools: int = 0
    files_checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    removed: int = 0
    temp_files: int = 0

    @property
    def clean(self) -> bool:
        return not self.bad


def fsck(
    root: str | os.PathLike[str],
    *,
    remove: bool = False,
    progress: Callable[[int, str], None] | None = None,
) -> FsckReport:
    """Verifies every block file under every pool directory of ``root`` completely.

    Checks type (a regular file), size, header, pool fingerprint, payload
    length, file name vs key and the payload checksum. ``progress(files_checked,
    path)`` is called after each block file.
    """
    checker = _Checker(os.fspath(root), remove, progress)
    with os.scandir(checker.report.root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_symlink():
            if _POOL_DIR_NAME.search(entry.name):
                checker.bad_link(entry.path, functools.partial(os.unlink, entry.path))
        elif entry.is_dir(follow_symlinks=False):
            checker.pool_dir(entry.path)
        elif _POOL_DIR_NAME.search(entry.name):  # a FIFO, file... where a pool dir belongs
            checker.not_a_pool_dir(entry, functools.partial(os.unlink, entry.path))
    return checker.report


class _Reported(Exception):
    """What went wrong is in the report already."""


class _Checker:
    """One fsck run: the report and the one payload buffer it reuses."""

    def __init__(
        self, root: str, remove: bool, progress: Callable[[int, str], None] | None
    ) -> None:
        self.report = FsckReport(root=root)
        self._remove = remove
        self._progress = progress
        self._buffer = memoryview(bytearray(CHUNK_BYTES))

    def bad_link(self, path: str, unlink: Callable[[], None] | None) -> None:
        self._bad(path, "a symlink, not a directory: not followed", unlink)

    def not_a_pool_dir(self, entry: os.DirEntry[str], unlink: Callable[[], None]) -> None:
        """The daemon refuses the pool whose directory name this takes (it creates the
        directory itself): listed, so that a clean fsck means a usable root."""
        try:
            kind = filekind.describe(entry.path, entry.stat(follow_symlinks=False).st_mode)
        except OSError:  # raced away
            return
        self._bad(entry.path, f"{kind}, not a directory", unlink)

    def pool_dir(self, path: str) -> None:
        try:
            pool = PoolDir(path)
        except (OSError, UnexpectedEntry) as exc:  # raced away, or into a symlink
            self._bad(path, f"cannot open: {exc}")
            return
        with pool:
            try:
                described = self._pool_description(pool)
            except _Reported:
                self.report.pools += 1
                return
            if described is None:
                return  # not a pool directory
            self.report.pools += 1
            for entry in pool.walk(lambda p, exc: self._bad(p, f"cannot list: {exc}")):
                self._entry(pool, entry, *described)

    def _pool_description(self, pool: PoolDir) -> tuple[bytes, int] | None:
        """``(fingerprint, block_bytes)`` from ``pool.json``; None when there is
        none (not a pool directory). Raises _Reported when it is bad."""
        path = pool.full(POOL_FILE)
        try:
            raw = pool.read_small(POOL_FILE, fsformat.POOL_FILE_MAX_BYTES)
        except UnexpectedEntry as exc:
            reason, identity = blockfile_reason(exc)
            self._bad(path, reason, _unlinker(pool.fd, POOL_FILE, identity))
            raise _Reported from None
        except (OSError, ValueError) as exc:
            self._bad(path, f"unreadable pool description: {exc}")
            raise _Reported from None
        if raw is None:
            return None
        try:
            desc: Any = json.loads(raw)
            fingerprint = bytes.fromhex(desc["fingerprint"])
            block_bytes = int(desc["block_bytes"])
            if len(fingerprint) != FINGERPRINT_BYTES or block_bytes < 1:
                raise ValueError(f"fingerprint {desc['fingerprint']!r}, block_bytes {block_bytes}")
        except (ValueError, KeyError, TypeError) as exc:
            self._bad(path, f"unreadable pool description: {exc}")
            raise _Reported from None
        return fingerprint, block_bytes

    def _entry(self, pool: PoolDir, entry: Entry, fingerprint: bytes, block_bytes: int) -> None:
        path = pool.full(entry.rel)
        if entry.name.endswith(TEMP_SUFFIX) and entry.kind != DIRECTORY:
            self.report.temp_files += 1
        elif entry.name.endswith(BLOCK_SUFFIX):
            self.report.files_checked += 1
            found = self._check(entry, path, fingerprint, block_bytes)
            if found is not None:
                reason, identity = found
                self._bad(path, reason, _unlinker(entry.dir_fd, entry.name, identity))
            if self._progress is not None:
                self._progress(self.report.files_checked, path)
        elif entry.kind == "symlink":
            self.bad_link(path, _unlinker(entry.dir_fd, entry.name, _lstat_identity(entry)))

    def _check(
        self, entry: Entry, path: str, fingerprint: bytes, block_bytes: int
    ) -> tuple[str, Identity | None] | None:
        """None if the block file verifies; else why not and, if it may be removed,
        its identity."""
        try:
            fd, st = safefs.open_regular_entry(entry, path)
        except FileNotFoundError:
            return None  # removed meanwhile (a live daemon evicted it)
        except UnexpectedEntry as exc:
            return blockfile_reason(exc)
        except OSError as exc:
            return f"unreadable: {exc}", None
        try:
            verify_open_file(fd, st, entry.rel, fingerprint, block_bytes, self._buffer)
        except CorruptBlock as exc:
            return exc.reason, safefs.identity_of(st)
        except OSError as exc:
            return f"unreadable: {exc}", None
        finally:
            os.close(fd)
        return None

    def _bad(self, path: str, reason: str, unlink: Callable[[], None] | None = None) -> None:
        self.report.bad.append((path, reason))
        if self._remove and unlink is not None:
            try:
                unlink()
            except FileNotFoundError:
                return
            self.report.removed += 1


def verify_open_file(
    fd: int,
    st: os.stat_result,
    rel: str,
    fingerprint: bytes,
    block_bytes: int,
    buffer: memoryview,
) -> None:
    """Verifies the open block file ``fd`` (``st``: its fstat) completely: the
    header check the start-up scan makes (:func:`~kvtierd.tiers.fs.blockfile.check_header`),
    then the payload's checksum, read in ``len(buffer)``-byte chunks. Raises
    CorruptBlock(reason)."""
    header = blockfile.check_header(fd, st, rel, fingerprint, block_bytes)
    hasher = xxhash.xxh3_64()
    offset, left = HEADER_SIZE, block_bytes
    while left:
        n = os.preadv(fd, [buffer[: min(left, len(buffer))]], offset)
        if n <= 0:
            raise CorruptBlock(f"short read: the file ended {left} bytes early")
        hasher.update(buffer[:n])
        offset += n
        left -= n
    if hasher.intdigest() != header.payload_checksum:
        raise CorruptBlock("payload checksum mismatch")


def blockfile_reason(exc: UnexpectedEntry) -> tuple[str, Identity | None]:
    """Why an entry that is not a regular file is bad, and its identity if it may be
    removed (never a directory)."""
    if exc.kind == DIRECTORY:
        return "a directory, not a regular file (never removed)", None
    return f"a {exc.kind}, not a regular file", exc.identity


def _lstat_identity(entry: Entry) -> Identity | None:
    try:
        return safefs.identity_of(os.stat(entry.name, dir_fd=entry.dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        return None


def _unlinker(dir_fd: int, name: str, identity: Identity | None) -> Callable[[], None] | None:
    """Unlinks ``name`` if it is still ``identity`` (None: nothing may be removed)."""
    if identity is None:
        return None

    def unlink() -> None:
        if not safefs.unlink_if_same(dir_fd, name, identity):
            raise FileNotFoundError(name)

    return unlink
