"""The redis tier's own behaviour beyond the contract, against a real redis-server:
lookups of keys it did not store (MISS at once, one batched EXISTS, then HIT), the
ttl, and a value of another pool under its key."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from daemon_harness import eventually_async
from redis_harness import RedisServer

from kvtierd.contract import LookupResult
from kvtierd.tiers.base import JobResult, TierJob
from kvtierd.tiers.iopool import IoPool
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.settings import RedisTierSettings
from kvtierd.tiers.redis.tier import RedisTier

HIT, MISS = LookupResult.HIT, LookupResult.MISS
BLOCK = 512
ROWS = 8


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


class Rig:
    """Tiers of one key prefix over one client, each with its own region and threads."""

    def __init__(self, client: redis.Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        url = "redis://{host}:{port}".format(**client.connection_pool.connection_kwargs)
        self.link = RedisLink(RedisTierSettings(urls=(url,), cluster="false"), None)
        self.loop = loop
        self.prefix = f"unit-{uuid.uuid4().hex[:12]}"
        self.results: dict[int, asyncio.Future[JobResult]] = {}
        self.pools: list[IoPool] = []
        self.job_ids = iter(range(1, 1 << 30))

    def tier(self, pool: str = "p", **options: float) -> tuple[RedisTier, memoryview]:
        io = IoPool(self.loop, read_threads=1, write_threads=1, name="unit")
        self.pools.append(io)
        region = memoryview(bytearray(ROWS * BLOCK))
        tier = RedisTier(
            "redis", self.link, key_prefix=self.prefix, pool_name=pool, block_bytes=BLOCK,
            layout="L", region_buffer=region, capacity_bytes=0, on_done=self.on_done,
            loop=self.loop, io_pool=io, **options,
        )  # fmt: skip
        tier.start()
        return tier, region

    def on_done(self, result: JobResult) -> None:
        self.results[result.job_id].set_result(result)

    async def run(self, tier: RedisTier, keys: list[bytes], rows: list[int], load: bool):
        job = TierJob(next(self.job_ids), tuple(keys), tuple(rows), load)
        self.results[job.job_id] = self.loop.create_future()
        if load:
            tier.submit_load(job)
        else:
            assert tier.submit_store(job)
        return await asyncio.wait_for(self.results[job.job_id], 10)

    async def close(self) -> None:
        for io in self.pools:
            await self.loop.run_in_executor(None, io.shutdown)
        self.link.close()
        keys = list(self.client.scan_iter(match=f"{self.prefix}:*"))
        if keys:
            self.client.delete(*keys)


async def eventually_hit(tier: RedisTier, keys: list[bytes]) -> None:
    """Lookups until every key HITs (the probe a MISS started answered, on the loop)."""
    await eventually_async(lambda: tier.lookup(keys) == [HIT] * len(keys), 10, "every key HIT")


def test_keys_another_tier_stored_miss_at_once_then_hit_after_one_probe(client) -> None:
    async def scenario() -> None:
        rig = Rig(client, asyncio.get_running_loop())
        try:
            writer, rows = rig.tier()
            reader, into = rig.tier()
            keys = [b"k%d" % i for i in range(4)]
            rows[: 4 * BLOCK] = os.urandom(4 * BLOCK)
            assert (await rig.run(writer, keys, [0, 1, 2, 3], load=False)).success
            assert reader.lookup(keys) == [MISS] * 4  # unknown: no wait, a probe starts
            await eventually_hit(reader, keys)
            assert reader.contains(keys[0]) and reader.statistics().blocks == 0  # not its own
            assert (await rig.run(reader, keys, [4, 5, 6, 7], load=True)).success
            assert bytes(into[4 * BLOCK : 8 * BLOCK]) == bytes(rows[: 4 * BLOCK])
        finally:
            await rig.close()

    asyncio.run(scenario())


def test_values_expire_with_the_ttl_and_the_tier_forgets_them(client) -> None:
    async def scenario() -> None:
        rig = Rig(client, asyncio.get_running_loop())
        try:
            tier, rows = rig.tier(ttl_s=0.3)
            rows[:BLOCK] = os.urandom(BLOCK)
            stored = time.monotonic()
            assert (await rig.run(tier, [b"t"], [0], load=False)).success
            assert 0 < client.pttl(tier.key_space + b"t") <= 300
            assert tier.lookup([b"t"]) == [HIT]
            # the ttl is real time (the server's): the tier forgets the value then, not sooner
            await eventually_async(lambda: tier.lookup([b"t"]) == [MISS], 10, "t forgotten")
            assert time.monotonic() - stored >= 0.3
            assert tier.take_removed() == [b"t"]
        finally:
            await rig.close()

    asyncio.run(scenario())


def test_a_value_of_another_pool_under_the_key_is_a_miss_and_deleted(client) -> None:
    async def scenario() -> None:
        rig = Rig(client, asyncio.get_running_loop())
        try:
            ours, rows = rig.tier("a")
            theirs, _ = rig.tier("b")
            rows[:BLOCK] = os.urandom(BLOCK)
            assert (await rig.run(ours, [b"x"], [0], load=False)).success
            client.copy(ours.key_space + b"x", theirs.key_space + b"x")  # header: pool a
            await eventually_hit(theirs, [b"x"])
            loaded = await rig.run(theirs, [b"x"], [1], load=True)
            assert not loaded.success and theirs.statistics().checksum_failures == 1
            assert client.exists(theirs.key_space + b"x") == 0
            assert client.exists(ours.key_space + b"x") == 1
        finally:
            await rig.close()

    asyncio.run(scenario())
