"""The warm-restart journal's file format: its header, its records, and reading a
journal back (docs/design/journal.md, "Journal format").

On-shm format, version :data:`FORMAT_VERSION` (all integers little-endian)::

    header:  b"KVTJRNL\\0" | u32 version | u32 n | n bytes of UTF-8 JSON | u32 crc32
             (crc32 of everything before it). The JSON holds the pool's fingerprint
             (name, block_bytes, num_blocks, layout) and the region file's identity
             (st_dev, st_ino) the records describe.
             It also names the checksum's coverage (checksum_bytes: 0 = whole
             rows, else evenly spaced 4 KiB pages: ``rowsums.checksum_spans``),
             fence_seconds, the writing daemon's lease + write_quarantine (absent
             in older files: 0), access, who could map the region (absent in
             older files: "", which matches no daemon's: such a pool starts cold),
             and boot_id, the kernel boot the writer ran in (version 3).
    records: u8 kind | u32 row | u16 n | u64 xxh3 | n bytes | u32 crc32
             (crc32 of the record's bytes before it), by kind:
             1 ready(row, key: the n bytes, :func:`bind_checksum` of the row's
               covered bytes' xxh3_64, its key and row, and the pool's fingerprint);
             2 freed(row) (n 0, xxh3 0);
             3 horizon (row 0, n 16, xxh3 0, an :class:`~kvtierd.primary.warm.clock.Instant`):
               no client of the writer touches a row after it;
             4 held(row) (n 16, xxh3 0, an Instant): at a graceful stop, a client
               may still touch this row until then;
             5 stopped (row 0, n 16, xxh3 0, an Instant): the graceful stop ended
               here, nothing follows.

Version 2 bound each ready record's checksum to its key, its row and the pool
(version 1 hashed the row's bytes alone: two records whose keys were swapped, with
their CRCs recomputed, verified, and each key served the other's bytes). Version 3
adds kinds 3-5 and boot_id; a version-2 journal is still read (it has no
liveness records: its rows are held as version 2 held them). A journal of any
other version starts its pool cold.

Replay rule: the last valid record of a row says what it holds. ``freed`` is
appended *before* the answer that hands a row to a writer (PrepareStore, a
promotion), so a row whose last record is ``ready`` was not given to any writer
since that record. A record that fails its CRC ends the replay; nothing after it
is trusted. A kill during an append leaves at most the start of one record there
(a torn last write, expected after a crash); anything else (a complete record
whose CRC fails, bytes that are no record) is damage in the middle of the file,
which the replay reports (:attr:`Replay.damaged_at`). The journal ended with a
graceful stop only if its last valid record is ``stopped``; the ``held`` records
right before it are that stop's.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvtierd.contract import BlockKey
from kvtierd.primary.warm.clock import Instant

MAGIC = b"KVTJRNL\0"
FORMAT_VERSION = 3  # 3: liveness records (horizon, held, stopped) and the boot id
READABLE_VERSIONS = (2, 3)  # 2: ready checksums bound to key, row and pool (bind_checksum)
KIND_READY = 1
KIND_FREED = 2
KIND_HORIZON = 3
KIND_HELD = 4
KIND_STOPPED = 5
_INSTANT_KINDS = (KIND_HORIZON, KIND_HELD, KIND_STOPPED)
RECORD_HEAD = struct.Struct("<BIHQ")  # kind, row, n, xxh3
CRC = struct.Struct("<I")
_HEADER_HEAD = struct.Struct("<8sII")  # magic, version, json length
_BOUND = struct.Struct("<QI")  # the row's content checksum, its row (bind_checksum)
MAX_HEADER_JSON = 64 * 1024
MAX_KEY_BYTES = 256
MAX_RECORD_BYTES = RECORD_HEAD.size + MAX_KEY_BYTES + CRC.size
FREED_BYTES = RECORD_HEAD.size + CRC.size
INSTANT_RECORD_BYTES = RECORD_HEAD.size + Instant.SIZE + CRC.size
_OPEN_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY


def journal_path(region_path: str) -> str:
    """The journal of a region file: the same name with ``.journal`` for ``.region``."""
    base = region_path[: -len(".region")] if region_path.endswith(".region") else region_path
    return base + ".journal"


class JournalError(Exception):
    """The journal cannot be used; the message says why (one log line)."""


@dataclass(frozen=True, slots=True)
class JournalHeader:
    """What the records describe: a pool's fingerprint and its region file."""

    name: str
    block_bytes: int
    num_blocks: int
    layout: str
    st_dev: int
    st_ino: int
    checksum_bytes: int = 0  # memory.warm_restart_checksum_bytes (0: whole rows)
    # lease + write_quarantine of the daemon that wrote it: how long its sessions'
    # writers may go on copying after it died (not part of the fingerprint)
    fence_seconds: float = 0.0
    # who could map the region (its mode, group and the principals): part of the
    # fingerprint, as a process that mapped it keeps it across an adoption
    access: str = ""
    boot_id: str = ""  # the writer's boot (clock.current_boot_id); "" in version 2
    version: int = FORMAT_VERSION  # as read; a writer always writes FORMAT_VERSION

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "name": self.name,
                "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks,
                "layout": self.layout,
                "st_dev": self.st_dev,
                "st_ino": self.st_ino,
                "checksum_bytes": self.checksum_bytes,
                "fence_seconds": self.fence_seconds,
                "access": self.access,
                "boot_id": self.boot_id,
            },
            sort_keys=True,
        ).encode()
        head = _HEADER_HEAD.pack(MAGIC, FORMAT_VERSION, len(body)) + body
        return head + CRC.pack(zlib.crc32(head))

    def binding_seed(self) -> int:
        """The seed of :func:`bind_checksum` for this pool: a digest of its fingerprint
        (name, geometry, layout, checksum coverage) and of its region file's
        identity, so a record is valid only in the journal of this pool's file."""
        fingerprint = repr(
            (self.name, self.block_bytes, self.num_blocks, self.layout, self.checksum_bytes,
             self.st_dev, self.st_ino)
        ).encode()  # fmt: skip
        return int.from_bytes(hashlib.sha256(fingerprint).digest()[:8], "little")


def bind_checksum(content: int, key: BlockKey, row: int, seed: int) -> int:
    """The checksum a ready record holds: xxh3_64 (seeded with the pool's
    :meth:`JournalHeader.binding_seed`) of the row's content checksum, the row and
    the key. A record moved to another row, given another key or read in another
    pool's journal does not verify. A checksum, not a signature: whoever can
    write the journal (the daemon's uid) can compute it."""
    return xxhash.xxh3_64_intdigest(_BOUND.pack(content, row) + key, seed=seed)


def ready_bytes(key: BlockKey) -> int:
    """The size of a ready record of ``key``."""
    return RECORD_HEAD.size + len(key) + CRC.size


def encode_ready(key: BlockKey, row: int, checksum: int) -> bytes:
    body = RECORD_HEAD.pack(KIND_READY, row, len(key), checksum) + key
    return body + CRC.pack(zlib.crc32(body))


def encode_freed(row: int) -> bytes:
    body = RECORD_HEAD.pack(KIND_FREED, row, 0, 0)
    return body + CRC.pack(zlib.crc32(body))


def encode_instant(kind: int, instant: Instant, row: int = 0) -> bytes:
    """A horizon, held(row) or stopped record."""
    assert kind in _INSTANT_KINDS
    body = RECORD_HEAD.pack(kind, row, Instant.SIZE, 0) + instant.encode()
    return body + CRC.pack(zlib.crc32(body))


@dataclass(slots=True)
class Replay:
    """A journal read back: its header, the last state of each row it names, what it
    says about the old daemon's clients, and whether it ended on an invalid (torn)
    record."""

    header: JournalHeader
    # row -> (key, checksum) for rows whose last record is ready, in record order
    ready: dict[int, tuple[BlockKey, int]]
    freed: set[int]  # rows whose last record is freed
    records: int
    torn_bytes: int  # bytes after the last valid record (0: clean end)
    # offset of the first invalid record when it is not the start of one record cut
    # short (a torn last write) but damage in the middle of the file; None otherwise
    damaged_at: int | None = None
    horizon: Instant | None = None  # the last horizon record's
    stopped: Instant | None = None  # the stop, when the last valid record is stopped
    held: dict[int, Instant] = field(default_factory=dict)  # that stop's held rows


def read_journal(path: str, max_bytes: int) -> Replay:
    """Reads and replays the journal at ``path`` (opened without following links;
    it must be a regular file of this uid). Raises FileNotFoundError, or
    JournalError with the reason it cannot be used."""
    fd = os.open(path, _OPEN_READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise JournalError(f"journal {path} is not a regular file of uid {os.geteuid()}")
        if st.st_size > max_bytes:
            raise JournalError(f"journal {path} is {st.st_size} bytes, over its bound {max_bytes}")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(max_bytes + 1)
    finally:
        os.close(fd)
    header, offset = _decode_header(path, data)
    replay = Replay(header, {}, set(), 0, 0)
    pending: dict[int, Instant] = {}  # held records since the last record of another kind
    for kind, row, payload, checksum, end in _records(data, offset):
        if row >= header.num_blocks:
            raise JournalError(f"journal {path}: record for row {row} outside the region")
        replay.stopped, replay.held = None, {}  # a stop is the journal's last record
        if kind == KIND_READY:
            replay.ready.pop(row, None)  # re-inserted: dict order is record order
            replay.ready[row] = (payload, checksum)
            replay.freed.discard(row)
        elif kind == KIND_FREED:
            replay.ready.pop(row, None)
            replay.freed.add(row)
        elif kind == KIND_HELD:
            pending[row] = Instant.decode(payload)
        elif kind == KIND_HORIZON:
            replay.horizon = Instant.decode(payload)
        else:
            replay.stopped, replay.held = Instant.decode(payload), pending
        if kind != KIND_HELD:
            pending = {}
        replay.records += 1
        offset = end
    replay.torn_bytes = len(data) - offset
    replay.damaged_at = None if _torn_last_write(data, offset) else offset
    return replay


def _decode_header(path: str, data: bytes) -> tuple[JournalHeader, int]:
    if len(data) < _HEADER_HEAD.size:
        raise JournalError(f"journal {path} is too short for a header ({len(data)} bytes)")
    magic, version, length = _HEADER_HEAD.unpack_from(data)
    if magic != MAGIC:
        raise JournalError(f"journal {path} does not start with the kvtierd journal magic")
    if version not in READABLE_VERSIONS:
        raise JournalError(
            f"journal {path} has format version {version}; this kvtierd reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    end = _HEADER_HEAD.size + length
    if length > MAX_HEADER_JSON or len(data) < end + CRC.size:
        raise JournalError(f"journal {path}: header torn or oversized")
    (crc,) = CRC.unpack_from(data, end)
    if crc != zlib.crc32(data[:end]):
        raise JournalError(f"journal {path}: header checksum mismatch")
    try:
        fields: Any = json.loads(data[_HEADER_HEAD.size : end])
        header = JournalHeader(
            name=str(fields["name"]),
            block_bytes=int(fields["block_bytes"]),
            num_blocks=int(fields["num_blocks"]),
            layout=str(fields["layout"]),
            st_dev=int(fields["st_dev"]),
            st_ino=int(fields["st_ino"]),
            checksum_bytes=int(fields["checksum_bytes"]),
            fence_seconds=float(fields.get("fence_seconds", 0.0)),
            access=str(fields.get("access", "")),
            boot_id=str(fields.get("boot_id", "")),
            version=version,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise JournalError(f"journal {path}: unreadable header ({exc})") from None
    return header, end + CRC.size


def _payload_fits(kind: int, length: int) -> bool:
    """Whether a record of ``kind`` may carry ``length`` bytes (and the kind exists)."""
    if kind == KIND_READY:
        return 0 < length <= MAX_KEY_BYTES
    if kind == KIND_FREED:
        return length == 0
    return kind in _INSTANT_KINDS and length == Instant.SIZE


def _records(data: bytes, offset: int) -> Iterator[tuple[int, int, bytes, int, int]]:
    """(kind, row, payload, checksum, end offset) of each valid record from
    ``offset``; stops at the first invalid one."""
    head = RECORD_HEAD.size
    while offset + head + CRC.size <= len(data):
        kind, row, length, checksum = RECORD_HEAD.unpack_from(data, offset)
        if not _payload_fits(kind, length):
            return
        end = offset + head + length
        if end + CRC.size > len(data):
            return
        (crc,) = CRC.unpack_from(data, end)
        if crc != zlib.crc32(data[offset:end]):
            return
        yield kind, row, bytes(data[offset + head : end]), checksum, end + CRC.size
        offset = end + CRC.size


def _torn_last_write(data: bytes, offset: int) -> bool:
    """Whether the bytes from ``offset`` (where the replay stopped) are at most the
    start of one record, as an append cut short by a kill leaves them: a record
    head that is itself cut, or a plausible head of a record longer than what
    follows. A complete record there (its CRC failed) or bytes that are no record
    head are damage."""
    rest = len(data) - offset
    if rest < RECORD_HEAD.size:
        return rest == 0 or KIND_READY <= data[offset] <= KIND_STOPPED
    kind: int
    length: int
    kind, _row, length, _checksum = RECORD_HEAD.unpack_from(data, offset)
    if not _payload_fits(kind, length):
        return False
    return rest < RECORD_HEAD.size + length + CRC.size
