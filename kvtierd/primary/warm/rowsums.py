"""Row checksums of the warm-restart journal: what a checksum covers, and where
the journal computes it (docs/design/journal.md).

A row's checksum is ``xxh3_64`` of the bytes of its covered spans
(:func:`checksum_spans`), concatenated. Three ways compute that same value, in
order of preference (:class:`RowChecksums`):

1. a hash worker process (:mod:`kvtierd.primary.warm.hashworker`) that hashes in place from
   its own read-only mapping: no copy, off the daemon's interpreter lock, and a
   SIGBUS from a truncated region file kills the worker, not the daemon;
2. while no worker runs (it could not start, or died: restarted at most once per
   :data:`WORKER_RESPAWN_S`), in the journal thread: the covered bytes copied out
   of the daemon's mapping with one ``process_vm_readv`` per
   :data:`GATHER_BYTES` (:mod:`kvtierd.primary.safecopy`: EFAULT, never SIGBUS);
3. where ``process_vm_readv`` is refused (Docker's default seccomp profile
   without CAP_SYS_PTRACE), one ``preadv`` per span from the region file.

Any of them gives None for a row it could not read whole (the file was cut short
under it): such a row is not vouched for, so it starts cold after a restart.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import xxhash

from kvtierd.primary import safecopy
from kvtierd.primary.safecopy import address_of
from kvtierd.primary.warm.hashworker import HashWorker, WorkerDied
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
_rate_limited = RateLimitedLog(log)

PAGE = 4096
GATHER_BYTES = 1 << 20  # covered bytes copied out of the region per system call, at most
WORKER_RESPAWN_S = 1.0  # a hash worker that died is replaced at most this often
# covered bytes per request the journal sends at a time (it re-checks which rows
# are still worth hashing between two): a few ms of hashing at most, and few
# requests per batch (each costs the journal's thread two waits for the
# interpreter lock behind a busy event loop)
CHUNK_COVERED_BYTES = 8 << 20


def checksum_spans(block_bytes: int, checksum_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a row that its checksum covers: the whole row when
    ``checksum_bytes`` is 0 or at least ``block_bytes``; else ``checksum_bytes //
    4096`` pages (at least 2), evenly spaced, the first and the last included."""
    if checksum_bytes <= 0 or checksum_bytes >= block_bytes:
        return [(0, block_bytes)]
    pages = block_bytes // PAGE
    wanted = max(2, checksum_bytes // PAGE)
    chosen = sorted({i * (pages - 1) // (wanted - 1) for i in range(wanted)})
    return [(page * PAGE, (page + 1) * PAGE) for page in chosen]


def row_checksum(row: memoryview | bytes, spans: Sequence[tuple[int, int]] | None = None) -> int:
    """xxh3_64 of the row's bytes in ``spans`` (None: all of them), concatenated.
    Releases the GIL for inputs over 64 KiB: ~19 GB/s on one core here."""
    if spans is None or len(spans) == 1:
        start, end = spans[0] if spans else (0, len(row))
        return xxhash.xxh3_64_intdigest(row[start:end])
    # one call over the pages gathered (a 64 KiB copy) instead of one per page
    return xxhash.xxh3_64_intdigest(b"".join(row[start:end] for start, end in spans))


def read_row_checksum(
    fd: int, row: int, block_bytes: int, spans: Sequence[tuple[int, int]], scratch: bytearray
) -> int | None:
    """:func:`row_checksum` of row ``row`` of the region file ``fd``, its covered
    bytes read with ``preadv`` into ``scratch`` (at least the covered bytes long),
    never through the mapping: a client holding the region's descriptor can
    truncate the file, and touching a mapped page past its end kills the daemon
    with SIGBUS, where a read just comes back short. None when a read is short
    (the row is then not vouched for: the next start drops it)."""
    base = row * block_bytes
    view = memoryview(scratch)
    filled = 0
    for start, end in spans:
        length = end - start
        if os.preadv(fd, [view[filled : filled + length]], base + start) != length:
            return None
        filled += length
    return xxhash.xxh3_64_intdigest(view[:filled])


class RowChecksums:
    """Computes the checksums of one pool's rows for its journal thread.

    Owned by that thread: :meth:`compute` and :meth:`close` run on it (the hash
    worker is started by it, so the kernel kills the worker when the thread
    ends); :meth:`interrupt` may be called from any thread.
    """

    def __init__(
        self,
        name: str,
        region_buffer: memoryview,
        region_fd: int | None,
        block_bytes: int,
        spans: Sequence[tuple[int, int]],
        *,
        use_worker: bool = True,
    ) -> None:
        """``region_fd`` None (unit tests): rows are hashed in place from
        ``region_buffer``, in the calling thread. Else the region file's
        descriptor, open while the pool is (not owned)."""
        self._name = name
        self._rows = region_buffer  # the whole region; rows sliced per job
        self._region_fd = region_fd
        self._base = address_of(region_buffer) if region_fd is not None else 0
        self._block_bytes = block_bytes
        self._num_blocks = len(region_buffer) // block_bytes
        self._spans = list(spans)
        self._per_row = sum(end - start for start, end in spans)
        # rows per compute() call the journal makes: CHUNK_COVERED_BYTES, at least 4
        self.rows_per_chunk = max(4, CHUNK_COVERED_BYTES // self._per_row)
        self._gather_buffer = bytearray(0)
        self._use_worker = use_worker and region_fd is not None
        self._worker: HashWorker | None = None
        self._worker_started_at = -WORKER_RESPAWN_S  # monotonic; of the last start tried
        self.workers_started = 0

    @property
    def worker_pid(self) -> int | None:
        """The running hash worker's process id (None: none runs)."""
        worker = self._worker
        return None if worker is None or worker.broken else worker.pid

    def compute(self, rows: list[int]) -> list[int | None]:
        """The checksum of each row (None: not read whole, not vouched for)."""
        if self._region_fd is None:
            block, spans, region = self._block_bytes, self._spans, self._rows
            return [row_checksum(region[r * block : (r + 1) * block], spans) for r in rows]
        worker = self._running_worker()
        if worker is not None:
            try:
                if worker.ready():  # else hashed here while it starts
                    return worker.checksums(rows)
            except WorkerDied as exc:  # a truncation's SIGBUS, a kill: this batch here
                _rate_limited.warning(
                    ("worker died", self._name),
                    "journal %s: %s; hashing in the daemon until a new worker starts "
                    "(at most one start per %gs)", self._name, exc, WORKER_RESPAWN_S,
                )  # fmt: skip
                self._stop_worker()
        if self._base:
            return self._gathered_checksums(rows)
        return self._read_checksums(rows)

    def start(self) -> None:
        """Starts the hash worker ahead of the first batch (its start-up runs while
        the pool gets its first stores). Journal thread."""
        self._running_worker()

    def interrupt(self) -> None:
        """Wakes a :meth:`compute` waiting on the worker (the batch falls back to
        the journal thread). Any thread."""
        worker = self._worker
        if worker is not None:
            worker.interrupt()

    def close(self) -> None:
        """Stops the worker. Journal thread (or once it ended)."""
        self._use_worker = False
        self._stop_worker()

    def _running_worker(self) -> HashWorker | None:
        if self._worker is not None or not self._use_worker or self._region_fd is None:
            return self._worker
        now = time.monotonic()
        if now - self._worker_started_at < WORKER_RESPAWN_S:
            return None
        self._worker_started_at = now
        try:
            self._worker = HashWorker(
                self._name, self._region_fd, self._block_bytes, self._num_blocks, self._spans
            )
            self.workers_started += 1
        except OSError as exc:
            _rate_limited.warning(
                ("worker start", self._name),
                "journal %s: cannot start a hash worker (%s); hashing in the daemon",
                self._name, exc,
            )  # fmt: skip
        return self._worker

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    def _gathered_checksums(self, rows: list[int]) -> list[int | None]:
        """The checksum of each row's covered bytes, copied out of the region by
        :func:`safecopy.gather` at most :data:`GATHER_BYTES` at a time (the buffer is
        bounded: one row's coverage or that, whichever is larger); None for a row
        that could not be read whole (the file was cut short under it: not vouched
        for)."""
        block, spans, per_row = self._block_bytes, self._spans, self._per_row
        rows_per_gather = max(1, GATHER_BYTES // per_row)
        if not self._gather_buffer:
            self._gather_buffer = bytearray(per_row * min(rows_per_gather, len(rows)))
        buffer = self._gather_buffer
        view = memoryview(buffer)
        sums: list[int | None] = []
        for first in range(0, len(rows), rows_per_gather):
            chunk = rows[first : first + rows_per_gather]
            if len(buffer) < per_row * len(chunk):
                view.release()
                buffer = self._gather_buffer = bytearray(per_row * len(chunk))
                view = memoryview(buffer)
            ranges = [(r * block + start, r * block + end) for r in chunk for start, end in spans]
            try:
                copied = safecopy.gather(self._base, ranges, buffer)
            except OSError as exc:  # refused here (seccomp): one pread per row from now on
                log.warning(
                    "journal %s: process_vm_readv refused (%s); hashing rows with one "
                    "pread each", self._name, exc,
                )  # fmt: skip
                self._base = 0
                view.release()
                return sums + self._read_checksums(rows[first:])
            sums.extend(
                xxhash.xxh3_64_intdigest(view[i * per_row : (i + 1) * per_row])
                if (i + 1) * per_row <= copied
                else None
                for i in range(len(chunk))
            )
        view.release()
        return sums

    def _read_checksums(self, rows: list[int]) -> list[int | None]:
        """As :meth:`_gathered_checksums`, one ``preadv`` per covered span (where
        ``process_vm_readv`` is refused); the same values."""
        fd = self._region_fd
        if fd is None:
            return [None] * len(rows)
        scratch = bytearray(self._per_row)
        return [read_row_checksum(fd, r, self._block_bytes, self._spans, scratch) for r in rows]
