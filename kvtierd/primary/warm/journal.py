"""The warm-restart journal of one pool: an append-only file in ``memory.shm_dir``
that lets the next daemon adopt the ready blocks of the pool's region
(``memory.warm_restart``; docs/design/journal.md). Its format, and reading it back:
:mod:`kvtierd.primary.warm.journalformat`.

Order: ``freed`` is appended *before* the answer that hands a row to a writer
(PrepareStore, a promotion), so a row whose last record is ``ready`` was not given
to any writer since that record; ``ready`` is appended once the row's checksum is
computed, after CompleteStore, by :class:`JournalWriter`'s thread. A ``horizon``
is appended before a lease is granted that could end after the last one's
(:meth:`JournalWriter.cover_leases`); at a graceful stop, after the last ``ready``
record, the ``held`` rows and ``stopped`` (:meth:`JournalWriter.close`).

Lag: a completion is crash-proof once its ``ready`` record is written; until then
it is *behind*. :meth:`JournalWriter.lag_seconds` is the age of the oldest
completion behind (the metric ``kvtierd_journal_lag_seconds``); a batch recorded
later than ``memory.warm_restart_max_lag`` after its oldest completion is logged
(WARNING, rate-limited).

Files: the journal's temporary files get unpredictable names and nothing at a
fixed name is ever unlinked or trusted unless it is this uid's
(:mod:`kvtierd.primary.warm.journalfiles`: ``memory.shm_dir`` may be shared with other users).

Threads: the event loop calls :meth:`JournalWriter.rows_reserved` /
:meth:`JournalWriter.rows_ready` / :meth:`JournalWriter.cover_leases`; the journal's
thread has each batch hashed (:mod:`kvtierd.primary.warm.rowsums`: by a hash worker
process, :mod:`kvtierd.primary.warm.hashworker`) and writes the ``ready`` records.
Every write, the per-row generations and the hashing backlog are under
``JournalWriter._lock``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtierd.contract import BlockKey
from kvtierd.primary.warm.clock import Instant
from kvtierd.primary.warm.holds import HORIZON_SLACK_SECONDS
from kvtierd.primary.warm.journalfiles import open_temporary, remove_journal, unlink_own
from kvtierd.primary.warm.journalformat import (
    FREED_BYTES,
    INSTANT_RECORD_BYTES,
    KIND_HELD,
    KIND_HORIZON,
    KIND_STOPPED,
    JournalHeader,
    bind_checksum,
    encode_freed,
    encode_instant,
    encode_ready,
    ready_bytes,
)
from kvtierd.primary.warm.rowsums import RowChecksums, checksum_spans
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
_rate_limited = RateLimitedLog(log)

# the journal's thread waits this long after the first completion of a batch: a
# crash loses about this much of the latest completions, plus their hashing
# (MISS, never wrong)
BATCH_DELAY_SECONDS = 0.005
# compaction: when the file grows past twice its live size plus this slack
COMPACT_SLACK_BYTES = 1 << 20
DEFAULT_LAG_BOUND_SECONDS = 1.0  # memory.warm_restart_max_lag


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
        lag_bound: float = DEFAULT_LAG_BOUND_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``region_fd`` given (the daemon): a batch's rows are hashed by a hash worker
        process, in place from its own mapping, or by this journal's thread where
        none runs (:class:`kvtierd.primary.warm.rowsums.RowChecksums`: a client that truncates
        the region cannot kill the daemon with SIGBUS either way); without it,
        hashed in place from ``region_buffer`` on the journal thread (unit tests).
        ``hash_worker`` False: never start a worker (measurements, tests).
        ``lag_bound``: a batch recorded later than this after its oldest
        completion is logged (``memory.warm_restart_max_lag``). ``clock``: monotonic
        seconds, for the lag and for when the written horizon must be renewed
        (:meth:`cover_leases`; the horizon itself is an :class:`Instant`)."""
        self._clock = clock
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
        # bytes a compacted file would hold (its horizon record included); guarded by _lock
        self._live_bytes = INSTANT_RECORD_BYTES
        self._file_bytes = 0  # guarded by _lock
        self._fd = -1  # guarded by _lock; -1 before start, once closed or failed
        self._compaction_asked = False  # guarded by _lock
        # the last horizon record (its bytes: compaction keeps it) and its monotonic
        # time; the loop's (cover_leases), written under _lock
        self._horizon_record = b""
        self._horizon_until = 0.0
        # lag: monotonic times of the oldest completion waiting, and of the oldest in
        # the batch being hashed (0.0: none); written under _lock, read anywhere
        self._waiting_since = 0.0
        self._batch_since = 0.0
        self._lag_bound = lag_bound
        self.max_lag_seconds = 0.0  # the longest a batch waited for its records
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

    def start(
        self,
        ready: Sequence[tuple[int, BlockKey, int]],
        freed: Sequence[int],
        horizon: Instant | None = None,
    ) -> None:
        """Writes a fresh journal holding ``ready`` (row, key, bound checksum: as an
        adopted journal held it), ``freed`` rows and ``horizon`` (the adopted rows'
        last hold, should this daemon crash before they are free) atomically (a
        temporary file renamed over the path), then starts the worker. Blocking;
        raises OSError if the file cannot be written (nothing is left behind then)."""
        with self._lock:
            if horizon is not None:
                self._horizon_record = encode_instant(KIND_HORIZON, horizon)
            for row, key, checksum in ready:
                self._live_key[row] = key
                self._live_sum[row] = checksum
                self._live_bytes += ready_bytes(key)
            for row in freed:
                self._freed[row] = 1
                self._live_bytes += FREED_BYTES
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

    def close(self, drain_seconds: float, held: Mapping[int, float] | None = None) -> None:
        """Waits up to ``drain_seconds`` for the queued hash jobs (their ready records
        land), stops the thread (and its hash worker) and closes the file (which
        stays). Blocking.

        ``held`` (a graceful stop: row -> seconds from now an old client may still
        touch it): once the thread has ended and nothing else can be appended,
        writes a ``held`` record per row and then ``stopped``, the last record. A
        thread that does not end (or ``held`` None) leaves no stop record: the next
        daemon reads the journal as a crash's (every row it names held)."""
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
            ended = self._thread is None or not self._thread.is_alive()
            if held is not None and ended and self._fd >= 0:
                self._append_locked(_stop_records(held), len(held) + 1)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        log.info(
            "journal %s closed%s: %d completed blocks journaled, %d handed out again before "
            "they were hashed, %d unreadable (the region file cut short); the longest a "
            "batch waited for its records: %.3fs",
            self.path, " with its stop record" if held is not None and ended else "",
            self.rows_journaled, self.hash_jobs_stale, self.hash_jobs_unreadable,
            self.max_lag_seconds,
        )  # fmt: skip

    @property
    def hash_workers_started(self) -> int:
        """Hash worker processes started so far (more than one: one died)."""
        return self._checksums.workers_started

    @property
    def file_bytes(self) -> int:
        return self._file_bytes

    def lag_seconds(self) -> float:
        """The age of the oldest completion not yet journaled (0: none). Any thread."""
        oldest = min((t for t in (self._batch_since, self._waiting_since) if t), default=0.0)
        return max(0.0, self._clock() - oldest) if oldest else 0.0

    # -------------------------------------------------------------- event loop

    def cover_leases(self, seconds: float) -> None:
        """Before a lease is granted that a client may use up to ``seconds`` from now
        (lease + write_quarantine): appends a ``horizon`` record unless the last one
        already reaches that far (:mod:`kvtierd.primary.warm.holds`). Usually one
        clock read and a comparison; a record at most once per
        :data:`HORIZON_SLACK_SECONDS` under steady renewals. (Event loop.)"""
        now = self._clock()
        if now + seconds <= self._horizon_until:
            return
        ahead = seconds + HORIZON_SLACK_SECONDS
        record = encode_instant(KIND_HORIZON, Instant.in_seconds(ahead))
        with self._lock:
            self._horizon_record = record
            self._horizon_until = now + ahead
            self._append_locked(record, 1)

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
                    self._live_bytes -= ready_bytes(key)
                    live_key[row] = None
                self._freed[row] = 1
                self._live_bytes += FREED_BYTES
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
            if not waiting:
                self._waiting_since = self._clock()
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
            self._batch_since, self._waiting_since = self._waiting_since, 0.0
        batch = [(gen, row, key) for row, (gen, key) in waiting.items()]
        self._record_ready(batch, self._hash_newest_first(batch))
        self._batch_recorded()

    def _batch_recorded(self) -> None:
        """The batch's records are written: its wait ends (the lag's other half)."""
        with self._lock:
            since, self._batch_since = self._batch_since, 0.0
        if not since:
            return
        waited = self._clock() - since
        self.max_lag_seconds = max(self.max_lag_seconds, waited)
        if waited > self._lag_bound:
            _rate_limited.warning(
                ("lag", self.path),
                "journal %s: completions were journaled %.2fs after they completed, over "
                "memory.warm_restart_max_lag (%gs): a crash meanwhile loses them (MISS after "
                "the restart); the node's CPUs are saturated or the hash worker is starved",
                self.path, waited, self._lag_bound,
            )  # fmt: skip

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
                        self._live_bytes -= ready_bytes(old)
                    elif freed[row]:
                        self._live_bytes -= FREED_BYTES
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
            horizon, offset = self._horizon_record, self._file_bytes
        fd, temporary = -1, ""
        try:
            fd, temporary = open_temporary(self.path)
            _write_all(fd, b"".join(_encode_state(self.header, horizon, keys, sums, freed)))
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
        return _encode_state(
            self.header, self._horizon_record, self._live_key, self._live_sum, self._freed
        )

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


# rows recorded per hold of the journal's lock (the loop waits on it: ~0.3 ms) and
# per write: each write hands the interpreter lock back to a busy loop, whose
# return costs up to its switch interval (5 ms; more when the cores are all busy)
_RECORD_SLICE = 1024
_SPAWN_WAIT_S = 10.0  # start() waits this long at most for the hash worker's spawn
_COMPACT = object()  # a thread job: rewrite the journal as its live state
_HASH = object()  # a thread job: hash the backlog (JournalWriter._waiting)


class _Closed(Exception):
    """The journal was closed while a compaction ran: drop the compaction."""


def _encode_state(
    header: JournalHeader,
    horizon: bytes,
    keys: Sequence[BlockKey | None],
    sums: array[int],
    freed: bytes | bytearray,
) -> list[bytes]:
    """The header, the last horizon record and one record per row the state names
    (ready, else freed)."""
    parts = [header.encode(), horizon]
    for row, key in enumerate(keys):
        if key is not None:
            parts.append(encode_ready(key, row, sums[row]))
        elif freed[row]:
            parts.append(encode_freed(row))
    return parts


def _stop_records(held: Mapping[int, float]) -> bytes:
    """A graceful stop's last records: ``held(row, until)`` per row, then ``stopped``."""
    records = [
        encode_instant(KIND_HELD, Instant.in_seconds(seconds), row)
        for row, seconds in sorted(held.items())
    ]
    records.append(encode_instant(KIND_STOPPED, Instant.in_seconds(0.0)))
    return b"".join(records)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
