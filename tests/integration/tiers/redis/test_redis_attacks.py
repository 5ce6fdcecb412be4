"""Attacks on the redis tier, each against real daemons and a real redis-server: a
node that stops answering or trickles its answers, an unreachable server, a huge or
value planted under a block's key. A forged value is the subject of
``test_redis_integrity.py`` (keyed integrity)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import redis
from daemon_harness import DaemonProcess, eventually, peak_rss_bytes
from engine_harness import HIT, MISS, PENDING, Engine, block_keys, payload
from redis_harness import RedisServer, TrickleProxy, redis_config, redis_key, tier_warnings
from redis_harness import stopped as hung

from kvtierd.tiering.retries import PROMOTION_RETRY_AFTER
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import FailedPrecondition

# -- fast lane -------------------------------------------------------------------------


# -- warm restart ----------------------------------------------------------------------


# -- redis tier ------------------------------------------------------------------------

STORE_EVERY_S = 0.05
STALLED_FOR_S = 8.0


def _store_for(engine: Engine, seconds: float, prefix: str) -> tuple[int, int]:
    """Stores one new block every STORE_EVERY_S for ``seconds``: (stored, refused)."""
    stored = refused = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        keys = [f"{prefix}-{stored + refused}".encode()]
        grant = engine.session.prepare_store(keys)
        if grant is None or not grant.block_ids:
            refused += 1
        else:
            engine.session.complete_store(keys)
            stored += 1
        time.sleep(STORE_EVERY_S)
    return stored, refused


def test_a_redis_node_that_stops_answering_does_not_shut_the_primary_to_stores(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Each cascade pins its primary block until the tier reports. A node that stops
    answering (SIGSTOP here: a hung host, a black-holed route; no RST) made every
    block wait ``timeout`` on one of the tier's threads, so the primary's store rate
    fell to ``threads / timeout`` blocks a second: with 2 threads and 1 s, 81 % of
    the stores of an engine storing 20 blocks a second were refused, for as long as
    the node hung (the issue: "the daemon keeps serving the primary"). A node that
    timed out is now skipped, its blocks failing at once, with one trial call at a
    time until it answers again."""
    config = redis_config(redis_server.url, key_prefix, timeout="1s").replace(
        "threads = 4", "threads = 2"
    )
    daemon = daemons(config)
    engine = Engine(daemon, pool_name, num_blocks=16)
    stored, refused = _store_for(engine, 2.0, "healthy")
    assert refused == 0, "a healthy node refused stores"
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        stored, refused = _store_for(engine, STALLED_FOR_S, "stalled")
        assert engine.session.lookup([b"unknown"]) == [LookupResult.MISS]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert refused <= 0.4 * (stored + refused), f"{refused} of {stored + refused} refused"
    # the node answers again: the tier takes it back by itself
    server = redis.Redis.from_url(redis_server.url)
    tries: list[bytes] = []

    def cascaded() -> bool:
        if tries and server.exists(redis_key(key_prefix, pool_name, tries[-1])):
            return True
        tries.append(b"later-%d" % len(tries))
        engine.store(tries[-1:], retry_for=10.0)
        return False

    eventually(cascaded, 30.0, "a block cascaded to the node once it answered", interval=0.5)
    assert daemon.alive()
    server.close()
    engine.close()


def test_a_promotion_the_server_timed_out_keeps_the_value_and_is_tried_again_soon(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Issue #40, item 5, on Redis. Scenario: the server hangs (SIGSTOP) while blocks
    held only there are promoted; the loads time out. The failure is transient: the
    values stay in the server, untouched, Explain says the server did not answer (not
    "unreadable or corrupt"), and once it answers again the blocks are promoted
    bit-exact long before a corrupt block's ban (PROMOTION_RETRY_AFTER) would end."""
    server = redis_factory()
    config = redis_config(server.url, key_prefix, timeout="1s", presence_ttl="60s")
    daemon = daemons(config)
    engine = Engine(daemon, pool_name, num_blocks=4)
    stalled, others = block_keys("a", 2), block_keys("b", 4)
    engine.store(stalled)
    engine.settle_cascades()
    engine.store(others)  # `stalled` now only in the server
    engine.settle_cascades()
    client = server.client()
    names = [redis_key(key_prefix, pool_name, key) for key in stalled]
    values = [client.get(name) for name in names]
    assert all(values)
    with hung(server):
        assert engine.session.lookup(stalled) == [PENDING, PENDING]
        assert engine.wait_settled(stalled) == [MISS, MISS]  # timed out
    assert [client.get(name) for name in names] == values  # nothing deleted
    explained = engine.client.explain(pool_name, stalled[0])
    assert [(t.tier, t.present) for t in explained.tiers] == [("redis", True)]
    assert explained.history[-1].what == (
        "promotion failed for now (the Redis server did not answer within the tier's "
        "timeout): nothing removed, promoted again later"
    ), explained

    def promoted() -> bool:
        return engine.session.lookup(stalled) == [HIT, HIT]

    eventually(promoted, PROMOTION_RETRY_AFTER / 2, lambda: f"promoted again:\n"
               f"{engine.client.explain(pool_name, stalled[0])}", interval=0.05)  # fmt: skip
    assert engine.load(stalled) == [payload(key) for key in stalled]
    assert engine.tier_stats().checksum_failures == 0
    client.close()
    engine.close()


def test_an_unreachable_redis_server_never_stalls_the_event_loop_through_getstats(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Until the tier has reached its server once, each I/O call tries to build the
    client (at most once a second), asking the seeds ``INFO cluster`` -- and the link
    held its lock across that, which the event loop takes to read the tier's health
    for GetStats and /metrics: with a server that accepts but never answers, every
    GetStats (every Prometheus scrape) froze the whole daemon -- every session of
    every pool -- for ``timeout``. The build no longer holds that lock."""
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # connected, never answering
    try:
        daemon = daemons(redis_config(redis_server.url, key_prefix, timeout="5s"))
        with Client(daemon.address, timeout=60) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=16)
            worst = 0.0
            stop = threading.Event()

            def look_up() -> None:
                nonlocal worst
                n = 0
                while not stop.is_set():
                    started = time.monotonic()
                    session.lookup([b"k-%d" % n])  # each new key asks for a probe (a build)
                    worst = max(worst, time.monotonic() - started)
                    n += 1
                    time.sleep(0.02)

            looker = threading.Thread(target=look_up)
            looker.start()
            try:
                deadline = time.monotonic() + 12.0
                while time.monotonic() < deadline:
                    client.get_stats(pool_name)
                    time.sleep(0.05)
            finally:
                stop.set()
                looker.join()
            # a frozen loop waited the tier's whole 5 s timeout
            assert worst < 4.0, f"a Lookup waited {worst:.2f}s: the event loop stalled"
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_a_redis_node_that_trickles_its_answers_does_not_shut_the_primary_to_stores(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """The tier's ``timeout`` was redis-py's socket timeout, which bounds each
    ``recv``, not a call: a node (or a middlebox) that answers one byte every half
    second never tripped it, so each call lasted as long as its answer had bytes (a
    SET's ``+OK``: 2.5 s; a block's load or an INFO: minutes) while the cascade held
    its primary pin, and the primary's stores were throttled as by a hung node
    (88 % refused). A whole call, a connection's handshake and a health check now
    have a deadline (2 x ``timeout``, kvtierd.tiers.redis.deadline), after which
    the node is skipped as for any timeout."""
    proxy = TrickleProxy(redis_server.port)
    try:
        config = redis_config(proxy.url, key_prefix, timeout="1s", cluster="false")
        daemon = daemons(config.replace("threads = 4", "threads = 2"))
        engine = Engine(daemon, pool_name, num_blocks=16)
        stored, refused = _store_for(engine, 2.0, "healthy")
        assert refused == 0, "a healthy node refused stores"
        proxy.slow.set()
        stored, refused = _store_for(engine, STALLED_FOR_S, "trickled")
        assert refused <= 0.5 * (stored + refused), f"{refused} of {stored + refused} refused"
        engine.close()
    finally:
        proxy.close()


# -- shared fs root --------------------------------------------------------------------


PLANTED_BYTES = 160 << 20  # a value planted under a block's key, far over one block


def test_a_huge_value_planted_under_a_blocks_redis_key_is_read_bounded(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    """Anyone who can write to the redis server can plant a value of up to 512 MB
    under a block's key. A promotion used to ``GET`` it whole into the daemon (one
    per I/O thread at once: GBs) before checking its length; it reads at most one
    value's worth now, answers MISS and deletes the planted value."""
    daemon = daemons(redis_config(redis_server.url, key_prefix))
    keys = block_keys("huge", 2)
    server = redis.Redis.from_url(redis_server.url)
    victim = redis_key(key_prefix, pool_name, keys[0])
    server.set(victim, b"\0" * PLANTED_BYTES)
    engine = Engine(daemon, pool_name)
    before = peak_rss_bytes(daemon.proc.pid)

    def rejected() -> bool:  # a Lookup asks for the promotion (again)
        assert engine.wait_settled(keys[:1]) == [MISS]
        return engine.tier_stats().checksum_failures == 1

    eventually(rejected, 30.0, lambda: f"the value rejected: {engine.tier_stats()}", interval=0.2)
    grown = peak_rss_bytes(daemon.proc.pid) - before
    assert grown < PLANTED_BYTES // 4, f"the daemon's peak RSS grew by {grown >> 20} MiB"
    eventually(lambda: server.exists(victim) == 0, 30.0, "the planted value deleted")
    with pytest.raises(FailedPrecondition):  # never served
        engine.session.prepare_load(keys[:1])
    engine.close()
    server.close()


MOVED_VALUES = 300  # the red team's 1,000 gave 1,000 lines (153 KB) in 1.9 s


def test_values_moved_between_keys_are_logged_at_a_bounded_rate(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    """Scenario: a writer of the server moves 300 genuine values one key along (each
    now under its neighbour's name: its header names another key). Each promotion
    refuses its value, counts it in ``checksum_failures`` and deletes it; the log
    gets at most one such WARNING per 10 s (FAULT_LOG_INTERVAL_S), not one per value.
    Before: one WARNING per value (``block ... dropped``), 300 lines."""
    daemon = daemons(redis_config(redis_server.url, key_prefix))
    engine = Engine(daemon, pool_name, num_blocks=MOVED_VALUES)
    keys = block_keys("moved", MOVED_VALUES)
    started = time.monotonic()
    engine.store(keys)
    engine.settle_cascades()
    assert engine.client.flush_pool(pool_name) == MOVED_VALUES  # the tier holds them alone
    server = redis.Redis.from_url(redis_server.url)
    names = [redis_key(key_prefix, pool_name, key) for key in keys]
    values = server.mget(names)
    assert all(isinstance(value, bytes) for value in values)
    server.mset(dict(zip(names[1:] + names[:1], values, strict=True)))

    def all_refused() -> bool:
        engine.session.lookup(keys)  # asks for the promotions (again)
        return engine.tier_stats().checksum_failures >= MOVED_VALUES

    eventually(all_refused, 60.0, lambda: f"every value refused: {engine.tier_stats()}",
               interval=0.05)  # fmt: skip
    assert engine.wait_settled(keys) == [MISS] * MOVED_VALUES
    elapsed = time.monotonic() - started
    lines = [line for line in tier_warnings(daemon.log()) if " dropped: " in line]
    assert 1 <= len(lines) <= 1 + elapsed // 10, (
        f"{len(lines)} lines for {MOVED_VALUES} values in {elapsed:.1f}s"
    )
    assert server.exists(*names) == 0, "the refused values were left in the server"
    engine.close()
    server.close()
