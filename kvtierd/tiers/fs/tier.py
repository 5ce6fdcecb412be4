"""The FS tier (docs/design/tiers.md): one file per block under a root directory.

Differences from vLLM's FS tier (docs/design/semantics.md, "The fs tier, against
vLLM's"): a byte capacity with LRU eviction, a verified header (key, pool
fingerprint, length, xxh3-64 of the payload; with ``integrity_key_file`` a MAC
too, :mod:`kvtierd.tiers.integrity`) on every file, an in-memory index rebuilt
at start, and partial success of loads reported per key.

This module is the tier's lifecycle and job flow; the state lives elsewhere:

* :mod:`~kvtierd.tiers.fs.index` -- :class:`BlockIndex` owns every piece of
  per-key state and its lock; :class:`DiskBudget` the shared capacity.
* :mod:`~kvtierd.tiers.fs.startup` -- root, ``pool.json`` and O_DIRECT probes.
* :mod:`~kvtierd.tiers.fs.scan` -- the index rebuild at start.
* :mod:`~kvtierd.tiers.fs.files` -- removing evicted and corrupt files.
* :mod:`~kvtierd.tiers.fs.groups` -- the write and read paths of a job's block
  groups on the I/O threads.

Ownership and invariants:

* Rows: during a store job the pool keeps the rows pinned and this tier only
  reads them; during a load job the rows are reserved and only this tier
  writes them. In an I/O worker process that happens in place (checksum + write
  from the worker's own mapping of the row, ``preadv`` into it); in the
  daemon's own I/O threads (``io_processes = 0``) never through the mapping: a
  row is copied out with :class:`~kvtierd.primary.rows.RegionRows` first, a
  block file is read and verified in a bounce buffer and then copied in, so a
  client that truncated the region fails that block instead of killing the
  daemon with SIGBUS. A row is never touched after its job's ``on_done`` ran.
  A row whose block failed verification may hold garbage; it is never
  reported as loaded.
* Block I/O: the file work of a group of blocks (:mod:`~kvtierd.tiers.fs.blockfile`)
  is one request to the tier's :class:`~kvtierd.tiers.fs.blockio.BlockIo`, run
  inline on the I/O thread or in an I/O worker process that maps the region
  itself. A group's keys are reserved (writes) or marked being read in the
  index before the request and settled after its replies
  (:mod:`~kvtierd.tiers.fs.groups`, the write and read paths).
* Files are immutable once renamed into place (temp file + full write +
  optional fdatasync + rename). A file is removed only (a) by eviction, never
  while a read of it is in flight, (b) when it fails verification (load, scan
  or fsck), and only if the path still names the inode that failed, or (c) as a
  leftover ``*.tmp`` at start. A directory is never removed.
* Paths: everything below the pool directory is opened through
  :class:`~kvtierd.tiers.fs.safefs.PoolDir` (no symlink followed, no open that
  can block). Anything but a regular file where a block file belongs fails
  verification like a corrupt file: the key answers MISS, is counted in
  ``checksum_failures`` and logged with the path and type.
* Capacity: a write is admitted only once its bytes fit in the shared
  :class:`DiskBudget` (evicting this pool's least recently used files first),
  so the bytes on disk never exceed the capacity through a write.
* Threads: a tier either owns its :class:`IoPool` or uses one shared by the
  pools of one configured tier (then it never shuts it down). Shutdown is
  bounded: a scan or I/O thread stuck in the file system is left behind after
  :data:`~kvtierd.tiers.fs.scan.SCAN_JOIN_S` / :data:`~kvtierd.tiers.iopool.JOIN_S`.
* Every submitted job reports exactly once through ``on_done`` on the loop.
* Shared root (``shared``): a :class:`~kvtierd.tiers.fs.shared.SharedRoot`
  thread, started once the index is ready, adopts files other daemons wrote
  (after a lookup missed them, or at a periodic rescan) and drops files they
  removed; a lookup still answers from the index alone (MISS at once for what
  it does not hold yet, unless the Lookup waits for the check: :meth:`FsTier.ask`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.primary.rows import RegionRows
from kvtierd.tiers.base import JobCallback, JobResult, SecondaryTier, TierJob, TierStats
from kvtierd.tiers.blockformat import HEADER_SIZE, PoolIdentity
from kvtierd.tiers.configured import PoolBinding
from kvtierd.tiers.failures import NONE_FAILED, FailedLoads, sort_failed, transient_cause
from kvtierd.tiers.fs import startup
from kvtierd.tiers.fs.blockio import BlockIo, InlineIo, IoWorkers
from kvtierd.tiers.fs.corruptlog import CorruptFileLog
from kvtierd.tiers.fs.files import PoolFiles
from kvtierd.tiers.fs.fsformat import pool_dir_name
from kvtierd.tiers.fs.groups import BlockGroups
from kvtierd.tiers.fs.index import BlockIndex, DiskBudget, IndexedPool, TierFull
from kvtierd.tiers.fs.scan import SHARED_TEMP_MAX_AGE_S, IndexScan, ScanReport
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.fs.shared import SharedRoot
from kvtierd.tiers.fs.startup import FsTierError, PoolMismatchError
from kvtierd.tiers.fs.unserved import UnservedPools
from kvtierd.tiers.fs.writelog import WriteFailureLog
from kvtierd.tiers.integrity import KeyRing
from kvtierd.tiers.iopool import IoPool, Outcome, Pairs, flatten, group_tasks
from kvtierd.util.loopfuture import completer
from kvtierd.util.ratelimit import RateLimitedLog

__all__ = ["DiskBudget", "FsTier", "FsTierError", "PoolMismatchError", "ScanReport", "TierFull"]

log = logging.getLogger(__name__)

REGION_FAULT_LOG_S = 10.0  # at most one "region cut short" WARNING per kind this often


@dataclass(frozen=True, slots=True)
class SharedParts:
    """What the pools of one configured fs tier share (``ConfiguredFsTier`` makes each
    once): the I/O threads, the I/O worker processes, the byte capacity, the report of
    failed writes and, on a shared root, the bytes no pool of this daemon serves."""

    io_pool: IoPool | None = None
    budget: DiskBudget | None = None
    workers: IoWorkers | None = None
    write_log: WriteFailureLog | None = None
    unserved: UnservedPools | None = None
    integrity: KeyRing | None = None  # the keys of keyed integrity (integrity_key_file)
    corrupt_log: CorruptFileLog | None = None  # the lines of files that failed verification


@dataclass(frozen=True, slots=True)
class FsTierProbes:
    """Where a test holds an fs tier, injected as a clock is (never set in the daemon):
    ``before_scan`` runs on the scan's thread before it reads the directory;
    ``block_io`` replaces the tier's block I/O (e.g. one that waits at a gate)."""

    before_scan: Callable[[], object] | None = None
    block_io: BlockIo | None = None


class FsTier(SecondaryTier):
    """A secondary tier of block files under ``root`` for one pool.

    Lifecycle: construct -> :meth:`start` (:meth:`prepare` checks the root,
    writes ``pool.json``, probes O_DIRECT; :meth:`launch` starts the I/O pool
    and the index scan) -> jobs -> :meth:`shutdown`.

    Block file I/O runs in the configured tier's I/O worker processes
    (``parts.workers``, which need the pool's ``region_file``), in ``probes.block_io``
    (tests hold I/O there), or else inline on the I/O threads. With
    ``settings.shared`` other daemons use the root too (:mod:`~kvtierd.tiers.fs.shared`),
    and ``parts.unserved`` charges the root's pool directories no pool here serves to
    the budget (:mod:`~kvtierd.tiers.fs.unserved`). ``parts.integrity``: the keys its
    files are sealed with and verified under (None: unkeyed files).
    """

    medium = Medium.STORAGE

    def __init__(
        self,
        name: str,
        settings: FsTierSettings,
        pool: PoolBinding,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        parts: SharedParts = SharedParts(),
        probes: FsTierProbes = FsTierProbes(),
    ) -> None:
        """The tier ``name`` of one pool: its directory under ``settings.root``, its index
        and its files. ``parts``: what the pools of a configured tier share (I/O threads,
        worker processes, capacity, failure reports); a part not given is made for this
        tier alone from ``settings``."""
        block_bytes = pool.block_bytes
        if block_bytes < 1 or block_bytes % mmap.PAGESIZE:
            raise ValueError(f"block_bytes must be a positive multiple of {mmap.PAGESIZE}")
        if len(pool.region_buffer) % block_bytes:
            raise ValueError("region_buffer length is not a multiple of block_bytes")
        if parts.workers is not None and pool.region_file is None:
            raise ValueError("I/O workers need the pool's region_file: (path, st_dev, st_ino)")
        self.name = name
        self.root = settings.root
        self.identity = PoolIdentity(pool.pool_name, block_bytes, pool.layout)
        self.pool_dir = os.path.join(self.root, pool_dir_name(self.identity))
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_SIZE + block_bytes
        self.budget = parts.budget if parts.budget is not None else DiskBudget(settings.capacity)
        self.capacity_bytes = self.budget.capacity_bytes
        self.fsync = settings.fsync
        self.o_direct = settings.o_direct
        self._fingerprint = self.identity.fingerprint
        region = pool.region_buffer
        self._region = region.cast("B") if region.format != "B" else region
        self._on_done = on_done
        self._loop = loop
        # the I/O pool this tier starts when it was given none
        self._make_io_pool: Callable[[], IoPool] = functools.partial(
            IoPool,
            loop,
            read_threads=settings.read_threads,
            write_threads=settings.write_threads,
            max_queue_bytes=settings.max_queue_bytes,
            max_queue_jobs=settings.max_queue_jobs,
            name="kvtierd-fs",
        )
        self._io: IoPool | None = parts.io_pool
        self._owns_io = parts.io_pool is None
        self._files = PoolFiles(name, self.pool_dir)
        corrupt_log = parts.corrupt_log or CorruptFileLog(name)
        self.index = BlockIndex(name, self.file_bytes, self.budget, self._files.remove_evicted)
        indexed = IndexedPool(
            name, self.pool_dir, self._fingerprint, block_bytes, self.index, parts.integrity
        )
        self._scan = IndexScan(
            indexed, self._index_ready, probes.before_scan,
            SHARED_TEMP_MAX_AGE_S if settings.shared else 0.0, corrupt_log,
        )  # fmt: skip
        self.shared: SharedRoot | None = (
            SharedRoot(indexed, settings, parts.unserved) if settings.shared else None
        )  # fmt: skip
        self.remote = settings.shared  # other daemons write the root: a Lookup may wait for a check
        self._ready: asyncio.Future[None] | None = None
        self._write_log = parts.write_log or WriteFailureLog(name, log)
        self._region_faults = RateLimitedLog(log, REGION_FAULT_LOG_S)  # loop thread
        # inline block I/O copies rows through region rows (never the mapping); a
        # RegionRows this tier made of the region buffer is its own, closed at shutdown
        self._own_rows: RegionRows | None = None
        region_file = pool.region_file if parts.workers is not None else None
        integrity = parts.integrity
        self._groups = BlockGroups(
            name, self.index, self._files,
            probes.block_io or parts.workers or self._inline_io(pool),
            (*(region_file or ("", 0, 0)), block_bytes),
            fingerprint=self._fingerprint, num_rows=len(region) // block_bytes,
            fsync=settings.fsync, keys=integrity.wire() if integrity is not None else None,
            corrupt_log=corrupt_log,
        )  # fmt: skip

    def _inline_io(self, pool: PoolBinding) -> BlockIo:
        """Block I/O on the I/O threads themselves, through the pool's region rows (or
        rows this tier makes of its region buffer, and closes at shutdown)."""
        rows = pool.region_rows
        if rows is None:
            rows = self._own_rows = RegionRows(self._region, self.block_bytes, path=self.name)
        return InlineIo(rows)

    # -- lifecycle (loop thread unless said otherwise) -----------------------------------

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
        startup.prepare_root(self.name, self.root, self.pool_dir)
        startup.write_pool_file(self.name, self.pool_dir, self.identity)
        self._groups.o_direct = startup.probe_o_direct(
            self.name, self.pool_dir, self.o_direct, self.block_bytes
        )

    @property
    def use_o_direct(self) -> bool:
        """Whether block files are read and written with O_DIRECT (:meth:`prepare`'s probe)."""
        return self._groups.o_direct

    def launch(self) -> None:
        """Starts the I/O pool (if the tier owns one) and the index scan. On the loop."""
        if self._io is None:
            self._io = self._make_io_pool()
        self._ready = self._loop.create_future()
        self._scan.start()

    @property
    def ready(self) -> bool:
        """True once the index scan ended (lookups answer HIT/MISS, not RETRY)."""
        return self.index.ready

    @property
    def scan_report(self) -> ScanReport:
        """What the start-up scan found (final once :attr:`ready`)."""
        return self._scan.report

    async def wait_ready(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"FS tier {self.name} was not started")
        await asyncio.shield(self._ready)

    def shutdown(self) -> None:
        """Stops the scan and the I/O threads; queued jobs are reported failed.
        Bounded (see the module docstring). Any thread."""
        self._scan.cancel()
        if self.shared is not None:
            self.shared.stop()
        if self._io is not None and self._owns_io:
            self._io.shutdown()
        self._scan.join()
        if self._own_rows is not None:
            self._own_rows.close()  # copies in flight finish first; later ones fail

    def _index_ready(self) -> None:
        """Scan thread: the index is ready; starts the shared-root thread (if any) and
        resolves :meth:`wait_ready` on the loop."""
        if self.shared is not None:
            self.shared.start()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            self._loop.call_soon_threadsafe(self._set_ready)

    def _set_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    # -- SecondaryTier (loop thread) -----------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        results = self.index.lookup(keys)
        if self.shared is not None:  # misses: looked for on disk off the loop, batched
            missed = [key for key, r in zip(keys, results, strict=True) if r is LookupResult.MISS]
            if missed:
                self.shared.want(missed)
        return results

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.index.touch(keys)

    def contains(self, key: BlockKey) -> bool | None:
        return self.index.contains(key)

    def victim(self) -> BlockKey | None:
        return self.index.victim()

    def presence(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """Indexed: True; not indexed: False, or on a shared root None unless found
        missing within ``shared_negative_ttl`` (the disk may hold what others wrote)."""
        if not self.index.ready:
            return [None] * len(keys)
        shared, contains = self.shared, self.index.contains
        if shared is None:
            return [contains(key) for key in keys]
        return [True if contains(key) else (None if shared.unknown(key) else False)
                for key in keys]  # fmt: skip

    def ask(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """A shared root: the keys' header checks, queued now (:mod:`.shared`)."""
        if self.shared is None or not self.index.ready or not keys:
            return []
        future: asyncio.Future[None] = self._loop.create_future()
        self.shared.want(keys, completer(self._loop, future))
        return [future]

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        return self.index.removals(key)

    def take_removed(self) -> list[BlockKey]:
        return self.index.take_removed()

    def submit_store(self, job: TierJob) -> bool:
        io = self._require_io()
        tasks, sizes = self._groups_of(job, self._groups.store)
        start = time.perf_counter()
        accepted = io.submit_write(
            tasks, lambda outcomes: self._store_done(job, flatten(outcomes, sizes), start),
            nbytes=len(job.keys) * self.block_bytes,
        )  # fmt: skip
        if not accepted:
            self.index.count("dropped_writes")
        return accepted

    def submit_load(self, job: TierJob) -> None:
        io = self._require_io()
        tasks, sizes = self._groups_of(job, self._groups.load)
        start = time.perf_counter()
        io.submit_read(
            tasks, lambda outcomes: self._load_done(job, flatten(outcomes, sizes), start)
        )

    def statistics(self) -> TierStats:
        io = self._io
        index = self.index.statistics()
        return self.snapshot(
            index.counters,
            capacity_bytes=self.capacity_bytes,
            used_bytes=index.used_bytes,
            bytes_per_block=self.file_bytes,
            blocks=index.blocks,
            queued_jobs=io.queued_jobs if io else 0,
            queued_bytes=io.queued_bytes if io else 0,
        )

    # -- job completion (loop thread) ----------------------------------------------------

    def _store_done(self, job: TierJob, outcomes: list[Outcome], start: float) -> None:
        stored = tuple(key for key, o in zip(job.keys, outcomes, strict=True) if o.ok)
        for key, outcome in zip(job.keys, outcomes, strict=True):
            if _row_cut_short(outcome.error):  # a client truncated the region, not the disk
                self._region_fault("store", outcome.error)
            elif outcome.error is not None and transient_cause(outcome.error) is not None:
                # a worker died or timed out: its own WARNING said so; the disk is fine
                log.debug("FS tier %s: store of %s failed for now: %s", self.name, key.hex(),
                          outcome.error)  # fmt: skip
            elif isinstance(outcome.error, OSError):  # the disk refused: the operator hears
                self._write_log.failed(outcome.error, self._files.path(key))
            elif not outcome.ok:  # capacity, shutdown: counted only
                log.debug("FS tier %s: store of %s failed: %s", self.name, key.hex(), outcome.error)
        written = sum(1 for o in outcomes if o.ok and o.value)
        if written:
            self._write_log.succeeded()
        failures = len(job.keys) - len(stored)
        if failures:
            self.index.count("store_failures", failures)
        self._report(job, stored, failures, start, written * self.file_bytes)

    def _load_done(self, job: TierJob, outcomes: list[Outcome], start: float) -> None:
        loaded = tuple(key for key, o in zip(job.keys, outcomes, strict=True) if o.ok)
        failures = len(job.keys) - len(loaded)
        failed = NONE_FAILED
        if failures:
            self.index.count("load_failures", failures)
            for outcome in outcomes:
                if _row_cut_short(outcome.error):
                    self._region_fault("promotion", outcome.error)
            failed = sort_failed(job.keys, [o.error for o in outcomes])
        self._report(job, loaded, failures, start, len(loaded) * self.file_bytes, failed)

    def _region_fault(self, kind: str, error: BaseException | None) -> None:
        """One rate-limited WARNING per kind per :data:`REGION_FAULT_LOG_S`: a row of
        the pool's region could not be copied (``error`` names the row and region)."""
        self._region_faults.warning(
            kind, "FS tier %s: pool %s: %s failed, block not %s: %s", self.name,
            self.identity.pool_name, kind, "stored" if kind == "store" else "promoted", error,
        )  # fmt: skip

    def _report(
        self, job: TierJob, done: tuple[BlockKey, ...], failures: int, start: float, moved: int,
        failed: FailedLoads = NONE_FAILED,
    ) -> None:  # fmt: skip
        """``failed``: a load's keys whose file was not there (removed: a plain MISS)
        and those whose I/O could not be done now (a worker timed out or died)."""
        self._on_done(
            JobResult(
                job_id=job.job_id,
                success=failures == 0,
                successful_keys=done or None,
                seconds=time.perf_counter() - start,
                bytes_moved=moved,
                missing_keys=failed.missing,
                transient_keys=failed.transient,
                transient_cause=failed.cause,
            )
        )

    # -- small helpers ---------------------------------------------------------------------

    def _require_io(self) -> IoPool:
        if self._io is None:
            raise RuntimeError(f"FS tier {self.name} was not started")
        return self._io

    def _groups_of(
        self, job: TierJob, per_group: Callable[[Pairs], list[Outcome]]
    ) -> tuple[list[Callable[[], list[Outcome]]], list[int]]:
        """The job's I/O tasks, one per group of blocks, and the group sizes."""
        pairs = list(zip(job.keys, job.block_ids, strict=True))
        return group_tasks(pairs, self.block_bytes, per_group)


def _row_cut_short(error: BaseException | None) -> bool:
    """A block failed because its row of the region could not be copied (EFAULT:
    :class:`~kvtierd.primary.rows.RegionCutShort`, rebuilt as an OSError from the
    block I/O reply), not because of the disk."""
    return isinstance(error, OSError) and error.errno == errno.EFAULT
