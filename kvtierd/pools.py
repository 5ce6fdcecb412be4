"""The table of pools and the global shared-memory budget.

A pool is created by the first OpenSession that names it and lives until the
daemon shuts down (blocks outlive the engines that stored them). The budget
counts every region's bytes; a pool that does not fit is refused with the numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence

from kvtierd.config import LimitsConfig, MemoryConfig
from kvtierd.errors import FailedPrecondition, PoolNotFound, ResourceExhausted
from kvtierd.pool import Pool, PoolSpec
from kvtierd.region import InsufficientSpaceError, Region, RegionError
from kvtierd.tiers.configured import ConfiguredFsTier
from kvtierd.tiers.fs import FsTierError
from kvtierd.units import format_bytes

log = logging.getLogger("kvtierd.pools")


class PoolTable:
    """Owns every Pool. Event-loop only."""

    def __init__(
        self,
        memory: MemoryConfig,
        limits: LimitsConfig,
        gid: int | None,
        tiers: Sequence[ConfiguredFsTier] = (),
    ) -> None:
        self._memory = memory
        self._limits = limits
        self._gid = gid
        self._tiers = tuple(tiers)  # every pool gets one of each, in this order
        # given to each new pool's Tiering (metrics); set by the daemon
        self.observe_job: Callable[[str, str, bool, float], None] | None = None
        self._pools: dict[str, Pool] = {}
        # Invariant: used_bytes == sum(p.region.size for p in self._pools.values())
        self.used_bytes = 0

    @property
    def budget_bytes(self) -> int:
        return self._memory.budget

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

    def open(self, requested: PoolSpec) -> Pool:
        """Returns the pool named by ``requested``, creating it if needed.

        ``requested.num_blocks`` 0 means the default; ``eviction_policy`` "" means lru.
        """
        existing = self._pools.get(requested.name)
        if existing is not None:
            _check_compatible(existing.spec, requested)
            return existing
        spec = PoolSpec(
            name=requested.name,
            block_bytes=requested.block_bytes,
            num_blocks=requested.num_blocks or self._memory.default_pool_blocks,
            layout=requested.layout,
            eviction_policy=requested.eviction_policy or "lru",
        )
        return self._create(spec)

    def _create(self, spec: PoolSpec) -> Pool:
        if len(self._pools) >= self._limits.max_pools:
            raise ResourceExhausted(
                f"pool {spec.name!r}: {len(self._pools)} pools exist, the limit is "
                f"{self._limits.max_pools} (limits.max_pools)"
            )
        size = spec.num_blocks * spec.block_bytes
        free = self._memory.budget - self.used_bytes
        if size > free:
            raise ResourceExhausted(
                f"pool {spec.name!r} needs {format_bytes(size)} ({spec.num_blocks} blocks x "
                f"{spec.block_bytes} bytes) but only {format_bytes(free)} of the "
                f"{format_bytes(self._memory.budget)} memory budget is free "
                f"({format_bytes(self.used_bytes)} used by {len(self._pools)} pools); ask for "
                "fewer blocks or raise memory.budget"
            )
        try:
            region = Region.create(
                self._memory.shm_dir,
                spec.name,
                spec.num_blocks,
                spec.block_bytes,
                gid=self._gid,
                prefault=self._memory.prefault,
            )
        except InsufficientSpaceError as exc:
            raise ResourceExhausted(f"pool {spec.name!r}: {exc}") from None
        except RegionError as exc:
            raise FailedPrecondition(f"pool {spec.name!r}: {exc}") from None
        pool = Pool(spec, region, self._limits)
        pool.tiering.observe_job = self.observe_job
        self._attach_tiers(pool)
        self._pools[spec.name] = pool
        self.used_bytes += region.size
        log.info(
            "pool %s created: %d blocks x %d bytes (%s), policy %s, layout %r, region %s "
            "(prefaulted in %.2fs)",
            spec.name, spec.num_blocks, spec.block_bytes, format_bytes(region.size),
            spec.eviction_policy, spec.layout, region.path, region.prefault_seconds,
        )  # fmt: skip
        return pool

    def _attach_tiers(self, pool: Pool) -> None:
        """Gives the new pool one tier per configured tier; on failure closes the
        pool (region included) and refuses it with the tier's message."""
        loop = asyncio.get_running_loop()
        spec = pool.spec
        try:
            for configured in self._tiers:
                pool.tiering.attach(
                    configured.attach(
                        spec.name,
                        spec.block_bytes,
                        spec.layout,
                        pool.region.buffer(),
                        pool.tiering.on_done,
                        loop,
                        region_file=(pool.region.path, *pool.region.identity()),
                    )
                )
        except (FsTierError, OSError) as exc:
            pool.close()
            raise FailedPrecondition(f"pool {spec.name!r}: {exc}") from None

    async def drain(self) -> None:
        """Waits until every pool's tier jobs submitted so far are reported."""
        for pool in self._pools.values():
            await pool.tiering.drain()

    def close_all(self) -> None:
        """Closes every pool (their region files are unlinked). Shutdown only."""
        for pool in self._pools.values():
            try:
                pool.close()
            except Exception:  # keep closing the others; report each
                log.exception("pool %s: closing its region failed", pool.spec.name)
        self._pools.clear()
        self.used_bytes = 0


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
