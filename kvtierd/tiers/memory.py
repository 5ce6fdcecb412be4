"""An in-memory secondary tier: the reference implementation of the tier contract.

It keeps a copy of each block in a dict bounded by a byte capacity and evicts
the least recently used block to admit a new one. It has no threads and no
locks: a job accepted now runs in a later callback of the event loop (one
memory copy per block) and reports from that callback. Small enough to read
beside :mod:`kvtierd.tiers.base`, it is the executable reading of that
contract: the contract suite (``tests/tiers/``) runs it beside the fs tier,
and the orchestration tests script faults on a subclass of it.

It is not a configurable tier type: blocks kept in the daemon's own memory
would compete with the primary region they are meant to extend. Being test-only,
it copies rows through the region's mapping in place; the tiers the daemon runs
never do (a client may truncate the region: :mod:`kvtierd.primary.rows`).

Ownership: everything here belongs to the event loop thread.

Invariants:

* ``_used_bytes == len(_blocks) * block_bytes <= capacity_bytes``;
* ``_blocks`` is in recency order: first the least recently used;
* every accepted job is in ``_queued`` until it runs or :meth:`MemoryTier.shutdown`
  fails it, and reports exactly once afterwards; ``_unreported`` counts accepted
  jobs whose report has not run, and reaching 0 wakes :meth:`MemoryTier.drain`
  (:class:`~kvtierd.tiers.iopool.JobsInFlight`);
* ``_stores_unreported`` (accepted store jobs not reported yet) never exceeds
  ``max_queue_jobs``: that is the backpressure bound.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.tiers.base import (
    UNKNOWN_VICTIM,
    JobCallback,
    JobResult,
    Removals,
    SecondaryTier,
    TierJob,
    TierStats,
    zero_counters,
)
from kvtierd.tiers.iopool import JobsInFlight

log = logging.getLogger(__name__)

REMOVALS_KEPT = 1024  # recent removals remembered for Explain, per tier instance


class StoreOutcome(enum.Enum):
    """What storing one block did."""

    WRITTEN = enum.auto()  # copied in
    PRESENT = enum.auto()  # held already: not rewritten (keys name content)
    FAILED = enum.auto()  # not held: no room, or a row outside the region


class MemoryTier(SecondaryTier):
    """Blocks of one pool in process memory, at most ``capacity_bytes`` of them.

    Lifecycle as in :mod:`kvtierd.tiers.base`; :meth:`launch` makes the tier
    ready in a later loop callback (as an index rebuilt in the background would),
    so a caller that assumes readiness right after launch fails here too.
    :meth:`pause` holds every job until :meth:`resume`: what a slow medium looks
    like, for tests that need jobs in flight.

    Hooks for subclasses that script a tier in tests: :meth:`_store_block` and
    :meth:`_load_block` decide one block each (override to fail chosen keys),
    :meth:`_run_now` runs one accepted job and reports it at once (for a test that
    stands in for the event loop), :meth:`_become_ready` ends the start-up.
    """

    medium = Medium.CPU

    def __init__(
        self,
        name: str,
        block_bytes: int,
        region_buffer: memoryview,
        capacity_bytes: int,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        max_queue_jobs: int = 1024,
    ) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if max_queue_jobs < 0:
            raise ValueError(f"max_queue_jobs must be >= 0, got {max_queue_jobs}")
        region = region_buffer.cast("B") if region_buffer.format != "B" else region_buffer
        if len(region) % block_bytes:
            raise ValueError("region_buffer length is not a multiple of block_bytes")
        self.name = name
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.max_queue_jobs = max_queue_jobs
        self._region = region
        self._num_rows = len(region) // block_bytes
        self._on_done = on_done
        self._loop = loop
        # Invariant: _used_bytes == len(_blocks) * block_bytes <= capacity_bytes
        self._blocks: OrderedDict[BlockKey, bytes] = OrderedDict()  # LRU first
        self._used_bytes = 0
        self._queued: dict[int, TierJob] = {}  # accepted, not run yet (submission order)
        self._unreported = JobsInFlight(loop)  # accepted jobs whose on_done has not run
        self._stores_unreported = 0  # the store jobs among them: <= max_queue_jobs
        self._store_keys_unreported = 0  # their keys (for queued_bytes)
        self._counters = zero_counters()  # checksum_failures stays 0: nothing to verify
        self._removals = Removals(REMOVALS_KEPT)
        self._launched = False
        self._ready: asyncio.Future[None] | None = None  # created by launch()
        self._paused = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------

    def launch(self) -> None:
        if self._launched:
            raise RuntimeError(f"memory tier {self.name} was launched already")
        self._launched = True
        self._ready = self._loop.create_future()
        self._loop.call_soon(self._become_ready)

    def _become_ready(self) -> None:
        """Ends the start-up (a loop callback after launch(); nothing to rebuild)."""
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    @property
    def ready(self) -> bool:
        return self._ready is not None and self._ready.done()

    async def wait_ready(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"memory tier {self.name} was not launched")
        await asyncio.shield(self._ready)

    async def drain(self) -> None:
        await self._unreported.drain()

    def shutdown(self) -> None:
        """Fails every job not run yet (each reports in a later loop callback)."""
        self._closed = True
        failed, self._queued = list(self._queued.values()), {}
        for job in failed:
            self._count_failures(job, len(job.keys))
            self._loop.call_soon(self._report, job, JobResult(job.job_id, success=False))

    def pause(self) -> None:
        """Holds every job, queued or submitted from now on, until :meth:`resume`."""
        self._paused = True

    def resume(self) -> None:
        """Runs the held jobs (in later loop callbacks, in submission order)."""
        self._paused = False
        for job_id in self._queued:
            self._loop.call_soon(self._run, job_id)

    # -- lookups -------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        if not self.ready:
            return [LookupResult.RETRY] * len(keys)
        results = []
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                results.append(LookupResult.HIT)
            else:
                results.append(LookupResult.MISS)
        hits = results.count(LookupResult.HIT)
        self._counters["hits"] += hits
        self._counters["misses"] += len(keys) - hits
        return results

    def contains(self, key: BlockKey) -> bool | None:
        return key in self._blocks if self.ready else None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def victim(self) -> BlockKey | None:
        if self._used_bytes + self.block_bytes <= self.capacity_bytes:
            return None
        return next(iter(self._blocks), UNKNOWN_VICTIM)

    def take_removed(self) -> list[BlockKey]:
        return self._removals.take()

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        return self._removals.of(key)

    # -- jobs ----------------------------------------------------------------------

    def submit_store(self, job: TierJob) -> bool:
        self._require_open()
        if self._stores_unreported + 1 > self.max_queue_jobs:
            self._counters["dropped_writes"] += 1
            return False
        self._stores_unreported += 1
        self._store_keys_unreported += len(job.keys)
        self._accept(job)
        return True

    def submit_load(self, job: TierJob) -> None:
        self._require_open()
        self._accept(job)

    def statistics(self) -> TierStats:
        return self.snapshot(
            self._counters,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self._used_bytes,
            bytes_per_block=self.block_bytes,
            blocks=len(self._blocks),
            queued_jobs=len(self._queued),
            queued_bytes=self._store_keys_unreported * self.block_bytes,
        )

    # -- job execution (loop callbacks) ----------------------------------------------

    def _accept(self, job: TierJob) -> None:
        assert len(job.keys) == len(job.block_ids), f"job {job.job_id}: keys and rows differ"
        self._queued[job.job_id] = job
        self._unreported.add()
        if not self._paused:
            self._loop.call_soon(self._run, job.job_id)

    def _run(self, job_id: int) -> None:
        """The loop callback of one accepted job: runs it unless held by pause()."""
        if not self._paused:
            self._run_now(job_id)

    def _run_now(self, job_id: int) -> None:
        """Runs one accepted job and reports it (the caller stands for the loop)."""
        job = self._queued.pop(job_id, None)
        if job is None:
            return  # failed by shutdown, or run already (scheduled twice across a pause)
        start = time.perf_counter()
        if job.is_promotion:
            done = [self._load_block(k, r) for k, r in zip(job.keys, job.block_ids, strict=True)]
            moved = done.count(True)
        else:
            outcomes = [
                self._store_block(k, r) for k, r in zip(job.keys, job.block_ids, strict=True)
            ]
            done = [o is not StoreOutcome.FAILED for o in outcomes]
            moved = outcomes.count(StoreOutcome.WRITTEN)
        made_it = tuple(key for key, ok in zip(job.keys, done, strict=True) if ok)
        self._count_failures(job, len(job.keys) - len(made_it))
        result = JobResult(
            job_id=job.job_id,
            success=len(made_it) == len(job.keys),
            successful_keys=made_it or None,
            seconds=time.perf_counter() - start,
            bytes_moved=moved * self.block_bytes,
        )
        self._report(job, result)

    def _report(self, job: TierJob, result: JobResult) -> None:
        """Hands a job's result to ``on_done``, then wakes drain() once idle."""
        try:
            self._on_done(result)
        except Exception:
            log.exception("memory tier %s: on_done of job %d failed", self.name, job.job_id)
        finally:
            if not job.is_promotion:
                self._stores_unreported -= 1  # unreported stores n -> n-1
                self._store_keys_unreported -= len(job.keys)
            assert self._stores_unreported >= 0
            self._unreported.done()  # unreported jobs n -> n-1; 0 wakes drain()

    def _store_block(self, key: BlockKey, block_id: int) -> StoreOutcome:
        """Copies row ``block_id`` in as ``key``, evicting LRU blocks to make room."""
        if not self._valid_row(block_id):
            return StoreOutcome.FAILED
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return StoreOutcome.PRESENT
        if not self._make_room():
            return StoreOutcome.FAILED
        self._blocks[key] = bytes(self._row(block_id))
        self._used_bytes += self.block_bytes
        assert self._used_bytes <= self.capacity_bytes, "over capacity after a store"
        self._counters["bytes_written"] += self.block_bytes
        return StoreOutcome.WRITTEN

    def _load_block(self, key: BlockKey, block_id: int) -> bool:
        """Copies ``key``'s block into row ``block_id``; False when the tier does not
        hold it (the row is left alone)."""
        data = self._blocks.get(key)
        if data is None or not self._valid_row(block_id):
            return False
        assert len(data) == self.block_bytes, f"stored copy of {key!r} has the wrong length"
        self._row(block_id)[:] = data
        self._blocks.move_to_end(key)
        self._counters["bytes_read"] += self.block_bytes
        return True

    def _make_room(self) -> bool:
        """Evicts least recently used blocks until one more fits; False when even an
        empty tier cannot hold a block."""
        if self.block_bytes > self.capacity_bytes:
            return False
        while self._used_bytes + self.block_bytes > self.capacity_bytes:
            victim, _ = self._blocks.popitem(last=False)
            self._used_bytes -= self.block_bytes
            self._counters["evictions"] += 1
            self._removals.drop(victim, "evicted: least recently used at capacity")
        return True

    # -- small helpers ---------------------------------------------------------------

    def _count_failures(self, job: TierJob, failures: int) -> None:
        self._counters["load_failures" if job.is_promotion else "store_failures"] += failures

    def _require_open(self) -> None:
        if not self._launched:
            raise RuntimeError(f"memory tier {self.name} was not launched")
        if self._closed:
            raise RuntimeError(f"memory tier {self.name} is shut down")

    def _valid_row(self, block_id: int) -> bool:
        return 0 <= block_id < self._num_rows

    def _row(self, block_id: int) -> memoryview:
        return self._region[block_id * self.block_bytes : (block_id + 1) * self.block_bytes]
