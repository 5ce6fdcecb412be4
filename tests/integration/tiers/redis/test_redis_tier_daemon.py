"""The redis tier attached to real daemons and a real redis-server: a block stored
through one daemon is promoted and served by another; a damaged value is a MISS,
never wrong bytes; a server that dies costs misses and counted failures, no client
error, and the tier recovers when it returns. Skipped without ``redis-server``.

Payloads are a function of the key (``payload(key)``), as in the fs tier's tests.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import redis
from daemon_harness import DaemonProcess, eventually
from engine_harness import HIT, MISS, PENDING, Engine, block_keys, payload
from redis_harness import (
    VALUE_BYTES,
    WAIT_FOR_REDIS,
    RedisServer,
    promoted,
    redis_config,
    redis_key,
    tier_warnings,
)

from kvtierd.tiers import blockformat
from kvtierd_client.errors import FailedPrecondition


def test_a_block_stored_through_one_daemon_is_served_by_another(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    # the first lookup waits for the server's answer (a bound the machine's load never reaches)
    config = redis_config(redis_server.url, key_prefix) + WAIT_FOR_REDIS
    node_a, node_b = daemons(config), daemons(config)
    assert node_a.shm_dir != node_b.shm_dir and node_a.socket_path != node_b.socket_path
    keys = block_keys("shared", 6)
    writer = Engine(node_a, pool_name)
    writer.store(keys)
    writer.settle_cascades()
    stats = writer.tier_stats()
    assert stats.tier == "redis" and stats.cascade_failures == 0
    assert stats.bytes_in == 6 * VALUE_BYTES
    server = redis.Redis.from_url(redis_server.url)
    assert server.exists(*(redis_key(key_prefix, pool_name, k) for k in keys)) == 6

    reader = Engine(node_b, pool_name)
    assert reader.session.lookup(keys) == [PENDING] * 6  # asked in the lookup: promoting
    promoted(reader, keys)
    assert reader.load(keys) == [payload(k) for k in keys]
    stats = reader.tier_stats()
    assert stats.promoted_blocks == 6 and stats.bytes_out == 6 * VALUE_BYTES

    other_layout = Engine(node_b, pool_name + "-x", layout="other")  # another pool: no key shared
    other_layout.store(keys[:1])
    other_layout.settle_cascades()
    assert server.exists(redis_key(key_prefix, pool_name + "-x", keys[0], "other")) == 1
    for engine in (writer, reader, other_layout):
        engine.close()
    server.close()


def _good_keys_hit(engine: Engine, keys: list[bytes]) -> None:
    """Looks ``keys`` up until all but the first (the damaged one) are HIT."""
    results: list[object] = []

    def settled() -> bool:
        results[:] = engine.wait_settled(keys)
        return results[1:] == [HIT, HIT]

    eventually(settled, 20.0, lambda: f"the good keys HIT; {results}", interval=0.01)


def _other_bytes(server: redis.Redis, name: bytes, other: bytes) -> None:
    value = server.get(name)
    assert isinstance(value, bytes)
    i = blockformat.HEADER_SIZE + 1234
    server.set(name, value[:i] + bytes([value[i] ^ 1]) + value[i + 1 :])


def _another_keys_value(server: redis.Redis, name: bytes, other: bytes) -> None:
    server.copy(other, name, replace=True)  # a valid value, its header names another key


def _truncated(server: redis.Redis, name: bytes, other: bytes) -> None:
    value = server.get(name)
    assert isinstance(value, bytes)
    server.set(name, value[:-100])


@pytest.mark.parametrize(
    "damage",
    [_other_bytes, _another_keys_value, _truncated],
    ids=["other-bytes", "another-keys-value", "truncated"],
)
def test_a_damaged_value_is_a_miss_never_wrong_bytes(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    damage,
):
    node_a, node_b = (daemons(redis_config(redis_server.url, key_prefix)) for _ in range(2))
    keys = block_keys("c", 3)
    writer = Engine(node_a, pool_name)
    writer.store(keys)
    writer.settle_cascades()
    server = redis.Redis.from_url(redis_server.url)
    victim = redis_key(key_prefix, pool_name, keys[0])
    damage(server, victim, redis_key(key_prefix, pool_name, keys[1]))

    for node in (node_b, node_a):  # one that only probed it, and the one that stored it
        engine = Engine(node, pool_name) if node is node_b else writer
        if node is node_a:
            assert engine.client.flush_pool(pool_name) == 3
        _good_keys_hit(engine, keys)
        assert engine.wait_settled(keys[:1]) == [MISS]
        with pytest.raises(FailedPrecondition):
            engine.session.prepare_load(keys[:1])  # never served
        assert engine.load(keys[1:]) == [payload(k) for k in keys[1:]]
        if node is node_b:
            assert engine.tier_stats().checksum_failures == 1  # the damaged value, once
            assert server.exists(victim) == 0, "the damaged value was not deleted"
            engine.close()
        else:  # gone before it could be read (a probe or the promotion found out)
            assert engine.tier_stats().checksum_failures == 0  # nothing to verify
    writer.close()
    server.close()


def test_a_dead_server_costs_misses_and_counted_failures_then_recovers(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    server = redis_factory()
    daemon = daemons(redis_config(server.url, key_prefix, timeout="500ms"))
    engine = Engine(daemon, pool_name, num_blocks=8)
    before = block_keys("before", 2)
    engine.store(before)
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures == 0
    assert engine.client.flush_pool(pool_name) == 2

    server.kill()
    assert engine.wait_settled(before) == [MISS, MISS]  # held, but the load fails: MISS
    during = block_keys("during", 2)
    engine.store(during)  # the primary takes it; the cascade fails
    engine.settle_cascades()
    stats = engine.tier_stats()
    assert stats.cascade_failures >= 1 and stats.promotion_failures == 2
    assert engine.load(during) == [payload(k) for k in during]  # the primary still serves
    faults = tier_warnings(daemon.log())  # the fault logged once, the calls it failed not
    assert len(faults) == 1 and f"node 127.0.0.1:{server.port} failed" in faults[0], faults
    assert daemon.alive() and "redis tier redis: store failed" in daemon.log()  # DEBUG

    server.start()  # empty: no persistence
    after = block_keys("after", 2)
    engine.store(after)
    engine.settle_cascades()
    assert engine.client.flush_pool(pool_name) >= 2
    promoted(engine, after)
    assert engine.load(after) == [payload(k) for k in after]
    assert f"redis tier redis: node 127.0.0.1:{server.port} answers again" in daemon.log()
    engine.close()


def test_lookups_never_wait_on_a_server_that_does_not_answer(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    server = redis_factory()
    daemon = daemons(redis_config(server.url, key_prefix, timeout="3s"))
    engine = Engine(daemon, pool_name)
    held = block_keys("held", 2)
    engine.store(held)
    engine.settle_cascades()
    assert engine.client.flush_pool(pool_name) == 2
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # connected, never answering
    try:
        unknown = block_keys("unknown", 64)
        for _ in range(5):
            started = time.monotonic()
            assert engine.session.lookup(unknown) == [MISS] * 64  # probes hang off the loop
            assert engine.session.lookup(held)[0] != HIT  # a promotion hangs off the loop
            engine.client.get_stats(pool_name)
            # well inside the tier's 3 s timeout, what a call waiting on the server takes
            assert time.monotonic() - started < 1.5, "a lookup waited on the server"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert engine.wait_settled(held, timeout=30.0) in ([MISS, MISS], [HIT, HIT])
    engine.close()


def test_a_password_protected_server(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tmp_path,
):
    server = redis_factory("--requirepass", "s3cret-pw")
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret-pw\n")
    password_file.chmod(0o600)
    with_password = daemons(redis_config(server.url, key_prefix, password_file=password_file))
    without = daemons(redis_config(server.url, key_prefix + "-nopw"))
    keys = block_keys("pw", 2)
    for daemon, failures in ((with_password, 0), (without, 1)):
        engine = Engine(daemon, pool_name)
        engine.store(keys)
        engine.settle_cascades()
        assert engine.tier_stats().cascade_failures == failures
        assert engine.load(keys) == [payload(k) for k in keys]  # served either way
        engine.close()
    assert "s3cret-pw" not in with_password.log() + without.log()
    client = redis.Redis.from_url(server.url, password="s3cret-pw")
    assert client.exists(*(redis_key(key_prefix, pool_name, k) for k in keys)) == 2
    client.close()


def test_a_full_server_fails_cascades_cleanly_and_counts_them(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    server = redis_factory("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    daemon = daemons(redis_config(server.url, key_prefix))
    engine = Engine(daemon, pool_name)
    for round_ in range(8):  # 64 blocks of 68 KiB: more than the server takes
        keys = block_keys(f"full{round_}", 8)
        engine.store(keys)
        engine.settle_cascades()
        assert engine.load(keys) == [payload(k) for k in keys]  # the primary serves
        engine.client.flush_pool(pool_name)
    stats = engine.tier_stats()
    assert stats.cascade_failures >= 1 and stats.cascade_blocks == 64
    assert "redis tier redis: store failed: OutOfMemoryError" in daemon.log()
    assert stats.capacity_bytes == 3 << 20  # the server's maxmemory, from INFO
    engine.close()
