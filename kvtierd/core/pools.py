"""The table of pools and the global shared-memory budget.

A pool is created by the first OpenSession that names it and lives until the
daemon shuts down (blocks outlive the engines that stored them). The budget
counts every region's bytes; a pool that does not fit is refused with the numbers.

Creating a region (ftruncate, posix_fallocate, pre-faulting: seconds per GiB)
and removing one (munmap, unlink) run on a worker thread, never on the event
loop: the daemon keeps answering every other client meanwhile. A pool being
created is in ``_creating`` (its bytes already charged to the budget); every
OpenSession of it waits for that one creation.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtierd.config import LimitsConfig, MemoryConfig
from kvtierd.contract import DEFAULT_EVICTION_POLICY, PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.errors import FailedPrecondition, PoolNotFound, ResourceExhausted
from kvtierd.kvevents.service import KvEventsService
from kvtierd.primary.footprint import pool_heap_bytes
from kvtierd.primary.region import InsufficientSpaceError, Region, RegionError, region_file_name
from kvtierd.primary.warm.adoption import Adoption, ColdStart, adopt_region
from kvtierd.primary.warm.clock import Instant, current_boot_id
from kvtierd.primary.warm.journal import JournalWriter
from kvtierd.primary.warm.journalfiles import planted, remove_journal, remove_temporaries
from kvtierd.primary.warm.journalformat import JournalHeader, journal_path
from kvtierd.security.principals import Principal
from kvtierd.tiering.admission import DEFAULT_POLICY, TierAdmission, make_policy
from kvtierd.tiers.base import SecondaryTier
from kvtierd.tiers.configured import ConfiguredTier, PoolBinding, TierStartError
from kvtierd.util.offloop import off_loop
from kvtierd.util.units import format_bytes

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class PoolTable:
    """Owns every Pool. Event-loop only."""

    def __init__(
        self,
        memory: MemoryConfig,
        limits: LimitsConfig,
        gid: int | None,
        tiers: Sequence[ConfiguredTier] = (),
        *,
        region_mode: int = 0o660,
        warm_fence_seconds: float = 20.0,
        region_access: str = "",
    ) -> None:
        """``warm_fence_seconds``: how long a client may touch its rows after its last
        lease was granted (the daemon passes lease + write_quarantine): journaled,
        and how long a version-2 journal's rows are held. ``region_access``: who
        may map the regions (the daemon passes :func:`region_access_text`),
        journaled: a pool whose access changed starts cold."""
        self._memory = memory
        self._limits = limits
        self._gid = gid
        # of every region file: 0660 (the socket group maps by path) or, with
        # principals, 0600 (other uids map by descriptor only: security.region_access)
        self._region_mode = region_mode
        self._tiers = tuple(tiers)  # every pool gets one of each, in this order
        self._warm_fence_seconds = warm_fence_seconds
        self._region_access = region_access
        # given to each new pool's Tiering (metrics); set by the daemon
        self.observe_job: Callable[[str, str, bool, float], None] | None = None
        # the KV-event publisher (kvtierd.kvevents), set by the daemon when configured
        self.kv_events: KvEventsService | None = None
        self._pools: dict[str, Pool] = {}
        self._creating: dict[str, asyncio.Future[Pool]] = {}  # name -> its creation
        self._creating_sizes: dict[str, int] = {}  # name -> region bytes; same keys as _creating
        # (pool name, region bytes, bytes of every other pool by name) -> raises
        # ResourceExhausted; per-principal memory quotas, set by the daemon
        self.admit_pool: Callable[[str, int, Mapping[str, int]], None] | None = None
        # Invariants: _region_bytes == sum(p.region.size for p in _pools.values());
        # _creating_bytes == the sizes of the pools in _creating.
        self._region_bytes = 0
        self._creating_bytes = 0

    @property
    def budget_bytes(self) -> int:
        return self._memory.budget

    @property
    def used_bytes(self) -> int:
        """Bytes of the budget taken: regions, and regions being created."""
        return self._region_bytes + self._creating_bytes

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    def get(self, name: str) -> Pool:
        pool = self._pools.get(name)
        if pool is None:
            raise PoolNotFound(f"pool {name!r} does not exist; known pools: {self.names()}")
        return pool

    def names(self) -> str:
        return ", ".join(sorted(self._pools)) or "(none)"

    async def open(self, requested: PoolSpec) -> Pool:
        """Returns the pool named by ``requested``, creating it if needed.

        ``requested.num_blocks`` 0 means the default; ``eviction_policy`` "" means lru.
        A pool being created by another call is waited for (then checked alike).
        """
        existing = self._pools.get(requested.name)
        if existing is not None:
            _check_compatible(existing.spec, requested)
            return existing
        creating = self._creating.get(requested.name)
        if creating is None:
            spec = PoolSpec(
                name=requested.name,
                block_bytes=requested.block_bytes,
                num_blocks=requested.num_blocks or self._memory.default_pool_blocks,
                layout=requested.layout,
                eviction_policy=requested.eviction_policy or DEFAULT_EVICTION_POLICY,
            )
            self._check_room(spec)
            creating = asyncio.ensure_future(self._create(spec))
            self._creating[spec.name] = creating
            self._creating_sizes[spec.name] = spec.num_blocks * spec.block_bytes
            self._creating_bytes += spec.num_blocks * spec.block_bytes
            # a failed or cancelled creation leaves _creating here
            creating.add_done_callback(lambda _: self._creation_ended(spec))
        # shield: a caller that gives up (deadline, cancelled) does not stop the
        # creation the other callers wait for
        pool = await asyncio.shield(creating)
        _check_compatible(pool.spec, requested)
        return pool

    def _creation_ended(self, spec: PoolSpec) -> None:
        """``spec``'s creation is over (idempotent): its bytes leave ``_creating_bytes``."""
        if self._creating.pop(spec.name, None) is not None:
            del self._creating_sizes[spec.name]
            self._creating_bytes -= spec.num_blocks * spec.block_bytes

    def _check_room(self, spec: PoolSpec) -> None:
        pools = len(self._pools) + len(self._creating)
        if pools >= self._limits.max_pools:
            raise ResourceExhausted(
                f"pool {spec.name!r}: {pools} pools exist, the limit is "
                f"{self._limits.max_pools} (limits.max_pools)"
            )
        size = spec.num_blocks * spec.block_bytes
        used = self.used_bytes
        free = self._memory.budget - used
        if size > free:
            raise ResourceExhausted(
                f"pool {spec.name!r} needs {format_bytes(size)} ({spec.num_blocks} blocks x "
                f"{spec.block_bytes} bytes) but only {format_bytes(free)} of the "
                f"{format_bytes(self._memory.budget)} memory budget is free "
                f"({format_bytes(used)} used by {pools} pools); ask for "
                "fewer blocks or raise memory.budget"
            )
        if self.admit_pool is not None:
            self.admit_pool(spec.name, size, self.charged_bytes())

    def charged_bytes(self) -> dict[str, int]:
        """Budget bytes of each pool, created or being created, by name."""
        charged = {name: pool.region.size for name, pool in self._pools.items()}
        charged.update(self._creating_sizes)
        return charged

    async def _create(self, spec: PoolSpec) -> Pool:
        """Adopts the region a previous daemon left (``memory.warm_restart``) or
        creates one, on a worker thread; then the pool on the loop."""
        adoption, stale_reason = None, ""
        if self._memory.warm_restart:
            adoption, stale_reason = await off_loop(self._try_adopt, spec)
        if adoption is not None:
            region = adoption.region
        else:
            region = await self._create_region(spec, stale_reason)
        pool = Pool(spec, region, self._limits)
        pool.tiering.observe_job = self.observe_job
        try:
            if self._memory.warm_restart:
                await self._start_journal(pool, adoption)
            await self._attach_tiers(pool)
        except BaseException as exc:  # refused by a tier, or cancelled at shutdown
            if not isinstance(exc, FailedPrecondition):  # that one closed its tiers
                pool.close_tiers()
            # nothing was served: an adopted region keeps what it had for the next
            # try; a new one goes
            region.keep_file = adoption is not None
            await off_loop(pool.close_region)
            raise
        # one step: from "being created" to "created", so the budget never counts
        # the region twice (a done callback would run a loop turn later)
        self._pools[spec.name] = pool
        self._region_bytes += region.size
        if self.kv_events is not None and self.kv_events.publishes(spec.name):
            pool.kv_events = self.kv_events
            self.kv_events.attach(pool)
        self._creation_ended(spec)
        log.info(
            "pool %s created: %d blocks x %d bytes (%s), policy %s, layout %r, region %s "
            "(allocated in %.2fs, prefaulted in %.2fs, off the event loop); its keys and "
            "records take at most %s of the daemon's heap",
            spec.name, spec.num_blocks, spec.block_bytes, format_bytes(region.size),
            spec.eviction_policy, spec.layout, region.path, region.allocate_seconds,
            region.prefault_seconds, format_bytes(self.heap_bound(spec)),
        )  # fmt: skip
        return pool

    def heap_bound(self, spec: PoolSpec) -> int:
        """What a pool of ``spec`` may take of the daemon's heap: its event log and
        removal history at their byte limits, its block table full of 256-byte
        keys and its journal's rows (:mod:`kvtierd.primary.footprint`)."""
        return pool_heap_bytes(
            spec.num_blocks,
            spec.eviction_policy,
            events_bytes=self._limits.events_retained_bytes,
            removals_bytes=self._limits.removals_retained_bytes,
            warm_restart=self._memory.warm_restart,
        )

    async def _create_region(self, spec: PoolSpec, stale_reason: str) -> Region:
        try:
            region = await off_loop(
                Region.create,
                self._memory.shm_dir,
                spec.name,
                spec.num_blocks,
                spec.block_bytes,
                mode=self._region_mode,
                gid=self._gid,
                prefault=self._memory.prefault,
                stale_reason=stale_reason,
            )
        except InsufficientSpaceError as exc:
            raise ResourceExhausted(f"pool {spec.name!r}: {exc}") from None
        except RegionError as exc:
            raise FailedPrecondition(f"pool {spec.name!r}: {exc}") from None
        if not self._memory.warm_restart:
            await off_loop(remove_journal, journal_path(region.path))
        return region

    def _try_adopt(self, spec: PoolSpec) -> tuple[Adoption | None, str]:
        """(the adoption, "") or (None, why the pool starts cold; "" for a first
        start: no region file). Blocking: a worker thread."""
        region_path = os.path.join(self._memory.shm_dir, region_file_name(spec.name))
        journal = journal_path(region_path)
        if not os.path.lexists(region_path):
            remove_journal(journal)
            return None, ""
        wanted = JournalHeader(
            spec.name, spec.block_bytes, spec.num_blocks, spec.layout, 0, 0,
            self._memory.warm_restart_checksum_bytes, access=self._region_access,
        )  # fmt: skip
        try:
            adoption = adopt_region(
                region_path, journal, wanted, prefault=self._memory.prefault,
                fence_seconds=self._warm_fence_seconds,
            )  # fmt: skip
        except FileNotFoundError:
            return None, f"pool {spec.name!r} has no warm-restart journal"
        except (ColdStart, OSError) as exc:
            return None, f"pool {spec.name!r} is not adopted: {exc}"
        try:  # today's access settings, as a new region would get them
            os.fchmod(adoption.region.fileno(), self._region_mode)
            if self._gid is not None:
                os.fchown(adoption.region.fileno(), -1, self._gid)
        except OSError as exc:
            adoption.region.close()  # unlinks it: the fresh region's creation says nothing
            log.warning("starting cold: pool %r is not adopted: %s", spec.name, exc)
            return None, ""
        return adoption, ""

    async def _start_journal(self, pool: Pool, adoption: Adoption | None) -> None:
        """Takes the adopted blocks into the manager and starts the pool's journal
        (a fresh file holding them: written off the loop)."""
        region = pool.region
        region.keep_file = True
        st_dev, st_ino = region.identity()
        spec = pool.spec
        # the old daemon's writers trust the lease it granted: the longer fence (and
        # recorded as such, should this daemon die while they may still copy)
        fence = self._warm_fence_seconds
        if adoption is not None:
            fence = max(fence, adoption.fence_seconds)
        header = JournalHeader(
            spec.name, spec.block_bytes, spec.num_blocks, spec.layout, st_dev, st_ino,
            self._memory.warm_restart_checksum_bytes, fence, self._region_access,
            current_boot_id(),
        )  # fmt: skip
        inherited = _adopt(pool, adoption) if adoption is not None else _Inherited([], [], None)
        journal = await off_loop(
            _start_journal_file, journal_path(region.path), header, region, inherited,
            self._memory.warm_restart_max_lag,
        )  # fmt: skip
        if isinstance(journal, str):
            pool.warm_restart_off = True
            region.keep_file = False  # no journal vouches for it: the next start is cold
            log.error("pool %r: warm restart is off for this pool (its next start is cold): %s",
                      spec.name, journal)  # fmt: skip
            return
        pool.attach_journal(journal)

    async def _attach_tiers(self, pool: Pool) -> None:
        """Gives the new pool one tier per configured tier (each one's file work,
        root checks, ``pool.json`` and the O_DIRECT probe, off the loop); on failure
        stops the tiers attached so far and refuses the pool with the tier's message."""
        loop = asyncio.get_running_loop()
        spec = pool.spec
        binding = PoolBinding(
            spec.name,
            spec.block_bytes,
            spec.layout,
            pool.region.buffer(),
            region_file=(pool.region.path, *pool.region.identity()),
            region_rows=pool.region.safe_rows(),
        )
        try:
            for configured in self._tiers:
                tier = configured.create(binding, pool.tiering.on_done, loop)
                await off_loop(tier.prepare)
                tier.launch()
                pool.tiering.attach(
                    tier,
                    _admission(configured, tier, spec.block_bytes),
                    write_budget=configured.write_budget,
                )
        except (TierStartError, OSError) as exc:
            pool.close_tiers()
            raise FailedPrecondition(f"pool {spec.name!r}: {exc}") from None

    async def drain(self) -> None:
        """Waits until every pool's tier jobs submitted so far are reported."""
        for pool in self._pools.values():
            await pool.tiering.drain()

    async def close_all(self, wait_for_creations: float) -> None:
        """Closes every pool (their region files are unlinked, on a worker thread),
        after the creations in flight ended or ``wait_for_creations`` seconds
        passed. Shutdown only."""
        if self._creating:
            _done, pending = await asyncio.wait(
                list(self._creating.values()), timeout=wait_for_creations
            )
            for creation in pending:
                log.warning(
                    "a pool creation is still running after %gs; shutting down without it "
                    "(a region file it leaves is removed as stale at the next start)",
                    wait_for_creations,
                )
                creation.cancel()
        for pool in self._pools.values():
            try:
                pool.close_tiers()
                # a graceful stop: the rows a client may still touch, journaled
                await off_loop(pool.close_region, pool.stop_holds(time.monotonic()))
            except Exception:  # keep closing the others; report each
                log.exception("pool %s: closing its region failed", pool.spec.name)
        self._pools.clear()
        self._region_bytes = 0


@dataclass(frozen=True, slots=True)
class _Inherited:
    """What a new journal starts with: the adopted blocks (row, key, checksum), the
    held rows that hold no block, and the end of the longest hold (should this
    daemon crash before it: the next one holds every row it names until then)."""

    ready: list[tuple[int, bytes, int]]
    freed: list[int]
    horizon: Instant | None


def _adopt(pool: Pool, adoption: Adoption) -> _Inherited:
    """Takes the adopted blocks into the pool's manager, holding the rows the old
    daemon's clients may still touch for as long as they may; logs the adoption."""
    now = time.monotonic()
    holds = adoption.holds.seconds
    pool.manager.adopt(
        [(key, row) for key, row, _ in adoption.blocks],
        {row: now + seconds for row, seconds in holds.items()},
    )
    pool.adopted_blocks = len(adoption.blocks)
    pool.dropped_blocks = adoption.dropped
    _log_adoption(pool, adoption)
    adopted = {row for _, row, _ in adoption.blocks}
    longest = adoption.holds.longest
    return _Inherited(
        [(row, key, checksum) for key, row, checksum in adoption.blocks],
        sorted(row for row in holds if row not in adopted),
        Instant.in_seconds(longest) if longest > 0 else None,
    )


def _start_journal_file(
    path: str,
    header: JournalHeader,
    region: Region,
    inherited: _Inherited,
    lag_bound: float,
) -> JournalWriter | str:
    """The pool's journal, started (a fresh file holding what it ``inherited``),
    or why it cannot be: something else at its path (another user's file, planted
    in a shared shm_dir), or a write that failed. Blocking."""
    taken = planted(path)
    if taken is not None:
        return taken
    remove_temporaries(path)  # a daemon killed while it rewrote the journal leaves one
    journal = JournalWriter(
        path, header, region.buffer(), region_fd=region.fileno(), lag_bound=lag_bound
    )
    try:
        journal.start(inherited.ready, inherited.freed, inherited.horizon)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            fix = planted(path) or "give memory.shm_dir a directory kvtierd's user may write"
        else:
            fix = "free space in memory.shm_dir, or set memory.warm_restart = false"
        return f"cannot write its journal {path}: {exc.strerror or exc}; {fix}"
    return journal


def _log_adoption(pool: Pool, adoption: Adoption) -> None:
    """The adoption's one line: a WARNING when blocks failed their checksum or the
    journal is damaged in the middle (not just a last write cut short)."""
    damaged = adoption.damaged_at is not None
    held = adoption.holds.seconds
    pinned = sum(1 for _, row, _ in adoption.blocks if row in held)
    log.log(
        logging.WARNING if adoption.dropped or damaged else logging.INFO,
        "pool %s: warm restart adopted %d ready blocks of region %s in %.3fs "
        "(%d dropped: checksum mismatch; the old daemon's clients: %s, so %d adopted "
        "blocks stay pinned and %d other rows out of use until then; %d %s)",
        pool.spec.name, len(adoption.blocks), pool.region.path, adoption.seconds,
        adoption.dropped, adoption.holds.why, pinned, len(held) - pinned, adoption.torn_bytes,
        f"journal bytes ignored from byte {adoption.damaged_at}, where the journal is "
        "damaged in the middle (not a last write cut short by a crash: modified or "
        "corrupted while the daemon was down)" if damaged else "torn journal bytes ignored",
    )  # fmt: skip


def _check_compatible(existing: PoolSpec, requested: PoolSpec) -> None:
    """A joiner must agree on what the bytes mean: block size and layout; and on
    the policy if it names one. A different num_blocks is not an error: the pool's
    creator sized it and the response carries the real size."""
    if requested.block_bytes != existing.block_bytes:
        raise FailedPrecondition(
            f"pool {existing.name!r} exists with block_bytes {existing.block_bytes}; this "
            f"session asked for {requested.block_bytes}. Use another pool name for another "
            "block size"
        )
    if requested.layout != existing.layout:
        raise FailedPrecondition(
            f"pool {existing.name!r} exists with layout {existing.layout!r}; this session "
            f"asked for layout {requested.layout!r}. Blocks of different layouts never share "
            "a pool: use another pool name"
        )
    if requested.eviction_policy and requested.eviction_policy != existing.eviction_policy:
        raise FailedPrecondition(
            f"pool {existing.name!r} exists with eviction_policy "
            f"{existing.eviction_policy!r}; this session asked for "
            f"{requested.eviction_policy!r}"
        )


def region_access_text(mode: int, gid: int | None, principals: Sequence[Principal]) -> str:
    """Who may map a region, as a short text the journal records: the region file's
    mode and group, and a digest of the principals (their names, uids, gids and
    pool patterns: any change may take a pool away from someone)."""
    described = sorted(
        (p.name, sorted(p.pools), sorted(p.uids), sorted(p.gids)) for p in principals
    )
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    return f"mode {mode:o}, gid {gid}, principals {digest[:16]}"


def _admission(configured: ConfiguredTier, tier: SecondaryTier, block_bytes: int) -> TierAdmission:
    """The admission of a pool's tier: the configured tier's ``admission`` option (a
    tier type without one writes every block), its sketch sized by the tier's capacity."""
    name = getattr(configured.settings, "admission", DEFAULT_POLICY)  # a plug-in's type may lack it
    capacity_blocks = tier.statistics().capacity_bytes // max(1, block_bytes)
    return TierAdmission(make_policy(name, tier.victim, capacity_blocks), block_bytes)
