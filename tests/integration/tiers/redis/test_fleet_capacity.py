"""``fleet_capacity``: the daemons sharing a pool's keys keep them under one bound in the
server together, deleting the least recently used by any of them first -- a block one
daemon stored and another promoted outlives one stored later that nobody read. Real
daemons, real redis-server processes; a bound too small to mean anything stops the
daemon with one line naming the option."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis
from daemon_harness import DaemonProcess, eventually, refused_start
from engine_harness import MISS, PENDING, Engine, block_keys
from redis_harness import (
    VALUE_BYTES,
    WAIT_FOR_REDIS,
    RedisClusterNodes,
    RedisServer,
    promoted,
    redis_config,
    redis_key,
)

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
