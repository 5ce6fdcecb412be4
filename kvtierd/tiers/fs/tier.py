"""The FS tier (DESIGN.md §6): one file per block under a root directory.

Differences from vLLM's FS tier (reference §6): a byte capacity with LRU
eviction, a verified header (key, pool fingerprint, length, xxh3-64 of the
payload) on every file, an in-memory index rebuilt at start, and partial
success of loads reported per key.

Ownership and invariants:

* Rows: during a store job the pool keeps the rows pinned and this tier only
  reads them (checksum + write straight from the row); during a load job the
  rows are reserved and only this tier writes them (``preadv`` straight into
  the row). A row is never touched after its job's ``on_done`` ran. A row whose
  block failed verification may hold garbage; it is never reported as loaded.
* Block I/O: the file work of a group of blocks (:mod:`~kvtierd.tiers.fs.blockfile`)
  is one request to ``_block_io``, run inline on the I/O thread or in an I/O
  worker process (:mod:`~kvtierd.tiers.fs.ioworker`) that maps the region itself.
  The index, the budget and the locks stay here: a group's keys are reserved
  (writes) or marked being read before the request and settled after its
  replies, and the request returns before the group's outcomes are recorded.
* Files are immutable once renamed into place (temp file + full write +
  optional fdatasync + rename). A file is removed only (a) by eviction, never
  while a read of it is in flight, (b) when it fails verification (load, scan
  or fsck), and only if the path still names the inode that failed, or (c) as a
  leftover ``*.tmp`` at start. A directory is never removed.
* Paths: everything below the pool directory is opened through
  :class:`~kvtierd.tiers.fs.safefs.PoolDir` (no symlink followed, no open that can
  block). Anything but a regular file where a block file belongs (a FIFO,
  socket, device, directory, symlink) fails verification like a corrupt file:
  the key answers MISS, is counted in ``checksum_failures`` and logged with the
  path and type; a symlinked ``<hh>`` directory is never entered.
* Shutdown is bounded: a scan or I/O thread stuck in the file system is left
  behind after :data:`SCAN_JOIN_S` / :data:`~kvtierd.tiers.fs.iopool.JOIN_S`.
* Index: ``{key: (file bytes, last use)}`` in LRU order, plus ``_used`` (sum of
  indexed file sizes) and ``_reserved`` (writes in flight); all guarded by
  ``_lock``, which I/O threads and the loop share and hold only briefly: no
  file system call happens under it (a hung mount must not stall Lookups). An
  eviction takes its victim out of the index and marks it in ``_evicting``
  under the lock, then renames the file aside and unlinks it outside; a writer
  of that key waits until the mark is gone, so a concurrent rewrite of the key
  is never the file removed.
* Capacity: every byte in ``_used + _reserved``, plus evicted files renamed
  aside and not yet unlinked, is charged to a :class:`DiskBudget`, which the
  pools of one configured tier share; a write is admitted only once its bytes
  fit (evicting this pool's least recently used files first), so the bytes on
  disk never exceed the capacity through a write. Lock order:
  ``FsTier._lock`` then ``DiskBudget._lock``.
* Threads: a tier either owns its :class:`IoPool` or uses one shared by the
  pools of one configured tier (then it never shuts it down).
* Every submitted job reports exactly once through ``on_done`` on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import json
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.tiers.base import JobCallback, JobResult, SecondaryTier, TierJob, TierStats
from kvtierd.tiers.fs import blockfile, fsformat, ioworker, safefs
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.fsformat import (
    BLOCK_SUFFIX,
    HEADER_SIZE,
    POOL_FILE,
    TEMP_SUFFIX,
    CorruptBlock,
    PoolIdentity,
)
from kvtierd.tiers.fs.iopool import IoPool, Outcome
from kvtierd.tiers.fs.ioworker import BlockIo, InlineIo, IoWorkers, RegionRef
from kvtierd.tiers.fs.safefs import DIRECTORY, REGULAR, Entry, PoolDir, UnexpectedEntry
from kvtierd.tiers.fs.writelog import WriteFailureLog

log = logging.getLogger("kvtierd.tiers.fs")

O_DIRECT_MODES = ("auto", "on", "off")
_SCAN_LOG_EVERY = 10_000
# Recent removals remembered for Explain, per pool: an entry takes at most ~450
# bytes (a 256-byte key, its (time, why) tuple, the OrderedDict node): ~7 MiB.
_REMOVALS_KEPT = 16384
_GROUP_BYTES = 16 << 20  # blocks per I/O task: this many bytes (at least one block)
_SPEED_PROBE_BYTES = 16 << 20  # at most this much written twice by the o_direct=auto probe
_POOL_FILE_MAX_BYTES = 64 << 10  # a pool.json larger than this is not ours
SCAN_JOIN_S = 2.0  # shutdown waits this long for a scan stuck in the file system
EVICTING_WAIT_S = 0.001  # a writer of a key whose old file is being evicted polls this often
_COUNTERS = (
    "hits",
    "misses",
    "bytes_written",
    "bytes_read",
    "evictions",
    "store_failures",
    "load_failures",
    "checksum_failures",
    "dropped_writes",
)


class FsTierError(Exception):
    """The FS tier cannot start (root missing, not writable, pool mismatch...)."""


class PoolMismatchError(FsTierError):
    """The pool directory's ``pool.json`` describes another pool."""


class TierFull(Exception):
    """No file could be evicted to make room for a write."""


class DiskBudget:
    """The byte capacity of one configured FS tier, shared by its pools.

    ``charged`` is the sum of every indexed file and every write in flight of
    every pool attached to it. Thread-safe; held only for arithmetic.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._charged = 0  # _lock

    @property
    def charged(self) -> int:
        with self._lock:
            return self._charged

    def try_charge(self, nbytes: int) -> bool:
        """Charges ``nbytes`` if they fit under the capacity; False (nothing charged) if not."""
        with self._lock:
            if self._charged + nbytes > self.capacity_bytes:
                return False
            self._charged += nbytes
            return True

    def charge(self, nbytes: int) -> None:
        """Charges bytes that exist already (files found by a scan); may overshoot."""
        with self._lock:
            self._charged += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._charged -= nbytes
            if self._charged < 0:
                raise AssertionError("disk budget released more than it charged")

    @property
    def over(self) -> bool:
        with self._lock:
            return self._charged > self.capacity_bytes


@dataclass(slots=True)
class ScanReport:
    """What the start-up scan of the pool directory found."""

    files: int = 0
    indexed: int = 0
    removed_corrupt: int = 0
    removed_temp: int = 0
    bad_entries: int = 0  # not regular files where block files belong (kept if directories)
    seconds: float = 0.0


class FsTier(SecondaryTier):
    """A secondary tier of block files under ``root`` for one pool.

    Lifecycle: construct -> :meth:`start` (checks the root, writes ``pool.json``,
    probes O_DIRECT, starts the index scan) -> jobs -> :meth:`shutdown`.
    """

    medium = Medium.STORAGE

    def __init__(
        self,
        name: str,
        root: str | os.PathLike[str],
        pool_name: str,
        block_bytes: int,
        layout: Any,
        region_buffer: memoryview,
        capacity_bytes: int,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        read_threads: int = 8,
        write_threads: int = 8,
        fsync: bool = False,
        o_direct: str = "auto",
        max_queue_bytes: int = 1 << 30,
        max_queue_jobs: int = 1024,
        io_pool: IoPool | None = None,
        budget: DiskBudget | None = None,
        workers: IoWorkers | None = None,
        region_file: tuple[str, int, int] | None = None,
        write_log: WriteFailureLog | None = None,
    ) -> None:
        if o_direct not in O_DIRECT_MODES:
            raise ValueError(f"o_direct must be one of {O_DIRECT_MODES}, got {o_direct!r}")
        if block_bytes < 1 or block_bytes % mmap.PAGESIZE:
            raise ValueError(f"block_bytes must be a positive multiple of {mmap.PAGESIZE}")
        if len(region_buffer) % block_bytes:
            raise ValueError("region_buffer length is not a multiple of block_bytes")
        if workers is not None and region_file is None:
            raise ValueError("I/O workers need region_file: (path, st_dev, st_ino)")
        self.name = name
        self.root = os.fspath(root)
        self.identity = PoolIdentity(pool_name, block_bytes, layout)
        self.pool_dir = os.path.join(self.root, self.identity.dir_name)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_SIZE + block_bytes
        self.budget = budget if budget is not None else DiskBudget(capacity_bytes)
        self.capacity_bytes = self.budget.capacity_bytes
        self.fsync = fsync
        self.o_direct = o_direct
        self.use_o_direct = False  # decided by start()'s probe
        self.scan_report = ScanReport()
        self._fingerprint = self.identity.fingerprint
        self._region = region_buffer.cast("B") if region_buffer.format != "B" else region_buffer
        self._num_rows = len(region_buffer) // block_bytes
        self._on_done = on_done
        self._loop = loop
        self._pool_args = dict(
            read_threads=read_threads,
            write_threads=write_threads,
            max_queue_bytes=max_queue_bytes,
            max_queue_jobs=max_queue_jobs,
        )
        self._io: IoPool | None = io_pool
        self._owns_io = io_pool is None
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockKey, tuple[int, float]] = OrderedDict()  # _lock
        self._used = 0  # _lock: sum of indexed file sizes
        self._reserved = 0  # _lock: file sizes of writes in flight
        self._writing: set[BlockKey] = set()  # _lock
        self._evicting: set[BlockKey] = set()  # _lock: out of the index, file being removed
        self._reading: dict[BlockKey, int] = {}  # _lock: reads in flight per key
        self._counters = dict.fromkeys(_COUNTERS, 0)  # _lock
        self._removed: OrderedDict[BlockKey, tuple[float, str]] = OrderedDict()  # _lock
        self._dropped: list[BlockKey] = []  # _lock: removed since take_removed()
        self._scanned = False  # _lock
        self._stop = threading.Event()
        self._scan_thread: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
        self._write_log = write_log if write_log is not None else WriteFailureLog(name, log)
        # Block file I/O: in worker processes, or inline on the calling I/O thread.
        self._block_io: BlockIo = workers if workers is not None else InlineIo(self._region)
        self._region_ref: RegionRef = (*(region_file or ("", 0, 0)), block_bytes)
        self._temp_tag = secrets.token_hex(6)  # temp names: tag + counter, no syscall each
        self._temp_counter = itertools.count()

    # -- lifecycle (loop thread) ---------------------------------------------------

    def start(self) -> None:
        """:meth:`prepare`, then :meth:`launch` (both on the calling thread)."""
        self.prepare()
        self.launch()

    def prepare(self) -> None:
        """Checks the root, writes/verifies ``pool.json``, probes O_DIRECT.

        File I/O (up to two 16 MiB probe files): the daemon runs it off the event
        loop, on any thread, before :meth:`launch`. Raises FsTierError (naming the
        path) when the root is unusable and PoolMismatchError when ``pool.json``
        describes another pool.
        """
        self._prepare_root()
        self._write_pool_file()
        self.use_o_direct = self._probe_o_direct()

    def launch(self) -> None:
        """Starts the I/O pool (if the tier owns one) and the index scan. On the loop."""
        if self._io is None:
            self._io = IoPool(self._loop, **self._pool_args)
        self._ready = self._loop.create_future()
        self._scan_thread = threading.Thread(target=self._scan, name="kvtierd-fs-scan", daemon=True)
        self._scan_thread.start()

    @property
    def ready(self) -> bool:
        """True once the index scan ended (lookups answer HIT/MISS, not RETRY)."""
        with self._lock:
            return self._scanned

    async def wait_ready(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"FS tier {self.name} was not started")
        await asyncio.shield(self._ready)

    async def drain(self) -> None:
        if self._io is not None:
            await self._io.drain()

    def shutdown(self) -> None:
        """Stops the scan and the I/O threads; queued jobs are reported failed.

        Bounded: a scan thread stuck in the file system (a hung mount) is waited
        for at most :data:`SCAN_JOIN_S` seconds, then left behind (a daemon
        thread; it touches no region).
        """
        self._stop.set()
        if self._io is not None and self._owns_io:
            self._io.shutdown()
        if self._scan_thread is not None:
            self._scan_thread.join(SCAN_JOIN_S)
            if self._scan_thread.is_alive():
                log.warning(
                    "FS tier %s: the index scan of %s did not stop within %gs (file system "
                    "not answering?); leaving it behind",
                    self.name, self.pool_dir, SCAN_JOIN_S,
                )  # fmt: skip

    # -- SecondaryTier (loop thread) -----------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        with self._lock:
            if not self._scanned:
                return [LookupResult.RETRY] * len(keys)
            now = time.time()
            results = []
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    results.append(LookupResult.MISS)
                    continue
                self._index[key] = (entry[0], now)
                self._index.move_to_end(key)
                results.append(LookupResult.HIT)
            hits = results.count(LookupResult.HIT)
            self._counters["hits"] += hits
            self._counters["misses"] += len(keys) - hits
            return results

    def touch(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._touch_locked(keys)

    def contains(self, key: BlockKey) -> bool | None:
        with self._lock:
            return key in self._index if self._scanned else None

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        with self._lock:
            entry = self._removed.get(key)
        return [entry] if entry is not None else []

    def take_removed(self) -> list[BlockKey]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _note_removed_locked(self, key: BlockKey, why: str) -> None:
        """Records why ``key`` left the index (for Explain)."""
        self._removed[key] = (time.time(), why)
        self._removed.move_to_end(key)
        if len(self._removed) > _REMOVALS_KEPT:
            self._removed.popitem(last=False)

    def _tasks(
        self, job: TierJob, per_group: Callable[[list[tuple[BlockKey, int]]], list[Outcome]]
    ) -> tuple[list[Callable[[], list[Outcome]]], list[int]]:
        """The job's (key, row) pairs in groups of up to ``_GROUP_BYTES``, and the
        group sizes. A task runs its group in order and returns one
        :class:`Outcome` per block: fewer, longer tasks than one per block mean
        less queue and lock traffic and fewer threads contending for the CPU and
        the GIL, while a large job still spreads over several threads."""
        pairs = list(zip(job.keys, job.block_ids, strict=True))
        size = max(1, _GROUP_BYTES // self.block_bytes)
        groups = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        return [functools.partial(per_group, group) for group in groups], [len(g) for g in groups]

    def submit_store(self, job: TierJob) -> bool:
        io = self._require_io()
        tasks, sizes = self._tasks(job, self._store_group)
        start = time.perf_counter()
        accepted = io.submit_write(
            tasks, lambda outcomes: self._store_done(job, _flatten(outcomes, sizes), start),
            nbytes=len(job.keys) * self.block_bytes,
        )  # fmt: skip
        if not accepted:
            with self._lock:
                self._counters["dropped_writes"] += 1
        return accepted

    def submit_load(self, job: TierJob) -> None:
        io = self._require_io()
        tasks, sizes = self._tasks(job, self._load_group)
        start = time.perf_counter()
        io.submit_read(
            tasks, lambda outcomes: self._load_done(job, _flatten(outcomes, sizes), start)
        )

    def statistics(self) -> TierStats:
        io = self._io
        with self._lock:
            c = dict(self._counters)
            used, blocks = self._used, len(self._index)
        return TierStats(
            name=self.name,
            medium=self.medium,
            capacity_bytes=self.capacity_bytes,
            used_bytes=used,
            bytes_per_block=self.file_bytes,
            blocks=blocks,
            queued_jobs=io.queued_jobs if io else 0,
            queued_bytes=io.queued_bytes if io else 0,
            **c,
        )

    # -- job completion (loop thread) ----------------------------------------------

    def _store_done(self, job: TierJob, outcomes: list[Outcome], start: float) -> None:
        stored = tuple(key for key, o in zip(job.keys, outcomes, strict=True) if o.ok)
        for key, outcome in zip(job.keys, outcomes, strict=True):
            if isinstance(outcome.error, OSError):  # the disk refused: the operator hears
                self._write_log.failed(outcome.error, self._path(key))
            elif not outcome.ok:  # capacity, shutdown: counted only
                log.debug("FS tier %s: store of %s failed: %s", self.name, key.hex(), outcome.error)
        written = sum(1 for o in outcomes if o.ok and o.value)
        if written:
            self._write_log.succeeded()
        failures = len(job.keys) - len(stored)
        if failures:
            with self._lock:
                self._counters["store_failures"] += failures
        self._on_done(
            JobResult(
                job_id=job.job_id,
                success=failures == 0,
                successful_keys=stored or None,
                seconds=time.perf_counter() - start,
                bytes_moved=written * self.file_bytes,
            )
        )

    def _load_done(self, job: TierJob, outcomes: list[Outcome], start: float) -> None:
        loaded = tuple(key for key, o in zip(job.keys, outcomes, strict=True) if o.ok)
        failures = len(job.keys) - len(loaded)
        if failures:
            with self._lock:
                self._counters["load_failures"] += failures
        self._on_done(
            JobResult(
                job_id=job.job_id,
                success=failures == 0,
                successful_keys=loaded or None,
                seconds=time.perf_counter() - start,
                bytes_moved=len(loaded) * self.file_bytes,
            )
        )

    # -- block I/O (I/O threads) -----------------------------------------------------

    def _store_group(self, pairs: list[tuple[BlockKey, int]]) -> list[Outcome]:
        """Writes a group's block files; one Outcome per block, in order: True
        (written), False (present already, not rewritten) or the error (TierFull
        when no room can be made, OSError/ValueError otherwise).

        Blocks are reserved one by one and written together (one request to the
        block I/O per group). A block that does not fit while earlier blocks of
        the group wait to be written is tried again once they are written, so
        they can be evicted for it, as if the group were written block by block.
        """
        outcomes: list[Outcome | None] = [None] * len(pairs)
        reserved: list[tuple[int, BlockKey, int]] = []
        try:
            for i, (key, block_id) in enumerate(pairs):
                try:
                    fsformat.check_key(key)
                    self._check_block_id(block_id)
                    try:
                        fresh = self._reserve_write(key)
                    except TierFull:
                        if not reserved:
                            raise
                        batch, reserved = reserved, []
                        self._write_reserved(batch, outcomes)
                        fresh = self._reserve_write(key)
                except Exception as exc:  # one block's failure is that block's outcome
                    outcomes[i] = Outcome(error=exc)
                    continue
                if fresh:
                    reserved.append((i, key, block_id))
                else:
                    outcomes[i] = Outcome(value=False)
            batch, reserved = reserved, []
            self._write_reserved(batch, outcomes)
        except BaseException:
            with self._lock:
                for _, key, _ in reserved:
                    self._end_write_locked(key)
            raise
        return [o if o is not None else Outcome(error=RuntimeError("not run")) for o in outcomes]

    def _write_reserved(
        self, reserved: list[tuple[int, BlockKey, int]], outcomes: list[Outcome | None]
    ) -> None:
        """Writes blocks whose keys this thread reserved; ends every reservation."""
        if not reserved:
            return
        try:
            errors = self._write_files([(key, block_id) for _, key, block_id in reserved])
        except BaseException:
            with self._lock:
                for _, key, _ in reserved:
                    self._end_write_locked(key)
            raise
        now = time.time()
        with self._lock:
            for (i, key, _), error in zip(reserved, errors, strict=True):
                self._end_write_locked(key)
                if error is None:
                    self._index_add_locked(key, self.file_bytes, now)
                    self._counters["bytes_written"] += self.file_bytes
                    outcomes[i] = Outcome(value=True)
                else:
                    outcomes[i] = Outcome(error=error)

    def _reserve_write(self, key: BlockKey) -> bool:
        """Charges one file's bytes for writing ``key`` (evicting LRU files until they
        fit) and marks the key as being written; False if the key is present or being
        written already (then it is touched instead).

        Victims are renamed aside under ``_lock`` and unlinked after it is released:
        unlinking a large file can take milliseconds (page cache, writeback), and
        ``_lock`` is shared with every other I/O thread and with the event loop.
        """
        while True:
            with self._lock:
                evicting = key in self._evicting
                if not evicting:
                    if key in self._index or key in self._writing:
                        self._touch_locked((key,))
                        return False
                    if self.budget.try_charge(self.file_bytes):
                        self._writing.add(key)
                        self._reserved += self.file_bytes
                        return True
                    doomed = self._doom_lru_locked(self.file_bytes)
            if evicting:  # its old file is being moved aside: a few ms, I/O thread only
                time.sleep(EVICTING_WAIT_S)
                continue
            self._remove_doomed(doomed)

    def _write_files(self, items: list[tuple[BlockKey, int]]) -> list[BaseException | None]:
        """Writes row ``block_id`` as ``key``'s file for each ``(key, block_id)``, in one
        block I/O request; per item None (written) or the error. The caller holds
        the keys' write reservations, so no one else reads or writes these paths."""
        todo = []
        for key, block_id in items:
            rel = fsformat.block_rel_path(key)
            todo.append((block_id, rel, f"{_name(rel)}.{self._temp_name()}{TEMP_SUFFIX}", key))
        params = (self._fingerprint, self.use_o_direct, self.fsync, self.pool_dir)
        try:
            replies = self._block_io.call((ioworker.WRITE, self._region_ref, params, todo))
        except OSError as exc:  # the worker died: whether it renamed a file is unknown
            for _, rel, temp_name, _ in todo:
                self._unlink_quietly(rel)
                self._unlink_quietly(_beside(rel, temp_name))
            return [exc] * len(items)
        return [ioworker.error_of(reply) for reply in replies]

    def _load_group(self, pairs: list[tuple[BlockKey, int]]) -> list[Outcome]:
        """Reads and verifies a group's blocks into their rows (one block I/O
        request); one Outcome per block, None or the error.

        The keys count as being read (so eviction spares their files) until
        every block of the group is done. Corrupt files are removed (and
        counted); transient errors keep the file; a vanished file (ENOENT) is
        dropped from the index.
        """
        outcomes: list[Outcome] = [Outcome()] * len(pairs)
        todo: list[tuple[int, BlockKey, int]] = []
        for i, (key, block_id) in enumerate(pairs):
            try:
                self._check_block_id(block_id)
            except ValueError as exc:
                outcomes[i] = Outcome(error=exc)
                continue
            todo.append((i, key, block_id))
        with self._lock:
            for _, key, _ in todo:
                self._reading[key] = self._reading.get(key, 0) + 1
        try:
            errors = self._read_files([(key, block_id) for _, key, block_id in todo])
            for (i, key, _), error in zip(todo, errors, strict=True):
                if error is not None:
                    self._read_failed(key, error)
                    outcomes[i] = Outcome(error=error)
        finally:
            with self._lock:
                for _, key, _ in todo:
                    left = self._reading[key] - 1
                    if left:
                        self._reading[key] = left
                    else:
                        del self._reading[key]
        loaded = [key for (i, key, _) in todo if outcomes[i].ok]
        with self._lock:
            self._counters["bytes_read"] += len(loaded) * self.file_bytes
            self._touch_locked(loaded)
        return outcomes

    def _read_files(self, items: list[tuple[BlockKey, int]]) -> list[BaseException | None]:
        """Reads ``key``'s file into row ``block_id`` for each ``(key, block_id)``, in one
        block I/O request; per item None (read and verified) or the error."""
        params = (self._fingerprint, self.use_o_direct, self.pool_dir)
        request = [(block_id, fsformat.block_rel_path(key), key) for key, block_id in items]
        try:
            replies = self._block_io.call((ioworker.READ, self._region_ref, params, request))
        except OSError as exc:  # the worker died
            return [exc] * len(items)
        return [ioworker.error_of(reply) for reply in replies]

    def _read_failed(self, key: BlockKey, error: BaseException) -> None:
        if isinstance(error, FileNotFoundError):
            with self._lock:
                self._index_remove_locked(key)
                self._note_removed_locked(key, "file vanished (removed outside the daemon)")
        elif isinstance(error, CorruptFile):
            self._discard_corrupt(key, error)

    def _discard_corrupt(self, key: BlockKey, error: CorruptFile) -> None:
        """Drops a key whose file failed verification from the index and removes the
        file if the path still names the inode that failed (never a directory, never
        through a symlink; something else at the path is left there)."""
        path, rel = self._path(key), fsformat.block_rel_path(key)
        if error.kind == REGULAR:
            log.warning("FS tier %s: removing corrupt block file %s: %s", self.name, path,
                        error.reason)  # fmt: skip
        else:
            action = "removing it" if error.identity is not None else "leaving it there"
            log.warning("FS tier %s: bad block file %s: %s; %s", self.name, path, error.reason,
                        action)  # fmt: skip
        with self._lock:
            self._counters["checksum_failures"] += 1
            if error.identity is not None and self._remove_bad(rel, error.identity):
                return  # a fresh file of the key replaced the bad one meanwhile: keep it
            self._index_remove_locked(key)
            self._note_removed_locked(key, f"file failed verification ({error.reason}); dropped")

    def _remove_bad(self, rel: str, identity: tuple[int, int]) -> bool:
        """Unlinks the bad file at ``rel`` if the path still names it; True when the
        path names another file now (rewritten since it was judged)."""
        try:
            with PoolDir(self.pool_dir) as pool:
                current = pool.lstat(rel)
                if current is not None and safefs.identity_of(current) != identity:
                    return True
                pool.unlink_if_same(rel, identity)
        except (OSError, UnexpectedEntry) as exc:
            log.warning("FS tier %s: cannot remove %s: %s", self.name, self._full(rel), exc)
        return False

    # -- index helpers (caller holds _lock) ----------------------------------------

    def _touch_locked(self, keys: Sequence[BlockKey]) -> None:
        now = time.time()
        for key in keys:
            entry = self._index.get(key)
            if entry is not None:
                self._index[key] = (entry[0], now)
                self._index.move_to_end(key)

    def _end_write_locked(self, key: BlockKey) -> None:
        self._writing.discard(key)
        self._reserved -= self.file_bytes
        self.budget.release(self.file_bytes)

    def _index_add_locked(self, key: BlockKey, size: int, last_use: float) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old[0]
            self.budget.release(old[0])
        self._index[key] = (size, last_use)
        self._used += size
        self.budget.charge(size)

    def _index_remove_locked(self, key: BlockKey) -> None:
        """Drops ``key`` from the index and uncharges its file (which is gone)."""
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old[0]
            self.budget.release(old[0])
            self._dropped.append(key)

    def _doom_lru_locked(self, size: int) -> _Doomed:
        """Takes this pool's least recently used file that is not being read out of
        the index and marks it as being evicted; :meth:`_remove_doomed` (outside
        the lock) moves the file aside and unlinks it. Its bytes stay charged to
        the budget until then, so the bytes on disk never exceed the capacity.
        Raises TierFull when nothing of this pool can be evicted (``size``: what
        the caller wanted room for)."""
        victim = next((k for k in self._index if k not in self._reading), None)
        if victim is None:
            raise TierFull(
                f"FS tier {self.name}: {size} bytes do not fit in {self.budget.capacity_bytes} "
                f"({self.budget.charged} used or being written by the pools of this tier) and "
                "nothing of this pool is evictable"
            )
        nbytes, _ = self._index.pop(victim)
        self._used -= nbytes
        self._dropped.append(victim)
        self._note_removed_locked(victim, "evicted: least recently used at capacity")
        self._counters["evictions"] += 1
        self._evicting.add(victim)
        return _Doomed(victim, nbytes)

    def _remove_doomed(self, doomed: _Doomed) -> None:
        """Renames the victim's file aside and unlinks it (outside the lock), then
        ends its eviction and uncharges it. A crash in between leaves a ``*.tmp``
        file, removed by the next start's scan."""
        rel = fsformat.block_rel_path(doomed.key)
        aside = f"{_name(rel)}.{self._temp_name()}.evicted{TEMP_SUFFIX}"
        try:
            with PoolDir(self.pool_dir) as pool:
                try:
                    pool.rename(rel, aside)
                except FileNotFoundError:
                    return
                except OSError:
                    pool.unlink(rel)  # cannot rename: unlink it where it is
                    return
            self._unlink_quietly(_beside(rel, aside))
        except (OSError, UnexpectedEntry) as exc:  # a directory on the way is gone or bad
            log.warning("FS tier %s: cannot evict %s: %s", self.name, self._path(doomed.key), exc)
        finally:
            with self._lock:
                self._evicting.discard(doomed.key)
            self.budget.release(doomed.nbytes)

    def _evict_to_capacity(self) -> None:
        """Evicts this pool's LRU files until the shared budget is within capacity
        (after the start-up scan charged the files it found)."""
        while True:
            with self._lock:
                if not self.budget.over:
                    return
                doomed = self._doom_lru_locked(0)
            self._remove_doomed(doomed)

    # -- start-up --------------------------------------------------------------------

    def _prepare_root(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise FsTierError(
                f"FS tier {self.name}: root directory {self.root} does not exist and cannot be "
                f"created: {exc.strerror or exc}"
            ) from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise FsTierError(f"FS tier {self.name}: root directory {self.root} is not writable")
        try:
            PoolDir(self.pool_dir, create=True).close()
        except UnexpectedEntry as exc:  # planted: a symlink would lead out of the root
            log.warning("FS tier %s: %s: not followed; refusing the pool", self.name, exc)
            raise FsTierError(
                f"FS tier {self.name}: {exc}: not followed; remove it (the daemon creates "
                "the pool directory)"
            ) from None
        except OSError as exc:
            raise FsTierError(
                f"FS tier {self.name}: cannot create pool directory {self.pool_dir} under root "
                f"{self.root}: {exc.strerror or exc}"
            ) from exc

    def _write_pool_file(self) -> None:
        """Checks ``pool.json`` against this pool, or writes it when missing. The file
        is opened without blocking or following a symlink and read only if small."""
        path = os.path.join(self.pool_dir, POOL_FILE)
        ours = self.identity.describe()
        try:
            with PoolDir(self.pool_dir) as pool:
                raw = pool.read_small(POOL_FILE, _POOL_FILE_MAX_BYTES)
                if raw is None:
                    text = json.dumps(ours, indent=2, sort_keys=True) + "\n"
                    pool.write_new(POOL_FILE, text.encode(), f"{POOL_FILE}.{secrets.token_hex(8)}"
                                   f"{TEMP_SUFFIX}")  # fmt: skip
                    return
        except UnexpectedEntry as exc:
            log.warning("FS tier %s: %s; refusing the pool", self.name, exc)
            raise FsTierError(f"FS tier {self.name}: {exc}; remove it") from None
        except ValueError as exc:
            raise PoolMismatchError(
                f"FS tier {self.name}: {exc}; remove the directory {self.pool_dir} or use "
                "another root"
            ) from None
        except OSError as exc:
            raise FsTierError(
                f"FS tier {self.name}: cannot read or write {path}: {exc.strerror or exc}"
            ) from exc
        try:
            theirs = json.loads(raw)
        except ValueError:
            theirs = raw.decode(errors="replace")
        if theirs != ours:
            raise PoolMismatchError(
                f"FS tier {self.name}: {path} describes {theirs!r}, but this pool is "
                f"{ours!r}; remove the directory {self.pool_dir} or use another root"
            )

    def _probe_o_direct(self) -> bool:
        """Whether block files are written and read with O_DIRECT.

        "on": if the filesystem supports it (FsTierError otherwise); "auto": if
        it supports it *and* a timed write + read-back of a few blocks is at least
        20 % faster with it than through the page cache; "off": never. Also proves
        the directory writable (FsTierError naming it otherwise).
        """
        wanted = self.o_direct != "off" and blockfile.O_DIRECT != 0
        if wanted:
            try:
                _probe_file(self.pool_dir, blockfile.O_DIRECT)
                return self.o_direct == "on" or self._direct_is_faster()
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise FsTierError(
                        f"FS tier {self.name}: cannot write in {self.pool_dir}: {exc}"
                    ) from exc
                if self.o_direct == "on":
                    raise FsTierError(
                        f"FS tier {self.name}: o_direct=on but {self.pool_dir} does not support "
                        "O_DIRECT (EINVAL); use o_direct=auto or off"
                    ) from exc
        try:
            _probe_file(self.pool_dir, 0)
        except OSError as exc:
            raise FsTierError(
                f"FS tier {self.name}: cannot write in {self.pool_dir}: {exc}"
            ) from exc
        return False

    def _direct_is_faster(self) -> bool:
        """Times writing then reading back the same bytes buffered and with O_DIRECT.

        The buffered read-back usually comes from the page cache, as buffered
        promotions of recently cascaded blocks do; O_DIRECT has to beat that.
        """
        nbytes = min(_SPEED_PROBE_BYTES, 4 * self.block_bytes)
        buffer = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
        try:
            buffer.write(os.urandom(4096) * (nbytes // 4096))
            buffered = _time_write_read(self.pool_dir, buffer, 0)
            direct = _time_write_read(self.pool_dir, buffer, blockfile.O_DIRECT)
        except OSError as exc:
            log.info("FS tier %s: O_DIRECT speed probe failed (%s); using the page cache",
                     self.name, exc)  # fmt: skip
            return False
        finally:
            buffer.close()
        faster = direct < 0.8 * buffered
        log.info(
            "FS tier %s: write+read of %d bytes: %.1f ms buffered, %.1f ms O_DIRECT -> %s",
            self.name, nbytes, buffered * 1e3, direct * 1e3,
            "O_DIRECT" if faster else "page cache",
        )  # fmt: skip
        return faster

    def _scan_hook(self) -> None:
        """Called on the scan thread before scanning (tests hold the scan here)."""

    def _scan(self) -> None:
        """Rebuilds the index from file headers (scan thread); lookups RETRY until done.

        Always ends (then lookups answer HIT/MISS): nothing below the pool
        directory is followed through a symlink or opened in a way that can
        block, and an error ends the scan with a partial index.
        """
        start = time.perf_counter()
        entries: list[tuple[float, BlockKey, int]] = []
        try:
            self._scan_hook()
            with PoolDir(self.pool_dir) as pool:
                for entry in pool.walk(self._scan_error):
                    if self._stop.is_set():
                        return
                    found = self._scan_entry(pool, entry)
                    if found is not None:
                        entries.append(found)
        except Exception:
            log.exception(
                "FS tier %s: scan of %s failed; index is partial", self.name, self.pool_dir
            )
        finally:
            self._finish_scan(entries, time.perf_counter() - start)

    def _scan_error(self, path: str, exc: BaseException) -> None:
        log.warning("FS tier %s: not scanning %s: %s", self.name, path, exc)

    def _scan_entry(self, pool: PoolDir, entry: Entry) -> tuple[float, BlockKey, int] | None:
        """What the scan does with one entry below the pool directory."""
        report = self.scan_report
        if entry.name.endswith(TEMP_SUFFIX) and entry.kind != DIRECTORY:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.name, dir_fd=entry.dir_fd)
            report.removed_temp += 1
            return None
        if entry.name.endswith(BLOCK_SUFFIX):
            report.files += 1
            if report.files % _SCAN_LOG_EVERY == 0:
                log.info(
                    "FS tier %s: scanned %d files in %s", self.name, report.files, self.pool_dir
                )
            return self._scan_file(pool, entry)
        if entry.kind == "symlink":
            log.warning("FS tier %s: %s is a symlink: not followed", self.name,
                        pool.full(entry.rel))  # fmt: skip
        return None

    def _scan_file(self, pool: PoolDir, entry: Entry) -> tuple[float, BlockKey, int] | None:
        """The index entry of one ``*.kvb`` file if its header verifies; otherwise
        the file is removed (a directory in its place is left there), counted
        and logged."""
        path = pool.full(entry.rel)
        identity: tuple[int, int] | None = None
        try:
            fd, st = safefs.open_regular_entry(entry, path)
            identity = safefs.identity_of(st)
            try:
                header = fsformat.decode_header(os.pread(fd, HEADER_SIZE, 0))
            finally:
                os.close(fd)
            fsformat.verify_header(
                header, key=None, fingerprint=self._fingerprint, block_bytes=self.block_bytes
            )
            if fsformat.block_rel_path(header.key) != entry.rel:
                raise CorruptBlock(f"header names key {header.key.hex()}, not this file")
            if st.st_size != self.file_bytes:
                raise CorruptBlock(f"file is {st.st_size} bytes, expected {self.file_bytes}")
        except FileNotFoundError:
            return None
        except UnexpectedEntry as exc:
            self._scan_drops(entry, blockfile.bad_entry(exc), path)
            return None
        except (CorruptBlock, OSError) as exc:
            self._scan_drops(entry, CorruptFile(str(exc), identity), path)
            return None
        return st.st_mtime, header.key, st.st_size

    def _scan_drops(self, entry: Entry, error: CorruptFile, path: str) -> None:
        """Logs, counts and (unless a directory) removes a bad entry the scan met."""
        report = self.scan_report
        if error.kind == REGULAR:
            log.warning("FS tier %s: removing unreadable block file %s: %s", self.name, path,
                        error.reason)  # fmt: skip
            report.removed_corrupt += 1
        else:
            action = "removing it" if error.identity is not None else "leaving it there"
            log.warning("FS tier %s: bad block file %s: %s; %s", self.name, path, error.reason,
                        action)  # fmt: skip
            report.bad_entries += 1
        if error.identity is not None:
            safefs.unlink_if_same(entry.dir_fd, entry.name, error.identity)
        with self._lock:
            self._counters["checksum_failures"] += 1

    def _finish_scan(self, entries: list[tuple[float, BlockKey, int]], seconds: float) -> None:
        """Merges the scanned files under the blocks written meanwhile (more recent)."""
        entries.sort(key=lambda e: e[0])
        with self._lock:
            during, self._index = self._index, OrderedDict()
            self.budget.release(self._used)
            self._used = 0
            for mtime, key, size in entries:
                if key not in during:
                    self._index_add_locked(key, size, mtime)
            for key, (size, last_use) in during.items():
                self._index_add_locked(key, size, last_use)
            self.scan_report.indexed = len(self._index)
            self.scan_report.seconds = seconds
        try:
            self._evict_to_capacity()
        except TierFull:
            log.warning("FS tier %s: over capacity after the scan", self.name)
        with self._lock:
            self._scanned = True
        log.info(
            "FS tier %s: index of %s ready: %d blocks, %d bytes, %d corrupt and %d temp files "
            "removed, %d bad entries (not regular files), %.2fs",
            self.name, self.pool_dir, len(self._index), self._used,
            self.scan_report.removed_corrupt, self.scan_report.removed_temp,
            self.scan_report.bad_entries, seconds,
        )  # fmt: skip
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._set_ready)

    def _set_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    # -- small helpers ---------------------------------------------------------------

    def _require_io(self) -> IoPool:
        if self._io is None:
            raise RuntimeError(f"FS tier {self.name} was not started")
        return self._io

    def _path(self, key: BlockKey) -> str:
        return os.path.join(self.pool_dir, fsformat.block_rel_path(key))

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_rows:
            raise ValueError(f"block id {block_id} outside the region (0..{self._num_rows - 1})")

    def _full(self, rel: str) -> str:
        """``rel`` (relative to the pool directory) as a full path, for messages."""
        return os.path.join(self.pool_dir, rel)

    def _unlink_quietly(self, rel: str) -> None:
        """Unlinks ``rel`` below the pool directory (not a directory, never through a
        symlink); a failure is logged, not raised."""
        try:
            with PoolDir(self.pool_dir) as pool:
                pool.unlink(rel)
        except FileNotFoundError:
            pass
        except (OSError, UnexpectedEntry) as exc:
            log.warning("FS tier %s: cannot remove %s: %s", self.name, self._full(rel), exc)

    def _temp_name(self) -> str:
        """A name no other writer uses: a random tag per tier instance (so not one of
        a crashed run's leftovers) and a counter (``next`` on it is atomic)."""
        return f"{self._temp_tag}-{next(self._temp_counter)}"


# -- module helpers -----------------------------------------------------------------------


def _flatten(outcomes: list[Outcome], sizes: list[int]) -> list[Outcome]:
    """Per-block outcomes from per-group ones (a group that failed as a whole, e.g.
    when the pool shut down before running it, fails each of its blocks)."""
    flat: list[Outcome] = []
    for outcome, size in zip(outcomes, sizes, strict=True):
        flat.extend(outcome.value if outcome.ok else [outcome] * size)
    return flat


@dataclass(frozen=True, slots=True)
class _Doomed:
    """An evicted key whose file is still to be removed, and its charged bytes."""

    key: BlockKey
    nbytes: int


def _name(rel: str) -> str:
    """The last component of a path relative to the pool directory."""
    return rel.rsplit("/", 1)[-1]


def _beside(rel: str, name: str) -> str:
    """``name`` in the directory of ``rel`` (both relative to the pool directory)."""
    head, _, _ = rel.rpartition("/")
    return f"{head}/{name}" if head else name


def _time_write_read(directory: str, buffer: mmap.mmap, extra_flags: int) -> float:
    """Seconds to write ``buffer`` to a new file in ``directory`` and read it back."""
    path = os.path.join(directory, f".speed-{secrets.token_hex(8)}{TEMP_SUFFIX}")
    view = memoryview(buffer)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
    try:
        blockfile.write_all(fd, [view])
        if blockfile.read_all(fd, [view]) != len(view):
            raise OSError(errno.EIO, f"speed probe {path} read back short")
        return time.perf_counter() - start
    finally:
        view.release()
        os.close(fd)
        blockfile.unlink_quietly(path)


def _probe_file(directory: str, extra_flags: int) -> None:
    path = os.path.join(directory, f".probe-{secrets.token_hex(8)}{TEMP_SUFFIX}")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        page[:8] = b"kvtierd!"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
        try:
            blockfile.write_all(fd, [memoryview(page)])
            back = mmap.mmap(-1, mmap.PAGESIZE)
            try:
                got = blockfile.read_all(fd, [memoryview(back)])
                if got != mmap.PAGESIZE or back[:8] != b"kvtierd!":
                    raise OSError(errno.EIO, f"probe file {path} read back wrong bytes")
            finally:
                back.close()
        finally:
            os.close(fd)
    finally:
        page.close()
        blockfile.unlink_quietly(path)
