"""The warm-restart journal of one pool: an append-only file in ``memory.shm_dir``
that lets the next daemon adopt the ready blocks of the pool's region
(``memory.warm_restart``; docs/design/journal.md).

On-shm format, version :data:`FORMAT_VERSION` (all integers little-endian)::

    header:  b"KVTJRNL\\0" | u32 version | u32 n | n bytes of UTF-8 JSON | u32 crc32
             (crc32 of everything before it). The JSON holds the pool's fingerprint
             (name, block_bytes, num_blocks, layout) and the region file's identity
             (st_dev, st_ino) the records describe.
             It also names the checksum's coverage (checksum_bytes: 0 = whole
             rows, else evenly spaced 4 KiB pages: :func:`checksum_spans`) and
             fence_seconds, the writing daemon's lease + write_quarantine (absent
             in older files: 0), and access, who could map the region (absent in
             older files: "", which matches no daemon's: such a pool starts cold).
    records: u8 kind | u32 row | u16 key_len | u64 xxh3 | key | u32 crc32
             (crc32 of the record's bytes before it). kind 1 = ready(key, row,
             :func:`bind_checksum` of the row's covered bytes' xxh3_64, its key
             and row, and the pool's fingerprint), kind 2 = freed(row)
             (key_len 0, xxh3 0).

Version 2 binds each ready record's checksum to its key, its row and the pool
(version 1 hashed the row's bytes alone: two records whose keys were swapped,
with their CRCs recomputed, verified, and each key served the other's bytes).
A journal of another version starts its pool cold.

Replay rule: the last valid record of a row says what it holds. ``freed`` is
appended *before* the answer that hands a row to a writer (PrepareStore, a
promotion), so a row whose last record is ``ready`` was not given to any writer
since that record; ``ready`` is appended once the row's checksum is computed,
after CompleteStore, by :class:`JournalWriter`'s thread. A record that fails its
CRC ends the replay; nothing after it is trusted. A kill during an append leaves
at most the start of one record there (a torn last write, expected after a
crash); anything else (a complete record whose CRC fails, bytes that are no
record) is damage in the middle of the file, which the replay reports
(:attr:`Replay.damaged_at`).

Files: the journal's temporary files get unpredictable names and nothing at a
fixed name is ever unlinked or trusted unless it is this uid's
(:mod:`kvtierd.primary.warm.journalfiles`: ``memory.shm_dir`` may be shared with other users).

Threads: the event loop calls :meth:`JournalWriter.rows_reserved` /
:meth:`JournalWriter.rows_ready`; the journal's thread has each batch hashed
(:mod:`kvtierd.primary.warm.rowsums`: by a hash worker process,
:mod:`kvtierd.primary.warm.hashworker`) and writes the ``ready`` records. Every
write, the per-row generations and the hashing backlog are under
``JournalWriter._lock``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtierd.contract import BlockKey
from kvtierd.primary.warm.journalfiles import open_temporary, remove_journal, unlink_own
from kvtierd.primary.warm.rowsums import RowChecksums, checksum_spans

log = logging.getLogger("kvtierd.journal")

MAGIC = b"KVTJRNL\0"
FORMAT_VERSION = 2  # 2: ready checksums bound to key, row and pool (bind_checksum)
KIND_READY = 1
KIND_FREED = 2
_RECORD_HEAD = struct.Struct("<BIHQ")  # kind, row, key_len, xxh3
_CRC = struct.Struct("<I")
_HEADER_HEAD = struct.Struct("<8sII")  # magic, version, json length
_BOUND = struct.Struct("<QI")  # the row's content checksum, its row (bind_checksum)
MAX_HEADER_JSON = 64 * 1024
MAX_KEY_BYTES = 256
MAX_RECORD_BYTES = _RECORD_HEAD.size + MAX_KEY_BYTES + _CRC.size
# the journal's thread waits this long after the first completion of a batch: a
# crash loses about this much of the latest completions, plus their hashing
# (MISS, never wrong)
BATCH_DELAY_SECONDS = 0.005
# compaction: when the file grows past twice its live size plus this slack
COMPACT_SLACK_BYTES = 1 << 20
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
            },
            sort_keys=True,
        ).encode()
        head = _HEADER_HEAD.pack(MAGIC, FORMAT_VERSION, len(body)) + body
        return head + _CRC.pack(zlib.crc32(head))

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


def encode_ready(key: BlockKey, row: int, checksum: int) -> bytes:
    body = _RECORD_HEAD.pack(KIND_READY, row, len(key), checksum) + key
    return body + _CRC.pack(zlib.crc32(body))


def encode_freed(row: int) -> bytes:
    body = _RECORD_HEAD.pack(KIND_FREED, row, 0, 0)
    return body + _CRC.pack(zlib.crc32(body))


@dataclass(slots=True)
class Replay:
    """A journal read back: its header, the last state of each row it names, and
    whether it ended on an invalid (torn) record."""

    header: JournalHeader
    # row -> (key, checksum) for rows whose last record is ready, in record order
    ready: dict[int, tuple[BlockKey, int]]
    freed: set[int]  # rows whose last record is freed
    records: int
    torn_bytes: int  # bytes after the last valid record (0: clean end)
    # offset of the first invalid record when it is not the start of one record cut
    # short (a torn last write) but damage in the middle of the file; None otherwise
    damaged_at: int | None = None


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
    ready: dict[int, tuple[BlockKey, int]] = {}
    freed: set[int] = set()
    records = 0
    for kind, row, key, checksum, end in _records(data, offset):
        if row >= header.num_blocks:
            raise JournalError(f"journal {path}: record for row {row} outside the region")
        if kind == KIND_READY:
            ready.pop(row, None)  # re-inserted: dict order is record order
            ready[row] = (key, checksum)
            freed.discard(row)
        else:
            ready.pop(row, None)
            freed.add(row)
        records += 1
        offset = end
    damaged_at = None if _torn_last_write(data, offset) else offset
    return Replay(header, ready, freed, records, len(data) - offset, damaged_at)


def _decode_header(path: str, data: bytes) -> tuple[JournalHeader, int]:
    if len(data) < _HEADER_HEAD.size:
        raise JournalError(f"journal {path} is too short for a header ({len(data)} bytes)")
    magic, version, length = _HEADER_HEAD.unpack_from(data)
    if magic != MAGIC:
        raise JournalError(f"journal {path} does not start with the kvtierd journal magic")
    if version != FORMAT_VERSION:
        raise JournalError(
            f"journal {path} has format version {version}; this kvtierd reads version "
            f"{FORMAT_VERSION}"
        )
    end = _HEADER_HEAD.size + length
    if length > MAX_HEADER_JSON or len(data) < end + _CRC.size:
        raise JournalError(f"journal {path}: header torn or oversized")
    (crc,) = _CRC.unpack_from(data, end)
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
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise JournalError(f"journal {path}: unreadable header ({exc})") from None
    return header, end + _CRC.size


def _records(data: bytes, offset: int) -> Iterator[tuple[int, int, BlockKey, int, int]]:
    """(kind, row, key, checksum, end offset) of each valid record from ``offset``;
    stops at the first invalid one."""
    head = _RECORD_HEAD.size
    while offset + head + _CRC.size <= len(data):
        kind, row, key_len, checksum = _RECORD_HEAD.unpack_from(data, offset)
        if kind not in (KIND_READY, KIND_FREED) or key_len > MAX_KEY_BYTES:
            return
        if (kind == KIND_READY) != (key_len > 0):
            return
        end = offset + head + key_len
        if end + _CRC.size > len(data):
            return
        (crc,) = _CRC.unpack_from(data, end)
        if crc != zlib.crc32(data[offset:end]):
            return
        yield kind, row, bytes(data[offset + head : end]), checksum, end + _CRC.size
        offset = end + _CRC.size


def _torn_last_write(data: bytes, offset: int) -> bool:
    """Whether the bytes from ``offset`` (where the replay stopped) are at most the
    start of one record, as an append cut short by a kill leaves them: a record
    head that is itself cut, or a plausible head of a record longer than what
    follows. A complete record there (its CRC failed) or bytes that are no record
    head are damage."""
    rest = len(data) - offset
    if rest < _RECORD_HEAD.size:
        return rest == 0 or data[offset] in (KIND_READY, KIND_FREED)
    kind: int
    key_len: int
    kind, _row, key_len, _checksum = _RECORD_HEAD.unpack_from(data, offset)
    if kind not in (KIND_READY, KIND_FREED) or key_len > MAX_KEY_BYTES:
        return False
    if (kind == KIND_READY) != (key_len > 0):
        return False
    return rest < _RECORD_HEAD.size + key_len + _CRC.size


class JournalWriter:
    """Appends one pool's records; owns the journal file and its worker thread.

    Invariants (under ``_lock``): ``_generation[row]`` counts the times the row
    was handed to a writer; a hash job carries the generation it was queued at
    and its ``ready`` record is written only if the row was not handed out again
    meanwhile (a ``freed`` record would then already follow it), checked again
    after the hashing (the row may be handed out while it is hashed). The backlog
    ``_waiting`` holds at most one job per row. ``_live_key`` /
    ``_live_sum`` / ``_freed`` are the replay state of the file (what compaction
    writes). Once a write fails (or anything unforeseen happens on its thread)
    the journal is removed and stays off (``failed``, one ERROR line): the next
    start is cold for this pool, never wrong, and nothing waits for the thread
    any more (the backlog is dropped: close is prompt).

    ``_live_sum`` holds what the records hold: :func:`bind_checksum` values. The
    hash worker computes the rows' content checksums; the journal's thread binds
    them (:attr:`_seed`).

    The event loop only appends (one ``os.write`` per call) and queues; the
    journal's thread takes the backlog, has it hashed (without ``_lock``: in the
    hash worker process, or itself) and runs compactions, holding ``_lock`` only
    to take the backlog, to record, to snapshot the state and to swap the files.
    """

    def __init__(
        self,
        path: str,
        header: JournalHeader,
        region_buffer: memoryview,
        region_fd: int | None = None,
        *,
        hash_worker: bool = True,
    ) -> None:
        """``region_fd`` given (the daemon): a batch's rows are hashed by a hash worker
        process, in place from its own mapping, or by this journal's thread where
        none runs (:class:`kvtierd.primary.warm.rowsums.RowChecksums`: a client that truncates
        the region cannot kill the daemon with SIGBUS either way); without it,
        hashed in place from ``region_buffer`` on the journal thread (unit tests).
        ``hash_worker`` False: never start a worker (measurements, tests)."""
        self.path = path
        self.header = header
        self._seed = header.binding_seed()
        # the journal thread's only (it starts and stops the hash worker)
        self._checksums = RowChecksums(
            header.name,
            region_buffer,
            region_fd,  # not owned: the region's, open while the pool is
            header.block_bytes,
            checksum_spans(header.block_bytes, header.checksum_bytes),
            use_worker=hash_worker,
        )
        num_blocks = header.num_blocks
        self._lock = threading.Lock()
        self._generation = array("I", [0]) * num_blocks  # guarded by _lock
        self._live_key: list[BlockKey | None] = [None] * num_blocks  # guarded by _lock
        self._live_sum = array("Q", [0]) * num_blocks  # guarded by _lock
        self._freed = bytearray(num_blocks)  # 1: last record is freed; guarded by _lock
        self._live_bytes = 0  # bytes a compacted file would hold; guarded by _lock
        self._file_bytes = 0  # guarded by _lock
        self._fd = -1  # guarded by _lock; -1 before start, once closed or failed
        self._compaction_asked = False  # guarded by _lock
        self.failed = False
        self.records_written = 0
        self.compactions = 0
        # completed blocks by outcome (counts only grow; written under _lock):
        self.hash_jobs_stale = 0  # not journaled: the row was handed out again first
        self.hash_jobs_unreadable = 0  # not journaled: the region file was cut short
        self.rows_journaled = 0  # ready records written
        # The hashing backlog: row -> (generation, key) of its latest completion not
        # yet taken by the thread, in completion order. Bounded by construction: one
        # entry per row (a newer completion of a row replaces its entry, which was
        # stale anyway), so a lagging hasher delays the journal but never makes it
        # drop a completion, and holds at most num_blocks entries. Guarded by _lock.
        self._waiting: dict[int, tuple[int, BlockKey]] = {}
        self._hash_asked = False  # a _HASH token is queued; guarded by _lock
        # completions waiting or being hashed (close waits for 0); guarded by _lock
        self._pending_jobs = 0
        # the thread's work: _HASH (take the backlog), _COMPACT, or None (stop);
        # at most one _HASH and one _COMPACT are queued at a time
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._worker_spawned = threading.Event()  # the thread started its hash worker
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle

    def start(self, ready: Sequence[tuple[int, BlockKey, int]], freed: Sequence[int]) -> None:
        """Writes a fresh journal holding ``ready`` (row, key, bound checksum: as an
        adopted journal held it) and ``freed`` rows (atomically: a temporary file
        renamed over the path), then starts the worker. Blocking; raises OSError
        if the file cannot be written (nothing is left behind then)."""
        with self._lock:
            for row, key, checksum in ready:
                self._live_key[row] = key
                self._live_sum[row] = checksum
                self._live_bytes += _ready_bytes(key)
            for row in freed:
                self._freed[row] = 1
                self._live_bytes += _FREED_BYTES
            snapshot = self._snapshot_locked()
        fd, size = self._write_new_file(snapshot, b"")
        with self._lock:
            self._fd, self._file_bytes = fd, size
        self._thread = threading.Thread(
            target=self._work_forever, name=f"kvtierd-journal-{self.header.name}", daemon=True
        )
        self._thread.start()
        # the thread starts the hash worker first: here, before the pool serves its
        # first store (spawning takes dozens of interpreter-lock hand-offs, which
        # cost up to 5 ms each once the event loop is busy: a storm of stores had
        # the spawn, and so the journal, seconds behind)
        self._worker_spawned.wait(timeout=_SPAWN_WAIT_S)

    def close(self, drain_seconds: float) -> None:
        """Waits up to ``drain_seconds`` for the queued hash jobs (their ready records
        land), stops the thread (and its hash worker) and closes the file (which
        stays). Blocking."""
        thread = self._thread
        drained = True
        if thread is not None and thread.is_alive():
            with self._idle:
                drained = self._idle.wait_for(
                    lambda: self._pending_jobs <= 0, timeout=drain_seconds
                )
        if not drained:
            self._checksums.interrupt()  # a stalled worker must not hold the stop
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=drain_seconds + 1.0)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        log.info(
            "journal %s closed: %d completed blocks journaled, %d handed out again before "
            "they were hashed, %d unreadable (the region file cut short)",
            self.path, self.rows_journaled, self.hash_jobs_stale, self.hash_jobs_unreadable,
        )  # fmt: skip

    @property
    def hash_workers_started(self) -> int:
        """Hash worker processes started so far (more than one: one died)."""
        return self._checksums.workers_started

    @property
    def file_bytes(self) -> int:
        return self._file_bytes

    # -------------------------------------------------------------- event loop

    def rows_reserved(self, rows: Sequence[int]) -> None:
        """Rows about to be handed to a writer: ``freed`` records, written before the
        answer that hands them out. (Event loop; one short write.)"""
        records: list[bytes] = []
        with self._lock:
            generation = self._generation
            live_key = self._live_key
            for row in rows:
                generation[row] += 1
                key = live_key[row]
                if key is None and self._freed[row]:
                    continue  # the file already says freed
                if key is not None:
                    self._live_bytes -= _ready_bytes(key)
                    live_key[row] = None
                self._freed[row] = 1
                self._live_bytes += _FREED_BYTES
                records.append(encode_freed(row))
            if records:
                self._append_locked(b"".join(records), len(records))

    def rows_ready(self, keys: Sequence[BlockKey], rows: Sequence[int]) -> None:
        """Blocks just completed: queues their checksums; their ``ready`` records
        follow from the worker. (Event loop; does not block.)"""
        with self._lock:
            if self.failed:
                return
            waiting, generation = self._waiting, self._generation
            for key, row in zip(keys, rows, strict=True):
                if waiting.pop(row, None) is not None:
                    self.hash_jobs_stale += 1  # re-inserted below: completion order
                else:
                    self._pending_jobs += 1
                waiting[row] = (generation[row], key)
            wake = bool(waiting) and not self._hash_asked
            self._hash_asked = self._hash_asked or wake
        if wake:
            self._jobs.put(_HASH)  # the thread takes the whole backlog as one batch

    # -------------------------------------------------------------- worker thread

    def _work_forever(self) -> None:
        try:
            try:
                self._checksums.start()
            finally:
                self._worker_spawned.set()
            self._serve_jobs()
        finally:
            self._checksums.close()  # the hash worker ends with this thread

    def _serve_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job is _COMPACT:
                    self._compact()
                else:
                    self._hash_backlog()
            except Exception as exc:  # a bug or the unforeseen: stop vouching, never die
                with self._lock:
                    if self._fd < 0 and not self.failed:  # closed under a late batch
                        self._drop_backlog_locked()
                        continue
                    log.debug("journal %s: the thread's job failed", self.path, exc_info=True)
                    self._fail_locked(OSError(f"its thread failed: {exc!r}"))

    def _hash_backlog(self) -> None:
        # let the completions of the next few calls gather: one wake-up, one lock
        # and one write per batch instead of per call (the GIL and the cores are
        # shared with the event loop)
        time.sleep(BATCH_DELAY_SECONDS)
        with self._lock:
            waiting, self._waiting, self._hash_asked = self._waiting, {}, False
        batch = [(gen, row, key) for row, (gen, key) in waiting.items()]
        self._record_ready(batch, self._hash_newest_first(batch))

    def _hash_newest_first(self, batch: list[tuple[int, int, BlockKey]]) -> list[int | None]:
        """The checksums of a batch (completion order), hashed in chunks from the
        newest completion back, each chunk without the rows handed out again by
        the time it comes up (None for those: nothing to hash). Under a backlog the
        newest blocks, the ones eviction takes last, are vouched for first, and a
        row reused while its batch waits costs no hashing."""
        sums: list[int | None] = [None] * len(batch)
        chunk = self._checksums.rows_per_chunk
        generation = self._generation
        for end in range(len(batch), 0, -chunk):
            with self._lock:
                current = [i for i in range(max(0, end - chunk), end)
                           if generation[batch[i][1]] == batch[i][0]]  # fmt: skip
            if current:
                hashed = self._checksums.compute([batch[i][1] for i in current])
                for i, checksum in zip(current, hashed, strict=True):
                    sums[i] = checksum
        return sums

    def _record_ready(
        self, batch: list[tuple[int, int, BlockKey]], sums: Sequence[int | None]
    ) -> None:
        """Appends the ``ready`` records of a hashed batch (completion order) for the
        rows still the ones hashed. Records are encoded without ``_lock`` (the
        loop's calls wait on it); the generation check and the append happen
        together under it, :data:`_RECORD_SLICE` rows at a time, so a ``freed``
        record the loop writes can never be followed by a stale ``ready``."""
        generation, seed = self._generation, self._seed  # read unlocked: only to skip work
        bound = [
            bind_checksum(checksum, key, row, seed)
            if checksum is not None and generation[row] == gen
            else None
            for (gen, row, key), checksum in zip(batch, sums, strict=True)
        ]
        encoded = [
            encode_ready(key, row, checksum) if checksum is not None else None
            for (_, row, key), checksum in zip(batch, bound, strict=True)
        ]
        live_key, live_sum, freed = self._live_key, self._live_sum, self._freed
        for first in range(0, len(batch), _RECORD_SLICE):
            last = min(first + _RECORD_SLICE, len(batch))
            records: list[bytes] = []
            with self._idle:
                for i in range(first, last):
                    gen, row, key = batch[i]
                    if generation[row] != gen:
                        self.hash_jobs_stale += 1
                        continue  # handed out again since: its freed record already follows
                    record = encoded[i]
                    if record is None:
                        self.hash_jobs_unreadable += 1
                        continue  # the region file was cut short under it: not vouched for
                    old = live_key[row]
                    if old is not None:
                        self._live_bytes -= _ready_bytes(old)
                    elif freed[row]:
                        self._live_bytes -= _FREED_BYTES
                    live_key[row] = key
                    live_sum[row] = bound[i]  # type: ignore[assignment]  # not None: encoded
                    freed[row] = 0
                    self._live_bytes += len(record)
                    records.append(record)
                if records:
                    self._append_locked(b"".join(records), len(records))
                    self.rows_journaled += len(records)
                # 0 already if the journal failed meanwhile (its backlog was dropped)
                self._pending_jobs = max(0, self._pending_jobs - (last - first))
                self._idle.notify_all()

    def _compact(self) -> None:
        """Rewrites the journal as its live state: the state is copied under the
        lock (C-speed copies), encoded and written to a temporary file without it,
        then, under the lock again, the records appended meanwhile are copied after
        it and the temporary file is renamed over the journal."""
        with self._lock:
            if self._fd < 0:
                return
            keys, sums, freed = list(self._live_key), self._live_sum[:], bytes(self._freed)
            offset = self._file_bytes
        fd, temporary = -1, ""
        try:
            fd, temporary = open_temporary(self.path)
            _write_all(fd, b"".join(_encode_state(self.header, keys, sums, freed)))
            with self._lock:
                if self._fd < 0:
                    raise _Closed
                tail = os.pread(self._fd, self._file_bytes - offset, offset)
                _write_all(fd, tail)
                os.rename(temporary, self.path)
                os.close(self._fd)
                self._fd, fd = fd, -1
                self._file_bytes = os.fstat(self._fd).st_size
                self._compaction_asked = False
                self.compactions += 1
        except _Closed:
            pass
        except OSError as exc:
            with self._lock:
                self._fail_locked(exc)
        finally:
            if fd >= 0:
                os.close(fd)
                unlink_own(temporary)

    # -------------------------------------------------------------- file

    def _snapshot_locked(self) -> list[bytes]:
        return _encode_state(self.header, self._live_key, self._live_sum, self._freed)

    def _write_new_file(self, parts: Sequence[bytes], tail: bytes) -> tuple[int, int]:
        """Writes ``parts`` + ``tail`` to a temporary file renamed over the journal;
        returns its descriptor (appending) and size."""
        fd, temporary = open_temporary(self.path)
        try:
            data = b"".join(parts) + tail
            _write_all(fd, data)
            os.rename(temporary, self.path)
        except BaseException:
            os.close(fd)
            unlink_own(temporary)
            raise
        return fd, len(data)

    def _append_locked(self, data: bytes, count: int) -> None:
        if self._fd < 0:
            return
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            self._fail_locked(exc)
            return
        self._file_bytes += len(data)
        self.records_written += count
        if (
            not self._compaction_asked
            and self._file_bytes > 2 * self._live_bytes + COMPACT_SLACK_BYTES
        ):
            self._compaction_asked = True
            self._jobs.put(_COMPACT)

    def _fail_locked(self, exc: OSError) -> None:
        """A write failed: the journal can no longer vouch for the rows, so it is
        removed (the next start of this pool is cold), no more is written and the
        backlog is dropped (nothing waits for it: close is prompt). One ERROR line."""
        if self.failed:
            return
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.failed = True
        self._drop_backlog_locked()
        left = remove_journal(self.path, temporaries=False)  # a compaction removes its own
        log.error(
            "journal %s: %s; %s and warm restart is off for pool %s until the daemon "
            "restarts (that start is cold)",
            self.path, exc, f"it could not be removed ({left})" if left else "it was removed",
            self.header.name,
        )  # fmt: skip

    def _drop_backlog_locked(self) -> None:
        self._waiting.clear()
        self._pending_jobs = 0
        self._idle.notify_all()


_RECORD_SLICE = 64  # rows recorded per hold of the journal's lock (the loop waits on it)
_SPAWN_WAIT_S = 10.0  # start() waits this long at most for the hash worker's spawn
_COMPACT = object()  # a thread job: rewrite the journal as its live state
_HASH = object()  # a thread job: hash the backlog (JournalWriter._waiting)


class _Closed(Exception):
    """The journal was closed while a compaction ran: drop the compaction."""


def _encode_state(
    header: JournalHeader,
    keys: Sequence[BlockKey | None],
    sums: array[int],
    freed: bytes | bytearray,
) -> list[bytes]:
    """The header and one record per row the state names (ready, else freed)."""
    parts = [header.encode()]
    for row, key in enumerate(keys):
        if key is not None:
            parts.append(encode_ready(key, row, sums[row]))
        elif freed[row]:
            parts.append(encode_freed(row))
    return parts


_FREED_BYTES = _RECORD_HEAD.size + _CRC.size


def _ready_bytes(key: BlockKey) -> int:
    return _RECORD_HEAD.size + len(key) + _CRC.size


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
