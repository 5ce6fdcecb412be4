"""The redis tier's write budget (``max_write_bytes_per_s``) with a real daemon and a
real redis-server: values past the budget are never sent to the server, and are
counted. Skipped without ``redis-server``."""

from __future__ import annotations

from collections.abc import Callable

import redis
from daemon_harness import DaemonProcess
from engine_harness import HIT, Engine, block_keys
from redis_harness import VALUE_BYTES, RedisServer, redis_config, redis_key

BURST_VALUES = 4  # the budget: four values a second (its burst: one second of it)


def test_values_past_the_budget_are_not_sent_and_are_counted(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    budget = BURST_VALUES * VALUE_BYTES
    daemon = daemons(redis_config(redis_server.url, key_prefix, max_write_bytes_per_s=budget))
    engine = Engine(daemon, pool_name, num_blocks=12)
    keys = block_keys("wire", 12)
    engine.store(keys)  # one store, one cascade: the bucket cannot refill a value within it
    engine.settle_cascades()
    assert engine.session.lookup(keys) == [HIT] * 12
    server = redis.Redis.from_url(redis_server.url)
    held = [bool(server.exists(redis_key(key_prefix, pool_name, k))) for k in keys]
    assert held == [True] * BURST_VALUES + [False] * (12 - BURST_VALUES)
    stats = engine.tier_stats()
    assert stats.bytes_in == BURST_VALUES * VALUE_BYTES
    assert stats.rejected_budget_blocks == 12 - BURST_VALUES
    engine.close()
    server.close()
