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
* Block I/O: the file work of a group of blocks (:mod:`~kvtierd.tiers.blockfile`)
  is one request to ``_block_io``, run inline on the I/O thread or in an I/O
  worker process (:mod:`~kvtierd.tiers.ioworker`) that maps the region itself.
  The index, the budget and the locks stay here: a group's keys are reserved
  (writes) or marked being read before the request and settled after its
  replies, and the request returns before the group's outcomes are recorded.
* Files are immutable once renamed into place (temp file + full write +
  optional fdatasync + rename). A file is removed only (a) by eviction, never
  while a read of it is in flight, (b) when it fails verification (load, scan
  or fsck), and only if the path still names the inode that failed, or (c) as a
  leftover ``*.tmp`` at start.
* Index: ``{key: (file bytes, last use)}`` in LRU order, plus ``_used`` (sum of
  indexed file sizes) and ``_reserved`` (writes in flight); all guarded by
  ``_lock``, which I/O threads and the loop share and hold only briefly: no
  data I/O and no unlink happens under it (an eviction renames its victim
  aside under the lock, metadata only, and unlinks it after, so a concurrent
  rewrite of the key is never the file removed).
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
from dataclasses import dataclass, field
from typing import Any

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.tiers import blockfile, fsformat, ioworker
from kvtierd.tiers.base import JobCallback, JobResult, SecondaryTier, TierJob, TierStats
from kvtierd.tiers.blockfile import CorruptFile
from kvtierd.tiers.fsformat import (
    BLOCK_SUFFIX,
    HEADER_SIZE,
    POOL_FILE,
    TEMP_SUFFIX,
    CorruptBlock,
    PoolIdentity,
)
from kvtierd.tiers.iopool import IoPool, Outcome
from kvtierd.tiers.ioworker import BlockIo, InlineIo, IoWorkers, RegionRef

log = logging.getLogger("kvtierd.tiers.fs")

O_DIRECT_MODES = ("auto", "on", "off")
_SCAN_LOG_EVERY = 10_000
# Recent removals remembered for Explain, per pool: an entry takes at most ~450
# bytes (a 256-byte key, its (time, why) tuple, the OrderedDict node): ~7 MiB.
_REMOVALS_KEPT = 16384
_GROUP_BYTES = 16 << 20  # blocks per I/O task: this many bytes (at least one block)
_SPEED_PROBE_BYTES = 16 << 20  # at most this much written twice by the o_direct=auto probe
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
        self._reading: dict[BlockKey, int] = {}  # _lock: reads in flight per key
        self._counters = dict.fromkeys(_COUNTERS, 0)  # _lock
        self._removed: OrderedDict[BlockKey, tuple[float, str]] = OrderedDict()  # _lock
        self._dropped: list[BlockKey] = []  # _lock: removed since take_removed()
        self._scanned = False  # _lock
        self._stop = threading.Event()
        self._scan_thread: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
        self._made_dirs: set[str] = set()
        # Block file I/O: in worker processes, or inline on the calling I/O thread.
        self._block_io: BlockIo = workers if workers is not None else InlineIo(self._region)
        self._region_ref: RegionRef = (*(region_file or ("", 0, 0)), block_bytes)
        self._temp_tag = secrets.token_hex(6)  # temp names: tag + counter, no syscall each
        self._temp_counter = itertools.count()

    # -- lifecycle (loop thread) ---------------------------------------------------

    def start(self) -> None:
        """Checks the root, writes/verifies ``pool.json``, probes O_DIRECT, starts the scan.

        Raises FsTierError (naming the path) when the root is unusable and
        PoolMismatchError when ``pool.json`` describes another pool.
        """
        self._prepare_root()
        self._write_pool_file()
        self.use_o_direct = self._probe_o_direct()
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
        """Stops the scan and the I/O threads; queued jobs are reported failed."""
        self._stop.set()
        if self._io is not None and self._owns_io:
            self._io.shutdown()
        if self._scan_thread is not None:
            self._scan_thread.join()

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
            if not outcome.ok:
                log.debug("FS tier %s: store of %s failed: %s", self.name, key.hex(), outcome.error)
        written = sum(1 for o in outcomes if o.ok and o.value)
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
                if key in self._index or key in self._writing:
                    self._touch_locked((key,))
                    return False
                if self.budget.try_charge(self.file_bytes):
                    self._writing.add(key)
                    self._reserved += self.file_bytes
                    return True
                doomed = self._doom_lru_locked(self.file_bytes)
            self._remove_doomed(doomed)

    def _write_files(self, items: list[tuple[BlockKey, int]]) -> list[BaseException | None]:
        """Writes row ``block_id`` as ``key``'s file for each ``(key, block_id)``, in one
        block I/O request; per item None (written) or the error. The caller holds
        the keys' write reservations, so no one else reads or writes these paths."""
        errors: list[BaseException | None] = [None] * len(items)
        todo: list[tuple[int, tuple[int, str, str, BlockKey]]] = []
        for n, (key, block_id) in enumerate(items):
            path = self._path(key)
            try:
                self._make_dir(os.path.dirname(path))
            except OSError as exc:
                errors[n] = exc
                continue
            todo.append((n, (block_id, path, f"{path}.{self._temp_name()}{TEMP_SUFFIX}", key)))
        params = (self._fingerprint, self.use_o_direct, self.fsync)
        try:
            replies = self._block_io.call(
                (ioworker.WRITE, self._region_ref, params, [item for _, item in todo])
            )
        except OSError as exc:  # the worker died: whether it renamed a file is unknown
            for n, (_, path, temp_path, _) in todo:
                blockfile.unlink_quietly(temp_path)
                blockfile.unlink_quietly(path)
                errors[n] = exc
            return errors
        for (n, _), reply in zip(todo, replies, strict=True):
            errors[n] = ioworker.error_of(reply)
        return errors

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
        params = (self._fingerprint, self.use_o_direct)
        request = [(block_id, self._path(key), key) for key, block_id in items]
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
            self._discard_corrupt(self._path(key), key, error.identity, error.reason)

    def _discard_corrupt(
        self, path: str, key: BlockKey, identity: tuple[int, int], reason: str
    ) -> None:
        """Removes a file that failed verification, if the path still names that inode."""
        log.warning("FS tier %s: removing corrupt block file %s: %s", self.name, path, reason)
        with self._lock:
            self._counters["checksum_failures"] += 1
            try:
                current = os.stat(path)
            except FileNotFoundError:
                self._index_remove_locked(key)
                return
            if (current.st_dev, current.st_ino) == identity:
                blockfile.unlink_quietly(path)
                self._index_remove_locked(key)
                self._note_removed_locked(key, f"file failed verification ({reason}); removed")

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

    def _doom_lru_locked(self, size: int) -> tuple[str, int]:
        """Takes this pool's least recently used file that is not being read out of
        the index and renames it aside; returns ``(aside path, bytes)``. Its bytes
        stay charged to the budget until :meth:`_remove_doomed` unlinks it, so the
        bytes on disk never exceed the capacity. Raises TierFull when nothing of
        this pool can be evicted (``size``: what the caller wanted room for)."""
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
        path = self._path(victim)
        aside = f"{path}.{self._temp_name()}.evicted{TEMP_SUFFIX}"
        try:
            os.rename(path, aside)  # metadata only: fast, and a rewrite of the key is safe
        except FileNotFoundError:
            return "", nbytes
        except OSError:
            blockfile.unlink_quietly(path)  # cannot rename: unlink here, holding the lock
            return "", nbytes
        return aside, nbytes

    def _remove_doomed(self, doomed: tuple[str, int]) -> None:
        """Unlinks a file :meth:`_doom_lru_locked` renamed aside, then uncharges it.
        A crash in between leaves a ``*.tmp`` file, removed by the next start's scan."""
        aside, nbytes = doomed
        try:
            if aside:
                blockfile.unlink_quietly(aside)
        finally:
            self.budget.release(nbytes)

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
            os.makedirs(self.pool_dir, exist_ok=True)
        except OSError as exc:
            raise FsTierError(
                f"FS tier {self.name}: cannot create pool directory {self.pool_dir} under root "
                f"{self.root}: {exc.strerror or exc}"
            ) from exc

    def _write_pool_file(self) -> None:
        path = os.path.join(self.pool_dir, POOL_FILE)
        ours = self.identity.describe()
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            text = None
        if text is not None:
            try:
                theirs = json.loads(text)
            except ValueError:
                theirs = text
            if theirs != ours:
                raise PoolMismatchError(
                    f"FS tier {self.name}: {path} describes {theirs!r}, but this pool is "
                    f"{ours!r}; remove the directory {self.pool_dir} or use another root"
                )
            return
        tmp = f"{path}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                json.dump(ours, f, indent=2, sort_keys=True)
                f.write("\n")
            os.rename(tmp, path)
        except OSError as exc:
            blockfile.unlink_quietly(tmp)
            raise FsTierError(
                f"FS tier {self.name}: cannot write {path}: {exc.strerror or exc}"
            ) from exc

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
        """Rebuilds the index from file headers (scan thread); lookups RETRY until done."""
        report = self.scan_report
        start = time.perf_counter()
        entries: list[tuple[float, BlockKey, int]] = []
        try:
            self._scan_hook()
            for full, rel in _walk_pool(self.pool_dir):
                if self._stop.is_set():
                    return
                if rel.endswith(TEMP_SUFFIX):
                    blockfile.unlink_quietly(full)
                    report.removed_temp += 1
                    continue
                if not rel.endswith(BLOCK_SUFFIX):
                    continue
                report.files += 1
                if report.files % _SCAN_LOG_EVERY == 0:
                    log.info(
                        "FS tier %s: scanned %d files in %s", self.name, report.files, self.pool_dir
                    )
                entry = self._scan_file(full, rel)
                if entry is not None:
                    entries.append(entry)
        except Exception:
            log.exception(
                "FS tier %s: scan of %s failed; index is partial", self.name, self.pool_dir
            )
        finally:
            self._finish_scan(entries, time.perf_counter() - start)

    def _scan_file(self, full: str, rel: str) -> tuple[float, BlockKey, int] | None:
        try:
            with open(full, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                header = fsformat.decode_header(os.pread(f.fileno(), HEADER_SIZE, 0))
            fsformat.verify_header(
                header, key=None, fingerprint=self._fingerprint, block_bytes=self.block_bytes
            )
            if fsformat.block_rel_path(header.key) != rel:
                raise CorruptBlock(f"header names key {header.key.hex()}, not this file")
            if st.st_size != self.file_bytes:
                raise CorruptBlock(f"file is {st.st_size} bytes, expected {self.file_bytes}")
        except FileNotFoundError:
            return None
        except (CorruptBlock, OSError) as exc:
            log.warning("FS tier %s: removing unreadable block file %s: %s", self.name, full, exc)
            blockfile.unlink_quietly(full)
            self.scan_report.removed_corrupt += 1
            with self._lock:
                self._counters["checksum_failures"] += 1
            return None
        return st.st_mtime, header.key, st.st_size

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
            "removed, %.2fs",
            self.name, self.pool_dir, len(self._index), self._used,
            self.scan_report.removed_corrupt, self.scan_report.removed_temp, seconds,
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

    def _make_dir(self, directory: str) -> None:
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)

    def _temp_name(self) -> str:
        """A name no other writer uses: a random tag per tier instance (so not one of
        a crashed run's leftovers) and a counter (``next`` on it is atomic)."""
        return f"{self._temp_tag}-{next(self._temp_counter)}"


# -- fsck ------------------------------------------------------------------------------


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
    """Verifies every block file under every pool dir of ``root`` completely.

    Checks header, pool fingerprint, payload length, file name vs key and the
    payload checksum. ``remove=True`` unlinks bad files (safe while a daemon runs:
    it treats a vanished file as a miss). Temp files are counted, never removed
    (a live daemon may be writing them). ``progress(files_checked, path)`` is
    called after each file.
    """
    root = os.fspath(root)
    report = FsckReport(root=root)
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        pool_file = os.path.join(entry.path, POOL_FILE)
        if not entry.is_dir() or not os.path.isfile(pool_file):
            continue
        report.pools += 1
        try:
            with open(pool_file, encoding="utf-8") as f:
                desc = json.load(f)
            fingerprint = bytes.fromhex(desc["fingerprint"])
            block_bytes = int(desc["block_bytes"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.bad.append((pool_file, f"unreadable pool description: {exc}"))
            continue
        for full, rel in _walk_pool(entry.path):
            if rel.endswith(TEMP_SUFFIX):
                report.temp_files += 1
                continue
            if not rel.endswith(BLOCK_SUFFIX):
                continue
            reason = _check_file(full, rel, fingerprint, block_bytes)
            report.files_checked += 1
            if reason is not None:
                report.bad.append((full, reason))
                if remove:
                    blockfile.unlink_quietly(full)
                    report.removed += 1
            if progress is not None:
                progress(report.files_checked, full)
    return report


def _check_file(full: str, rel: str, fingerprint: bytes, block_bytes: int) -> str | None:
    """None if the file verifies completely, else the reason it does not."""
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"unreadable: {exc}"
    view = memoryview(data)
    try:
        header = fsformat.decode_header(view[:HEADER_SIZE])
        fsformat.verify_header(header, key=None, fingerprint=fingerprint, block_bytes=block_bytes)
        if fsformat.block_rel_path(header.key) != rel:
            raise CorruptBlock(f"header names key {header.key.hex()}, not this file")
        if len(data) != HEADER_SIZE + block_bytes:
            raise CorruptBlock(f"file is {len(data)} bytes, expected {HEADER_SIZE + block_bytes}")
        if fsformat.payload_checksum(view[HEADER_SIZE:]) != header.payload_checksum:
            raise CorruptBlock("payload checksum mismatch")
    except CorruptBlock as exc:
        return exc.reason
    return None


# -- module helpers -----------------------------------------------------------------------


def _flatten(outcomes: list[Outcome], sizes: list[int]) -> list[Outcome]:
    """Per-block outcomes from per-group ones (a group that failed as a whole, e.g.
    when the pool shut down before running it, fails each of its blocks)."""
    flat: list[Outcome] = []
    for outcome, size in zip(outcomes, sizes, strict=True):
        flat.extend(outcome.value if outcome.ok else [outcome] * size)
    return flat


def _walk_pool(pool_dir: str):  # -> Iterator[tuple[str, str]]
    """(full path, path relative to ``pool_dir`` with '/') of every file below the pool dir."""
    for dirpath, _dirnames, filenames in os.walk(pool_dir):
        rel_dir = os.path.relpath(dirpath, pool_dir)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            yield os.path.join(dirpath, name), rel


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
