"""``fleet_capacity``: the daemons sharing a pool's keys keep them under one bound in the
server together, deleting the least recently used by any of them first -- a block one
daemon stored and another promoted outlives one stored later that nobody read. Real
daemons, real redis-server processes; a bound too small to mean anything stops the
daemon with one line naming the option; members a writer of the server scored in the
future do not make the fleet's new blocks evict themselves; a tier's admission decides
before the fleet's LRU sees a block, so one-shot blocks never push a working set out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from daemon_harness import DaemonProcess, eventually, refused_start
from engine_harness import BLOCK, MISS, PENDING, Engine, block_keys, payload
from redis_harness import (
    VALUE_BYTES,
    WAIT_FOR_REDIS,
    RedisClusterNodes,
    RedisServer,
    promoted,
    redis_config,
    redis_key,
)

from kvtierd.tiers import blockformat

BOUND = 15  # blocks of fleet_capacity = 1 MiB


def _held(server: redis.Redis | redis.RedisCluster, prefix: str, pool: str, keys: list[bytes]):
    return [k for k in keys if server.exists(redis_key(prefix, pool, k))]


def _index(server: redis.Redis | redis.RedisCluster, prefix: str) -> list[bytes]:
    """The fleet's index (one bucket at this bound), least recently used first."""
    names = list(server.scan_iter(match=f"{prefix}:lru:*"))
    return list(server.zrange(names[0], 0, -1)) if len(names) == 1 else []


def _fleet_of_two(
    urls: str | tuple[str, ...],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
    server: redis.Redis | redis.RedisCluster,
) -> tuple[Engine, Engine, list[bytes]]:
    """A writer that stored BOUND blocks, and a reader that promoted the first (the
    oldest): in the server's index it is now the most recent."""
    assert (1 << 20) // VALUE_BYTES == BOUND
    config = redis_config(urls, key_prefix, fleet_capacity="1MiB") + WAIT_FOR_REDIS
    writer = Engine(daemons(config), pool_name, num_blocks=32)
    reader = Engine(daemons(config), pool_name, num_blocks=32)
    stored = block_keys("w", BOUND)
    writer.store(stored)
    writer.settle_cascades()
    # the admission follows the store job off the loop: a touch before it finds nothing
    eventually(lambda: len(_index(server, key_prefix)) == BOUND, 20, "the store's admission")
    assert _held(server, key_prefix, pool_name, stored) == stored  # at the bound: all kept
    promoted(reader, stored[:1])
    eventually(lambda: _index(server, key_prefix)[-1:] == stored[:1], 20, "the promotion's touch")
    return writer, reader, stored


def test_the_fleet_evicts_its_least_recently_used_whoever_stored_it(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
) -> None:
    server = redis.Redis.from_url(redis_server.url)
    writer, reader, stored = _fleet_of_two(redis_server.url, daemons, key_prefix, pool_name, server)
    fresh = block_keys("r", 2)
    reader.store(fresh)  # the reader's blocks push the writer's least recent out
    reader.settle_cascades()
    kept = [stored[0], *stored[3:], *fresh]
    everything = stored + fresh
    eventually(lambda: _held(server, key_prefix, pool_name, everything) == kept, 20,
               "the two least recently used values deleted")  # fmt: skip
    assert reader.tier_stats().evictions == 2
    third = Engine(daemons(redis_config(redis_server.url, key_prefix, fleet_capacity="1MiB")
                           + WAIT_FOR_REDIS), pool_name, num_blocks=32)  # fmt: skip
    assert third.session.lookup(stored[:3]) == [PENDING, MISS, MISS]
    server.close()
    for engine in (writer, reader, third):
        engine.close()


def test_on_a_cluster_the_bound_holds_over_every_master(
    redis_cluster: RedisClusterNodes,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
) -> None:
    server = redis.RedisCluster.from_url(redis_cluster.urls[0])
    writer, reader, stored = _fleet_of_two(
        tuple(redis_cluster.urls), daemons, key_prefix, pool_name, server
    )
    fresh = block_keys("c", 4)
    reader.store(fresh)
    reader.settle_cascades()
    kept = [stored[0], *stored[5:], *fresh]
    eventually(lambda: _held(server, key_prefix, pool_name, stored + fresh) == kept, 20,
               "the four least recently used values deleted")  # fmt: skip
    server.close()
    writer.close()
    reader.close()


def test_a_bound_under_a_mebibyte_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text(redis_config("redis://127.0.0.1:1", "p", fleet_capacity="64KiB"))
    line = refused_start(config, tmp_path)
    assert "tiers[0].fleet_capacity" in line and "at least 1MiB" in line, line


def test_a_bound_beyond_the_largest_size_is_refused_alike_as_an_integer_and_as_text(
    tmp_path: Path,
) -> None:
    """Scenario: fleet_capacity = 2^64 as a TOML integer and as "16EiB": both stop the
    daemon with one line naming the option and the largest size, the same words.
    Before: the integer (2^70 too) was taken as a bound, the text refused."""
    lines = []
    for written in (str(1 << 64), '"16EiB"'):
        config = tmp_path / "kvtierd.toml"
        config.write_text(
            redis_config("redis://127.0.0.1:1", "p") + f"fleet_capacity = {written}\n"
        )
        lines.append(
            refused_start(config, tmp_path).replace(repr(1 << 64), "X").replace("'16EiB'", "X")
        )
    assert "tiers[0].fleet_capacity" in lines[0] and "a size is at most" in lines[0], lines[0]
    assert lines[0] == lines[1], lines


FUTURE_BLOCKS = 32


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_index_members_from_the_future_do_not_make_new_blocks_evict_themselves(
    request: pytest.FixtureRequest,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
    topology: str,
) -> None:
    """Scenario: a writer of the server adds more members than the bound to the fleet's
    index, at score +inf. A daemon then stores 32 blocks and another looks them up:
    32 of 32 HIT (the admission dropped the members from the future before counting).
    Before: each new block was the least recent of the index and evicted itself:
    0 of 32 HIT, and as many for every store after, until someone deleted the index."""
    if topology == "standalone":
        urls: str | tuple[str, ...] = request.getfixturevalue("redis_server").url
        server: redis.Redis | redis.RedisCluster = redis.Redis.from_url(urls)
    else:
        urls = tuple(request.getfixturevalue("redis_cluster").urls)
        server = redis.RedisCluster.from_url(urls[0])
    bound = (4 << 20) // VALUE_BYTES
    fingerprint = blockformat.PoolIdentity(pool_name, BLOCK, "L").fingerprint.hex()
    index = f"{key_prefix}:lru:{fingerprint}:1:0"  # one bucket at this bound
    server.zadd(index, {b"planted-%04d" % i: float("inf") for i in range(bound + 10)})
    config = redis_config(urls, key_prefix, fleet_capacity="4MiB") + WAIT_FOR_REDIS
    writer = Engine(daemons(config), pool_name, num_blocks=FUTURE_BLOCKS)
    reader = Engine(daemons(config), pool_name, num_blocks=FUTURE_BLOCKS)
    keys = block_keys("after", FUTURE_BLOCKS)
    writer.store(keys)
    writer.settle_cascades()

    def admitted() -> bool:  # each key indexed, or evicted (its value deleted)
        indexed = set(server.zrange(index, 0, -1))
        held = _held(server, key_prefix, pool_name, keys)
        return all(key in indexed or key not in held for key in keys)

    eventually(admitted, 20, "the store's admission")
    held = _held(server, key_prefix, pool_name, keys)
    assert len(held) == FUTURE_BLOCKS, f"{len(held)} of {FUTURE_BLOCKS} values kept"
    assert server.zcard(index) == FUTURE_BLOCKS  # the planted members dropped
    promoted(reader, keys)
    assert reader.load(keys) == [payload(key) for key in keys]
    server.delete(index)
    server.close()
    writer.close()
    reader.close()


def test_admission_runs_before_the_fleets_lru(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
) -> None:
    """Scenario: with ``admission = "tinylfu"`` a fleet's tier admits a block seen twice
    (the fleet's LRU is in the server: no victim to compare with). A working set that
    was loaded again fills the bound; a flood of blocks stored once each is refused
    before it reaches the server, so its LRU never pushes the working set out."""
    server = redis.Redis.from_url(redis_server.url)
    config = redis_config(redis_server.url, key_prefix, fleet_capacity="1MiB", admission="tinylfu")
    engine = Engine(daemons(config + WAIT_FOR_REDIS), pool_name, num_blocks=16)
    working = block_keys("w", BOUND)
    engine.store(working)  # seen once: not admitted
    engine.settle_cascades()
    assert _held(server, key_prefix, pool_name, working) == []
    engine.load(working)  # seen twice: admitted at the load
    engine.settle_cascades()
    eventually(lambda: len(_index(server, key_prefix)) == BOUND, 20, "the working set written")
    flood = block_keys("once", 48)
    for i in range(0, len(flood), 8):
        engine.store(flood[i : i + 8], retry_for=10.0)
        engine.settle_cascades()
    assert _held(server, key_prefix, pool_name, working) == working
    assert _held(server, key_prefix, pool_name, flood) == []
    stats = engine.tier_stats()
    assert (stats.admitted_blocks, stats.rejected_infrequent_blocks) == (BOUND, BOUND + 48)
    assert stats.evictions == 0
    server.close()
    engine.close()
