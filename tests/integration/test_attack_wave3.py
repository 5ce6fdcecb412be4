"""Adversarial review of the wave-3 surfaces (fast lane, warm restart, shared fs
root, redis Cluster tier): each test proves one finding against the real daemon.

A finding fixed here has its test passing; one left open is ``xfail(strict=True)``
with the reason. Payloads are a function of the key (``payload(key)``), as in
the fs tier's tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from daemon_harness import DaemonProcess, eventually, start_daemon
from redis_harness import RedisServer
from test_fs_tier_daemon import MISS, Engine, block_keys
from test_redis_tier_daemon import redis_config, redis_key

from kvtierd_client.errors import FailedPrecondition


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.fixture
def key_prefix() -> str:
    return f"atk-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def daemons() -> Iterator[Callable[[str], DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(config: str) -> DaemonProcess:
        daemon = start_daemon("--memory-budget", "64MiB", config=config)
        started.append(daemon)
        return daemon

    try:
        yield start
        for daemon in started:
            assert daemon.stop() == 0, daemon.log()
    finally:
        for daemon in started:
            daemon.cleanup()


# -- redis tier ------------------------------------------------------------------------


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
    before = _peak_rss_bytes(daemon.proc.pid)

    def rejected() -> bool:  # a Lookup asks for the promotion (again)
        assert engine.wait_settled(keys[:1]) == [MISS]
        return engine.tier_stats().checksum_failures == 1

    eventually(rejected, 30.0, lambda: f"the value rejected: {engine.tier_stats()}", interval=0.2)
    grown = _peak_rss_bytes(daemon.proc.pid) - before
    assert grown < PLANTED_BYTES // 4, f"the daemon's peak RSS grew by {grown >> 20} MiB"
    eventually(lambda: server.exists(victim) == 0, 10.0, "the planted value deleted")
    with pytest.raises(FailedPrecondition):  # never served
        engine.session.prepare_load(keys[:1])
    engine.close()
    server.close()
