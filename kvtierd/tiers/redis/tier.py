"""The redis secondary tier for one pool: one value per block in Redis or Valkey.

A value is exactly one block of :mod:`kvtierd.tiers.blockformat` under the
Redis key ``<key_prefix>:<pool fingerprint hex>:<block key>`` (binary), so pools
of another name, block size or layout never share keys; a value that does not
verify for the key and pool it was read under is a MISS: deleted, counted in
``checksum_failures`` (``integrity_failures`` when it is not sealed under the
tier's integrity keys, :mod:`kvtierd.tiers.integrity`), never copied out as a
success.

The event loop never waits on Redis. Every Redis call runs on the I/O threads
of an :class:`~kvtierd.tiers.iopool.IoPool` (shared by the pools of one
configured tier), in :mod:`.blockio` (``SET NX`` per stored block, a bounded
``GETRANGE`` per loaded one, verified before its payload reaches the row; rows
copied with :class:`~kvtierd.primary.rows.RegionRows`, so a region a client
truncated fails only the blocks whose rows are gone), and reports through
``loop.call_soon_threadsafe``. This module is the loop's side: it submits a
job's blocks in groups of about 16 MiB (:func:`~kvtierd.tiers.iopool.group_tasks`),
settles what their outcomes mean for the keys, counts, and reports the job.

Presence: a lookup answers from what the tier knows on the loop, its
:class:`~kvtierd.tiers.redis.keybook.KeyBook` (the keys it stored, probe answers
about others). A key it knows nothing about is asked of the server through the
configured tier's :class:`~kvtierd.tiers.redis.prober.Prober`; a Lookup waits
for that answer (:meth:`RedisTier.ask`, at most ``limits.remote_lookup_wait``)
and answers HIT_PENDING for what the server holds; past the wait (or with
``0s``) the key answers MISS and the probe's answer serves the next lookup. A
promotion that finds the value gone anyway is a plain MISS
(``JobResult.missing_keys``: no retry ban).

Routing, redirects and the server's health are :mod:`.link`'s (one per
configured tier). The health refresh (``info_interval``) tells
:meth:`RedisTier.on_health` the server's evictions: when they grew, the held
keys are probed again (the least recently used first, at most
:data:`MAX_PROBE_WANTED`) and those the server dropped are dropped here too.

Capacity: with ``capacity`` > 0 the tier keeps at most that many bytes of its
own blocks and deletes the least recently used to admit a new one (the
:class:`~kvtierd.tiers.redis.keybook.KeyBook` picks them); with
``fleet_capacity`` > 0 every daemon sharing the pool keeps its blocks under one
bound together, an exact LRU kept in the server (:mod:`.fleetlru`: stores admit
their blocks, promotions touch them, the admitting daemon deletes what its
admission pushed out); with neither, the server's ``maxmemory`` policy evicts.
A block the server dropped (or another daemon evicted) is found missing at its
load or at the re-probe after an eviction (MISS, dropped from the held set): a
write is never assumed to have stayed.

Faults (server down, timeout, OOM, refused credentials, ACL or TLS): the job's
keys fail, counted, and :mod:`.faultlog` logs them (a node's fault once, any other
at most every 10 s per kind, saying which option fixes it); the tier answers from
what it knows and probes again. The daemon never stops for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.primary.rows import RegionRows
from kvtierd.tiers.base import (
    UNKNOWN_VICTIM,
    JobCallback,
    JobResult,
    SecondaryTier,
    TierJob,
    TierStats,
    zero_counters,
)
from kvtierd.tiers.blockformat import HEADER_SIZE, PoolIdentity
from kvtierd.tiers.failures import NONE_FAILED, FailedLoads, sort_failed
from kvtierd.tiers.integrity import KeyRing
from kvtierd.tiers.iopool import IoPool, Outcome, flatten, group_tasks
from kvtierd.tiers.redis.blockio import WRITTEN, BlockCorrupt, BlockMissing, RedisBlockIO
from kvtierd.tiers.redis.faultlog import TierFaultLog
from kvtierd.tiers.redis.fleetlru import Admitted, FleetLru
from kvtierd.tiers.redis.health import ServerHealth
from kvtierd.tiers.redis.keybook import KeyBook
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.nodefaults import NodeFaults
from kvtierd.tiers.redis.prober import ProbeAnswer, Prober
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

HIT, RETRY = LookupResult.HIT, LookupResult.RETRY
MAX_PROBE_WANTED = 8192  # held keys probed again after the server evicted some


class RedisTier(SecondaryTier):
    """One pool's blocks in one Redis server. Loop-thread state only; the I/O
    threads touch the region rows of running jobs and the client, nothing else."""

    medium = Medium.REMOTE
    remote = True
    _io: IoPool  # shared by the pools of the configured tier, from construction on

    def __init__(
        self,
        name: str,
        link: RedisLink,
        *,
        key_prefix: str,
        pool_name: str,
        block_bytes: int,
        layout: Any,
        region_buffer: memoryview,
        capacity_bytes: int,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        io_pool: IoPool,
        ttl_s: float = 0.0,
        presence_ttl_s: float = 1.0,
        faults: RateLimitedLog | None = None,
        region_rows: RegionRows | None = None,
        integrity: KeyRing | None = None,
        prober: Prober | None = None,
        fleet_capacity_bytes: int = 0,
    ) -> None:
        """``region_rows``: how the I/O threads copy rows (the pool's region's; None:
        one made of ``region_buffer``, owned and closed by :meth:`shutdown`).
        ``integrity``: the keys values are sealed with and verified under.
        ``prober``: the configured tier's presence probes (None: one of its own,
        closed by :meth:`shutdown`). ``fleet_capacity_bytes``: the fleet's bound
        on the pool's values in the server (0: none; at least one value)."""
        region = region_buffer.cast("B") if region_buffer.format != "B" else region_buffer
        if block_bytes < 1 or len(region) % block_bytes:
            raise ValueError("region_buffer length is not a multiple of block_bytes")
        self._own_rows: RegionRows | None = None
        if region_rows is None:
            region_rows = self._own_rows = RegionRows(region, block_bytes, path=name)
        self.name = name
        self.pool_name = pool_name
        self.block_bytes = block_bytes
        self.value_bytes = HEADER_SIZE + block_bytes
        self.capacity_bytes = capacity_bytes  # 0: the server's (no local eviction)
        self.identity = PoolIdentity(pool_name, block_bytes, layout)
        self.fingerprint = self.identity.fingerprint
        self.key_space = f"{key_prefix}:{self.fingerprint.hex()}:".encode()
        self._link = link
        self._own_prober = prober is None
        self._prober = prober if prober is not None else Prober(link, loop, name)
        self._on_done = on_done
        self._loop = loop
        self._io = io_pool
        ttl_ms = int(ttl_s * 1000) or None
        self._log = TierFaultLog(name, pool_name, link, faults)
        # the I/O threads' side: the rows of running jobs and the link, nothing else
        self._blocks = RedisBlockIO(
            link, self.key_space, self.identity, region_rows, ttl_ms, self._log.limited, name,
            integrity,
        )  # fmt: skip
        # the loop's side: what it knows about keys (held, presence, removals)
        self._keys = KeyBook(self.value_bytes, ttl_ms=ttl_ms, presence_ttl_s=presence_ttl_s)
        self._counters = zero_counters()
        self._ready: asyncio.Future[None] | None = None
        self._closed = False
        # the server as last seen: set by prepare (before launch), then on the loop
        self._health = ServerHealth()
        self._fleet: FleetLru | None = None
        if fleet_capacity_bytes:
            self._fleet = FleetLru(
                link,
                key_prefix=key_prefix,
                fingerprint_hex=self.fingerprint.hex(),
                key_space=self.key_space,
                capacity_blocks=max(1, fleet_capacity_bytes // self.value_bytes),
            )

    def prepare(self) -> None:
        """Off the loop: learns the server's mode and health (memory limit for
        ``capacity_bytes`` when ``capacity`` is 0). A server that does not answer is
        no reason to refuse the pool (it is a fault the tier lives through)."""
        try:
            self._health = self._link.refresh_health()
        except redis.RedisError as exc:
            self._log.fault("INFO", exc)

    def on_health(self, health: ServerHealth) -> None:
        """Loop: the configured tier's periodic refresh saw ``health``. Evictions
        grew since the last one: the held keys are probed again, least recently used
        first (a key the server dropped answers MISS from then on, without a failed
        promotion first)."""
        evicted = health.evicted_keys > self._health.evicted_keys
        if evicted and self._health.mode != "unknown" and not self._closed:
            held = self._keys.least_recent(MAX_PROBE_WANTED)
            self._prober.ask(self, [(self._blocks.redis_key(k), k) for k in held])
        self._health = health

    # -- lifecycle -----------------------------------------------------------------------

    def launch(self) -> None:
        """Ready at once: a remote tier holds nothing it must index first."""
        if self._ready is not None:
            raise RuntimeError(f"redis tier {self.name} was launched already")
        self._ready = self._loop.create_future()
        self._ready.set_result(None)

    @property
    def ready(self) -> bool:
        return self._ready is not None

    async def wait_ready(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"redis tier {self.name} was not launched")
        await self._ready

    def shutdown(self) -> None:
        """No new probes; the shared I/O pool (its owner stops it) fails what is queued."""
        self._closed = True
        if self._own_prober:
            self._prober.close()
        if self._own_rows is not None:
            self._own_rows.close()  # copies in flight finish first; later ones fail

    # -- lookups (loop) ------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        if not self.ready:
            return [RETRY] * len(keys)
        results, unknown = self._keys.lookup(keys)
        hits = results.count(HIT)
        self._counters["hits"] += hits
        self._counters["misses"] += len(keys) - hits
        if unknown:  # asked now; their answers serve the next lookup
            self.ask(unknown)
        return results

    def presence(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """What the tier knows (:meth:`.keybook.KeyBook.presence`); None before launch."""
        if not self.ready:
            return [None] * len(keys)
        return self._keys.presence(keys)

    def ask(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """The keys' presence asked of their nodes (:mod:`.prober`)."""
        if self._closed or not keys:
            return []
        return self._prober.ask(self, [(self._blocks.redis_key(k), k) for k in keys])

    def contains(self, key: BlockKey) -> bool | None:
        if not self.ready:
            return None
        return self._keys.contains(key)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self._keys.touch(keys)

    def victim(self) -> BlockKey | None:
        """With ``capacity``: this pool's least recently used held key once one more
        value would pass it (None before). A fleet's LRU (``fleet_capacity``) and the
        server's own eviction are in the server: UNKNOWN_VICTIM."""
        if self._fleet is not None or not self.capacity_bytes:
            return UNKNOWN_VICTIM
        if self._keys.used_bytes + self.value_bytes <= self.capacity_bytes:
            return None
        return next(self._keys.least_recent(1), UNKNOWN_VICTIM)

    def take_removed(self) -> list[BlockKey]:
        return self._keys.removals.take()

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        return self._keys.removals.of(key)

    # -- probe answers (loop) --------------------------------------------------------------

    def probe_answered(self, answer: ProbeAnswer) -> None:
        """The prober's answers about keys this tier asked (:class:`.prober.ProbeListener`),
        kept by :meth:`.keybook.KeyBook.answered`; a failed probe is counted and logged."""
        self._keys.answered(answer.answers, answer.sent_at)
        if answer.error is not None:
            self._counters["probe_failures"] += 1
            self._log.fault("probe", answer.error)

    # -- jobs (loop) ---------------------------------------------------------------------

    def submit_store(self, job: TierJob) -> bool:
        self._require_open()
        pairs = list(zip(job.keys, job.block_ids, strict=True))
        # held or being written by another job: succeeds without a rewrite
        to_write = [(k, r) for k, r in pairs if self._keys.needs_write(k)]
        tasks, sizes = group_tasks(to_write, self.block_bytes, self._blocks.store_group)
        start = time.perf_counter()
        accepted = self._io.submit_write(
            tasks,
            lambda outcomes: self._store_done(job, to_write, flatten(outcomes, sizes), start),
            nbytes=len(to_write) * self.block_bytes,
        )
        if not accepted:
            self._counters["dropped_writes"] += 1
            return False
        self._keys.writing(k for k, _ in to_write)
        return True

    def submit_load(self, job: TierJob) -> None:
        self._require_open()
        pairs = list(zip(job.keys, job.block_ids, strict=True))
        tasks, sizes = group_tasks(pairs, self.block_bytes, self._blocks.load_group)
        start = time.perf_counter()
        self._io.submit_read(
            tasks, lambda outcomes: self._load_done(job, flatten(outcomes, sizes), start)
        )

    def statistics(self) -> TierStats:
        return self.snapshot(
            self._counters,
            # 0: the server's limit (INFO), never below what this pool holds
            capacity_bytes=self.capacity_bytes
            or self._fleet_bytes
            or max(self._server_bytes, self._used_bytes),
            used_bytes=self._used_bytes,
            bytes_per_block=self.value_bytes,
            blocks=self._keys.blocks,
            probes=self._prober.probes,  # the prober's, which the pools of the tier share
            queued_jobs=self._io.queued_jobs,
            queued_bytes=self._io.queued_bytes,
            **self._link.health.stats_gauges(),
        )

    @property
    def _server_bytes(self) -> int:
        """The server's memory limit: maxmemory, or its hosts' RAM when unbounded."""
        return self._health.max_memory_bytes or self._health.system_memory_bytes

    @property
    def _fleet_bytes(self) -> int:
        return self._fleet.capacity_blocks * self.value_bytes if self._fleet else 0

    @property
    def probe_failures(self) -> int:
        return self._counters["probe_failures"]

    @property
    def _used_bytes(self) -> int:
        return self._keys.used_bytes

    # -- job completion (loop) -----------------------------------------------------------

    def _store_done(
        self,
        job: TierJob,
        written: list[tuple[BlockKey, int]],
        outcomes: list[Outcome],
        start: float,
    ) -> None:
        self._keys.written(k for k, _ in written)
        outcome_of = {key: outcome for (key, _), outcome in zip(written, outcomes, strict=True)}
        made_it: list[BlockKey] = []
        moved = 0
        for key in job.keys:
            done = outcome_of.get(key)
            if done is not None and not done.ok:
                self._log.fault("store", done.error)
                continue
            if done is not None and done.value == WRITTEN:
                moved += self.value_bytes
            made_it.append(key)
            self._keys.hold(key)
        self._counters["bytes_written"] += moved
        failures = len(job.keys) - len(made_it)
        self._counters["store_failures"] += failures
        self._evict_over_capacity(protect=set(made_it))
        self._admit(made_it)
        self._report(job, made_it, failures, start, moved)

    def _load_done(self, job: TierJob, outcomes: list[Outcome], start: float) -> None:
        made_it: list[BlockKey] = []
        for key, outcome in zip(job.keys, outcomes, strict=True):
            if outcome.ok:
                made_it.append(key)
                self._keys.loaded(key)
                continue
            error = outcome.error
            if isinstance(error, BlockCorrupt):
                self._refused(key, error)
            elif isinstance(error, BlockMissing):
                self._keys.drop(key, "vanished: the server holds no value")
            else:  # a timeout or a fault: the value (if any) stays
                self._log.fault("load", error)
        moved = len(made_it) * self.value_bytes
        self._counters["bytes_read"] += moved
        failures = len(job.keys) - len(made_it)
        self._counters["load_failures"] += failures
        self._touch_fleet(made_it)
        failed = NONE_FAILED
        if failures:  # missing: a plain MISS; transient: promoted again soon
            failed = sort_failed(job.keys, [o.error for o in outcomes], NodeFaults.outage)
        self._report(job, made_it, failures, start, moved, failed)

    def _refused(self, key: BlockKey, error: BlockCorrupt) -> None:
        """A value that failed verification (deleted by the I/O thread): counted, logged
        and dropped."""
        self._counters["integrity_failures" if error.integrity else "checksum_failures"] += 1
        self._log.refused(key, error)
        self._keys.drop(key, f"failed verification: {error}")

    def _report(
        self, job: TierJob, made_it: list[BlockKey], failures: int, start: float, moved: int,
        failed: FailedLoads = NONE_FAILED,
    ) -> None:  # fmt: skip
        try:
            self._on_done(
                JobResult(
                    job_id=job.job_id,
                    success=failures == 0,
                    successful_keys=tuple(made_it) or None,
                    seconds=time.perf_counter() - start,
                    bytes_moved=moved,
                    missing_keys=failed.missing,
                    transient_keys=failed.transient,
                    transient_cause=failed.cause,
                )
            )
        except Exception:
            log.exception("redis tier %s: on_done of job %d failed", self.name, job.job_id)

    def _evict_over_capacity(self, protect: set[BlockKey]) -> None:
        """Deletes the least recently used held blocks until within ``capacity``
        (:meth:`.keybook.KeyBook.evict_over_capacity` picks them)."""
        if not self.capacity_bytes:
            return
        victims = self._keys.evict_over_capacity(self.capacity_bytes, protect)
        self._counters["evictions"] += len(victims)
        if victims and not self._closed:
            task = functools.partial(
                self._blocks.delete, [self._blocks.redis_key(k) for k in victims]
            )
            self._io.submit_read([task], self._delete_done)

    def _admit(self, keys: list[BlockKey]) -> None:
        """Stored (written, found present or held already): the fleet's most recent
        blocks; what that pushes past ``fleet_capacity`` is deleted off the loop."""
        if self._fleet is None or not keys or self._closed:
            return
        self._io.submit_read([functools.partial(self._fleet.admit, keys)], self._admitted)

    def _admitted(self, outcomes: list[Outcome]) -> None:
        """Loop: an admission's answer. Every popped block is gone from the server
        (evicted here, or already absent): MISS from now on, held or not."""
        outcome = outcomes[0]
        if not outcome.ok:
            self._log.fault("fleet LRU", outcome.error)
            return
        admitted: Admitted = outcome.value
        for key in admitted.popped:
            self._keys.drop(key, "evicted: the fleet's least recently used at fleet_capacity")
        self._counters["evictions"] += len(admitted.popped)
        if admitted.error is not None:
            self._log.fault("fleet LRU", admitted.error)

    def _touch_fleet(self, keys: list[BlockKey]) -> None:
        """Promoted: the fleet's most recent blocks (off the loop, after the fact)."""
        if self._fleet is None or not keys or self._closed:
            return
        self._io.submit_read([functools.partial(self._fleet.touch, keys)], self._touched)

    def _touched(self, outcomes: list[Outcome]) -> None:
        error = outcomes[0].value if outcomes[0].ok else outcomes[0].error
        if error is not None:
            self._log.fault("fleet LRU", error)

    def _delete_done(self, outcomes: list[Outcome]) -> None:
        if not outcomes[0].ok:
            self._log.fault("delete", outcomes[0].error)

    # -- small helpers -------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"redis tier {self.name} was not launched")
