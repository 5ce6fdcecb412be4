"""Every secondary-tier implementation runs the tier contract (``tier_contract.py``).

One kit per implementation: the fs tier with its block I/O on its threads and in
I/O worker processes (as ``ConfiguredFsTier`` builds it for ``io_processes = 0``
and ``> 0``), the redis tier against a real redis-server (skipped, saying why,
without one), and the in-memory reference tier. A new tier joins by adding a kit
to :data:`KITS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from tier_contract import CHECKS, DAMAGE_CHECKS, ROWS, Check, TierKit, run_check

from kvtierd.contract import BlockKey
from kvtierd.primary.region import Region
from kvtierd.tiers import blockformat
from kvtierd.tiers.base import JobCallback, SecondaryTier
from kvtierd.tiers.configured import PoolBinding
from kvtierd.tiers.fs import FsTier, fsformat
from kvtierd.tiers.fs.blockio import IoWorkers
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.fs.tier import SharedParts
from kvtierd.tiers.iopool import IoPool
from kvtierd.tiers.memory import MemoryTier
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.settings import RedisTierSettings
from kvtierd.tiers.redis.tier import RedisTier

STARTED_TIMEOUT_S = 30.0


class FsKit(TierKit):
    """FsTiers under one root, one per pool, built as ``ConfiguredFsTier.create``
    builds them: I/O threads given to the tier (here one pool of threads per
    tier, so a stall holds one tier only), worker processes shared by all."""

    block_bytes = 2 * 4096  # a multiple of the page size, as the fs tier requires
    can_damage = True
    read_threads = write_threads = 2

    def __init__(self, root: Path, *, io_processes: int, shared: bool = False) -> None:
        super().__init__(root)
        self.shared = shared  # shared = true: the shared-root thread runs beside the jobs
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.shm_dir = tempfile.mkdtemp(prefix="kvtierd-contract-", dir=base)
        threads = self.read_threads + self.write_threads
        self.workers = IoWorkers(io_processes, channels=threads) if io_processes else None
        self.regions: dict[str, Region] = {}
        self.io_pools: dict[int, IoPool] = {}  # id(tier) -> its I/O threads

    def region(self, pool: str) -> memoryview:
        region = Region.create(self.shm_dir, pool, ROWS, self.block_bytes, prefault=False)
        self.regions[pool] = region
        return region.buffer()

    def create(
        self,
        pool: str,
        region: memoryview,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        capacity_blocks: int,
        max_queue_jobs: int,
    ) -> SecondaryTier:
        io = IoPool(
            loop,
            read_threads=self.read_threads,
            write_threads=self.write_threads,
            max_queue_jobs=max_queue_jobs,
            name=f"contract-{pool}",
        )
        owned = self.regions[pool]
        settings = FsTierSettings(
            root=str(self.root),
            capacity=capacity_blocks * (blockformat.HEADER_SIZE + self.block_bytes),
            shared=self.shared,
            shared_negative_ttl=0.05,
            shared_rescan_interval=0.05,  # rescans race every check's jobs
        )
        region_file = (owned.path, *owned.identity()) if self.workers else None
        binding = PoolBinding(pool, self.block_bytes, {"layout": "contract"}, region, region_file)
        tier = FsTier(
            "fs", settings, binding, on_done, loop,
            parts=SharedParts(io_pool=io, workers=self.workers),
        )  # fmt: skip
        self.io_pools[id(tier)] = io
        return tier

    @contextlib.asynccontextmanager
    async def stall(self, tier: SecondaryTier) -> AsyncIterator[None]:
        """Occupies every thread of the tier's I/O pool until the block ends."""
        io = self.io_pools[id(tier)]
        threads = self.read_threads + self.write_threads
        gate, started = threading.Event(), threading.Semaphore(0)

        def blocker() -> None:
            started.release()
            gate.wait()

        def all_started() -> bool:
            return all(started.acquire(timeout=STARTED_TIMEOUT_S) for _ in range(threads))

        io.submit_read([blocker] * threads, lambda outcomes: None)
        try:
            assert await asyncio.get_running_loop().run_in_executor(None, all_started)
            yield
        finally:
            gate.set()

    async def stop(self, tier: SecondaryTier) -> None:
        """Fails what is queued and joins the threads (blocks: off the loop)."""
        io = self.io_pools.pop(id(tier))
        await asyncio.get_running_loop().run_in_executor(None, io.shutdown)

    def damage(self, tier: SecondaryTier, key: BlockKey) -> None:
        """Flips the first payload byte of the key's block file."""
        assert isinstance(tier, FsTier)
        path = Path(tier.pool_dir) / fsformat.block_rel_path(key)
        with open(path, "r+b") as f:
            f.seek(blockformat.HEADER_SIZE)
            byte = f.read(1)
            f.seek(blockformat.HEADER_SIZE)
            f.write(bytes([byte[0] ^ 0xFF]))

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        for region in self.regions.values():
            region.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def _stall_io(io: IoPool, threads: int) -> AsyncIterator[None]:
    """Occupies every thread of ``io`` until the block ends."""
    gate, started = threading.Event(), threading.Semaphore(0)

    def blocker() -> None:
        started.release()
        gate.wait()

    def all_started() -> bool:
        return all(started.acquire(timeout=STARTED_TIMEOUT_S) for _ in range(threads))

    io.submit_read([blocker] * threads, lambda outcomes: None)
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, all_started)
        yield
    finally:
        gate.set()


class RedisKit(TierKit):
    """RedisTiers on one real redis-server (the session's), or on the session's
    3-master Redis Cluster (``cluster``), under a key prefix of this kit's own;
    one link shared by the kit's tiers and one I/O pool per tier, as a
    configured tier builds them."""

    block_bytes = 1024
    can_damage = True
    needs_redis = True
    threads = 2

    def __init__(self, root: Path, *, urls: tuple[str, ...], cluster: bool = False) -> None:
        super().__init__(root)
        self.cluster = cluster
        mode = "true" if cluster else "false"
        self.link = RedisLink(RedisTierSettings(urls=urls, cluster=mode, timeout=5.0), None)
        self.client: redis.Redis | RedisCluster = (
            RedisCluster.from_url(urls[0], socket_timeout=5)
            if cluster
            else redis.Redis.from_url(urls[0], socket_timeout=5)
        )
        self.key_prefix = f"contract-{uuid.uuid4().hex[:12]}"
        self.io_pools: dict[int, IoPool] = {}

    def region(self, pool: str) -> memoryview:
        return memoryview(bytearray(ROWS * self.block_bytes))

    def create(
        self,
        pool: str,
        region: memoryview,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        capacity_blocks: int,
        max_queue_jobs: int,
    ) -> SecondaryTier:
        io = IoPool(
            loop,
            read_threads=1,
            write_threads=1,
            max_queue_jobs=max_queue_jobs,
            name=f"contract-{pool}",
        )
        tier = RedisTier(
            "redis",
            self.link,
            key_prefix=self.key_prefix,
            pool_name=pool,
            block_bytes=self.block_bytes,
            layout={"layout": "contract"},
            region_buffer=region,
            capacity_bytes=capacity_blocks * (blockformat.HEADER_SIZE + self.block_bytes),
            on_done=on_done,
            loop=loop,
            io_pool=io,
        )
        self.io_pools[id(tier)] = io
        return tier

    @contextlib.asynccontextmanager
    async def stall(self, tier: SecondaryTier) -> AsyncIterator[None]:
        async with _stall_io(self.io_pools[id(tier)], self.threads):
            yield

    async def stop(self, tier: SecondaryTier) -> None:
        io = self.io_pools.pop(id(tier))
        await asyncio.get_running_loop().run_in_executor(None, io.shutdown)

    def damage(self, tier: SecondaryTier, key: BlockKey) -> None:
        """Flips the first payload byte of the key's value in the server."""
        assert isinstance(tier, RedisTier)
        redis_key = tier.key_space + key
        value = self.client.get(redis_key)
        assert isinstance(value, bytes)
        flipped = bytes([value[blockformat.HEADER_SIZE] ^ 0xFF])
        self.client.setrange(redis_key, blockformat.HEADER_SIZE, flipped)

    def close(self) -> None:
        keys = list(self.client.scan_iter(match=f"{self.key_prefix}:*", count=1000))
        for key in keys:  # one by one: a Cluster refuses a DEL across slots
            self.client.delete(key)
        self.client.close()
        self.link.close()


class MemoryKit(TierKit):
    """The in-memory reference tier; a stall is its pause()."""

    block_bytes = 64

    def region(self, pool: str) -> memoryview:
        return memoryview(bytearray(ROWS * self.block_bytes))

    def create(
        self,
        pool: str,
        region: memoryview,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        capacity_blocks: int,
        max_queue_jobs: int,
    ) -> SecondaryTier:
        capacity = capacity_blocks * self.block_bytes
        return MemoryTier(
            "memory",
            self.block_bytes,
            region,
            capacity,
            on_done,
            loop,
            max_queue_jobs=max_queue_jobs,
        )

    @contextlib.asynccontextmanager
    async def stall(self, tier: SecondaryTier) -> AsyncIterator[None]:
        assert isinstance(tier, MemoryTier)
        tier.pause()
        try:
            yield
        finally:
            tier.resume()


# name -> (kit class, its options); each check gets a fresh kit over its tmp_path
KITS: dict[str, tuple[type[TierKit], dict[str, Any]]] = {
    "fs-threads": (FsKit, {"io_processes": 0}),
    "fs-workers": (FsKit, {"io_processes": 2}),
    "fs-shared": (FsKit, {"io_processes": 0, "shared": True}),
    "redis": (RedisKit, {}),
    "redis-cluster": (RedisKit, {"cluster": True}),
    "memory": (MemoryKit, {}),
}


def _run(kit: str, check: Check, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    cls, options = KITS[kit]  # a fresh kit per check
    if options.get("cluster"):  # the session's cluster (skips without redis-server)
        options = {**options, "urls": request.getfixturevalue("redis_cluster").urls}
    elif getattr(cls, "needs_redis", False):  # the session's server (skips without one)
        options = {**options, "urls": (request.getfixturevalue("redis_server").url,)}
    asyncio.run(run_check(lambda: cls(tmp_path, **options), check))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("kit", KITS)
def test_tier_contract(
    kit: str, check: Check, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _run(kit, check, request, tmp_path)


@pytest.mark.parametrize("check", DAMAGE_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("kit", [name for name, (cls, _) in KITS.items() if cls.can_damage])
def test_tier_contract_with_damage(
    kit: str, check: Check, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _run(kit, check, request, tmp_path)
