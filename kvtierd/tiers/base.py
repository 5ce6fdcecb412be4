"""The secondary-tier contract.

A tier keeps copies of primary blocks somewhere else (files, Redis). The pool
drives it; the tier never decides what the primary holds.

Threading: every method here is called on the daemon's event loop and must not
block. I/O runs on the tier's own threads; when a job ends the tier calls the
``on_done`` callback it was constructed with *on the event loop* (through
``loop.call_soon_threadsafe``), exactly once per submitted job, success or not.

Ownership: while a store job runs, the pool keeps its primary rows pinned (the
tier only reads them); while a load job runs, its rows are reserved (ref count
-1) and only the tier writes them. A tier must not touch a row after reporting
its job done.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey, LookupResult, Medium


@dataclass(frozen=True, slots=True)
class TierJob:
    """Move ``keys`` between the tier and primary rows ``block_ids`` (co-indexed)."""

    job_id: int
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    is_promotion: bool  # True: tier -> primary (load); False: primary -> tier (store)


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended. For a failed job, ``successful_keys`` lists the keys that
    made it (a promotion: rows filled and verified; a store: the tier holds the
    block now); None: none of them."""

    job_id: int
    success: bool
    successful_keys: tuple[BlockKey, ...] | None = None
    seconds: float = 0.0
    bytes_moved: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    medium: Medium
    capacity_bytes: int
    used_bytes: int
    bytes_per_block: int  # what one block occupies on the tier (header included)
    blocks: int
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    evictions: int
    store_failures: int
    load_failures: int
    checksum_failures: int
    dropped_writes: int  # cascade writes refused by backpressure
    queued_jobs: int
    queued_bytes: int


JobCallback = Callable[[JobResult], None]


class SecondaryTier(abc.ABC):
    """One secondary tier bound to one pool (its namespace and block size)."""

    name: str
    medium: Medium

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        """HIT (present), MISS, or RETRY (the tier cannot answer yet, e.g. its index
        is still being rebuilt). Answers from memory; never blocks."""

    @abc.abstractmethod
    def submit_store(self, job: TierJob) -> bool:
        """Queues a write of the job's rows. False: refused by backpressure (nothing
        queued, ``on_done`` will not be called, the caller releases its pins)."""

    @abc.abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Queues a read into the job's rows; each block is verified (length,
        key, pool, checksum) before it counts as loaded."""

    def touch(self, keys: Sequence[BlockKey]) -> None:  # noqa: B027 - optional hook
        """Marks keys recently used (tiers with eviction order them)."""

    def take_removed(self) -> list[BlockKey]:
        """Keys this tier dropped since the last call (evicted, failed verification,
        vanished), oldest first; the caller turns them into removed events. Called
        on the loop after each job report, so a store job's evictions come out
        before that job's stored keys."""
        return []

    def contains(self, key: BlockKey) -> bool | None:
        """Whether the tier holds ``key`` now, without touching it or counting a
        lookup; None when it cannot tell yet (for ``Explain``)."""
        return None

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        """Recent ``(unix time, why)`` removals of ``key`` from this tier (bounded)."""
        return []

    @abc.abstractmethod
    async def drain(self) -> None:
        """Returns once every submitted job has reported done."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the I/O threads; queued jobs are reported failed."""

    @abc.abstractmethod
    def statistics(self) -> TierStats: ...
