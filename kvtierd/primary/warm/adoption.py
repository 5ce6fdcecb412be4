"""Warm restart: adopting a pool's region and journal left by the previous daemon
(``memory.warm_restart``; docs/design/journal.md).

:func:`adopt_region` runs on a worker thread when the first session of a pool
opens it. It either returns an :class:`Adoption` (the old region file, mapped
and flocked, plus the blocks whose bytes verified) or a reason the pool must
start cold; it never guesses:

* the journal must exist, be of a version this daemon reads
  (:data:`kvtierd.primary.warm.journalformat.READABLE_VERSIONS`), have a valid
  header, and name this pool's fingerprint (name, block_bytes, num_blocks,
  layout), today's access (region mode, group, principals: every
  process that mapped the region keeps it, so a pool whose access was narrowed
  must get a new file) and the region file's (st_dev, st_ino);
* the region file must be this uid's regular file, of the right size, and not
  flocked by a live daemon;
* a block is adopted only if its row's xxh3_64 (over the bytes the journal's
  ``checksum_bytes`` covers), bound to its key, its row and the pool
  (:func:`kvtierd.primary.warm.journalformat.bind_checksum`), equals the checksum of its
  ``ready`` record (a row modified there while the daemon was down is dropped, and
  so is a record whose key or row was changed);
* the rows the old daemon's clients may still touch are held, each as long as
  they may (:mod:`kvtierd.primary.warm.holds`: after a graceful stop the rows
  pinned or reserved at the stop; after a crash every row the journal names,
  until the old daemon's last lease and write fence end). An adopted block held
  stays pinned (HIT, never evicted), any other held row quarantined; every
  other block is evictable and every other row free at once.

The eviction policy and recency order are not part of the fingerprint: the
adopted blocks enter the policy in journal order (oldest ``ready`` first).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass

from kvtierd.contract import BlockKey
from kvtierd.primary.region import (
    MADV_POPULATE_WRITE,
    Region,
    held_by_another,
    madvise_populate_write,
)
from kvtierd.primary.warm.holds import OldClientHolds, old_client_holds
from kvtierd.primary.warm.journalformat import (
    JournalError,
    JournalHeader,
    Replay,
    bind_checksum,
    read_journal,
)
from kvtierd.primary.warm.rowsums import checksum_spans, read_row_checksum

log = logging.getLogger(__name__)

_OPEN_REGION = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
# the journal's bound when read back: the live size is at most one record per
# row; a file past twice that plus the slack was never written by a kvtierd
_READ_SLACK_BYTES = 4 << 20


class ColdStart(Exception):
    """The pool cannot be adopted; the message is the one log line saying why."""


@dataclass(slots=True)
class Adoption:
    """What the previous daemon left that this one takes over."""

    region: Region
    blocks: list[tuple[BlockKey, int, int]]  # (key, row, checksum), oldest ready first
    holds: OldClientHolds  # rows the old daemon's clients may still touch, and how long
    dropped: int  # ready blocks whose checksum failed
    torn_bytes: int  # bytes after the last valid record, ignored
    damaged_at: int | None  # where the journal is damaged in the middle (Replay.damaged_at)
    fence_seconds: float  # the old daemon's lease + write_quarantine (journal header)
    seconds: float  # replay + verification


def adopt_region(
    region_path: str,
    journal: str,
    header: JournalHeader,
    *,
    prefault: bool,
    fence_seconds: float,
) -> Adoption:
    """Adopts the region at ``region_path`` described by ``journal`` for the pool
    ``header`` names (its st_dev/st_ino are ignored: the journal says those).
    ``fence_seconds``: this daemon's lease + write_quarantine (a version-2
    journal's rows are held for the longer of it and the old daemon's).

    Raises FileNotFoundError when there is no region or journal (a first start),
    ColdStart with the reason otherwise. Blocking (reads and hashes the rows)."""
    start = time.perf_counter()
    max_journal = 2 * header.num_blocks * 300 + _READ_SLACK_BYTES
    try:
        replay = read_journal(journal, max_journal)
    except JournalError as exc:
        raise ColdStart(str(exc)) from None
    _check_fingerprint(replay.header, header)
    fd = os.open(region_path, _OPEN_REGION)
    mapping: mmap.mmap | None = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ColdStart(f"region {region_path} is not a regular file of uid {os.geteuid()}")
        if (st.st_dev, st.st_ino) != (replay.header.st_dev, replay.header.st_ino):
            raise ColdStart(
                f"region {region_path} is not the file the journal describes (inode "
                f"{st.st_ino}, the journal names {replay.header.st_ino}): it was replaced"
            )
        size = header.num_blocks * header.block_bytes
        if st.st_size != size:
            raise ColdStart(f"region {region_path} is {st.st_size} bytes, expected {size}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ColdStart(held_by_another(region_path, fd)) from None
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if prefault and MADV_POPULATE_WRITE:
            try:
                madvise_populate_write(mapping)
            except OSError:
                pass  # only speed: pages fault in at first use
        spans = checksum_spans(header.block_bytes, header.checksum_bytes)
        blocks, dropped = _verify(fd, replay, header.block_bytes, spans)
        fallback = max(fence_seconds, replay.header.fence_seconds)
        holds = old_client_holds(replay, fallback)
    except BaseException:
        if mapping is not None:
            mapping.close()
        os.close(fd)
        raise
    region = Region(
        path=region_path,
        fd=fd,
        mapping=mapping,
        num_blocks=header.num_blocks,
        block_bytes=header.block_bytes,
        allocate_seconds=0.0,
        prefault_seconds=0.0,
    )
    return Adoption(
        region=region,
        blocks=blocks,
        holds=holds,
        dropped=dropped,
        torn_bytes=replay.torn_bytes,
        damaged_at=replay.damaged_at,
        fence_seconds=replay.header.fence_seconds,
        seconds=time.perf_counter() - start,
    )


def _check_fingerprint(found: JournalHeader, wanted: JournalHeader) -> None:
    for field in ("name", "block_bytes", "num_blocks", "layout", "checksum_bytes"):
        old, new = getattr(found, field), getattr(wanted, field)
        if old != new:
            raise ColdStart(f"the pool's {field} changed from {old!r} to {new!r}")
    if found.access != wanted.access:
        raise ColdStart(
            f"who may map its region changed (from {found.access or 'unrecorded'!r} to "
            f"{wanted.access!r}: server.socket_group, [[security.principals]]); a process "
            "that mapped the old region keeps it, so it must not hold the bytes stored from now on"
        )


def _verify(
    fd: int, replay: Replay, block_bytes: int, spans: list[tuple[int, int]]
) -> tuple[list[tuple[BlockKey, int, int]], int]:
    """Checks every ready row's bytes, read from the region file ``fd`` (``preadv``,
    not the mapping: the old daemon's clients still hold the file and one that
    truncates it must not kill this daemon with SIGBUS; a short read fails the
    row); returns the blocks to adopt and how many blocks failed. An older copy
    of a key stored again later is not adopted (its row is one the journal names:
    :mod:`~kvtierd.primary.warm.holds` decides whether it is held)."""
    scratch = bytearray(sum(end - start for start, end in spans))
    seed = replay.header.binding_seed()
    newest: dict[BlockKey, int] = {}  # key -> its last ready row
    for row, (key, _checksum) in replay.ready.items():
        newest[key] = row
    blocks: list[tuple[BlockKey, int, int]] = []
    dropped = 0
    for row, (key, checksum) in replay.ready.items():
        if newest[key] != row:
            continue  # an older copy of a key stored again later
        content = read_row_checksum(fd, row, block_bytes, spans, scratch)
        if content is None or bind_checksum(content, key, row, seed) != checksum:
            dropped += 1
            continue
        blocks.append((key, row, checksum))
    return blocks, dropped
