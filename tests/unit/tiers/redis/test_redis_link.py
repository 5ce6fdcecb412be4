"""The redis tier's link to its server (:mod:`kvtierd.tiers.redis.link`) against real
servers: ``"auto"`` tells a Cluster from a standalone server, a server down at the
first call is asked again later (never refused for good), a per-node pipeline
fails the keys of a dead node only, the health sums the masters' memory, and a node
that flaps is one WARNING a minute.
Skipped without ``redis-server``."""

from __future__ import annotations

import logging

import pytest
import redis
from fake_clock import FakeClock
from redis.exceptions import ClusterDownError
from redis_harness import RedisClusterNodes, RedisServer, stopped

from kvtierd.tiers.redis.link import RESOLVE_RETRY_S, RedisLink
from kvtierd.tiers.redis.nodefaults import NODE_FAULT_LOG_S, NodeFaults
from kvtierd.tiers.redis.settings import RedisTierSettings


def link_of(
    urls: tuple[str, ...], cluster: str = "auto", clock: FakeClock | None = None
) -> RedisLink:
    settings = RedisTierSettings(urls=urls, cluster=cluster, timeout=1.0)
    return RedisLink(settings, None, clock=clock or FakeClock())


def test_auto_asks_the_server_whether_it_is_a_cluster(
    redis_server: RedisServer, redis_cluster: RedisClusterNodes
) -> None:
    standalone, cluster = link_of((redis_server.url,)), link_of(redis_cluster.urls[1:])
    try:
        assert (standalone.is_cluster, cluster.is_cluster) == (False, False)  # not asked yet
        standalone.client()
        cluster.client()  # seeded with two of the three: learns the third
        assert (standalone.health.mode, cluster.health.mode) == ("standalone", "cluster")
        assert (standalone.health.nodes_known, cluster.health.nodes_known) == (1, 3)
        health = cluster.refresh_health()
        assert (health.nodes_reachable, health.max_memory_bytes) == (3, 0)  # 0: unbounded
        assert health.used_memory_bytes > 0 and health.round_trip_us > 0
    finally:
        standalone.close()
        cluster.close()


def test_a_server_down_at_the_first_call_is_asked_again_later(
    redis_factory,
) -> None:
    server: RedisServer = redis_factory("--maxmemory", "5mb")
    server.kill()
    clock = FakeClock()
    link = link_of((server.url,), clock=clock)
    try:
        with pytest.raises(redis.ConnectionError, match="server not reached"):
            link.client()
        server.start()
        clock.advance(RESOLVE_RETRY_S - 0.001)
        with pytest.raises(redis.ConnectionError):  # within RESOLVE_RETRY_S: not asked again
            link.client()
        clock.advance(0.001)
        assert not link.is_cluster and link.client() is link.client()
        assert link.refresh_health().max_memory_bytes == 5 << 20
    finally:
        link.close()


def test_a_dead_node_fails_its_own_keys_of_a_per_node_pipeline_only(
    redis_cluster_factory,
) -> None:
    cluster: RedisClusterNodes = redis_cluster_factory()
    link = link_of(cluster.urls, cluster="true")
    try:
        names = [b"link-key-%d" % i for i in range(30)]
        replies, failed = link.per_node("EXISTS", names)
        assert (replies, failed) == ([0] * 30, 0)
        owners = [link.node_for(name)[0] for name in names]
        dead = cluster.nodes[0]
        dead_name = f"127.0.0.1:{dead.port}"
        assert dead_name in owners and len(set(owners)) == 3
        dead.kill()
        replies, failed = link.per_node("EXISTS", names)
        assert failed == 1
        for owner, reply in zip(owners, replies, strict=True):
            if owner == dead_name:
                assert isinstance(reply, redis.ConnectionError)
            else:
                assert reply == 0
        assert link.refresh_health().nodes_reachable == 2
    finally:
        link.close()


def test_a_flapping_node_is_one_warning_a_minute_with_the_count_of_its_flaps(
    redis_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that times out, answers, times out again (one that trickles its answers:
    a small call gets through, the next is cut) is one fault, not a WARNING and an
    INFO per flap: the first failure is logged with its end; failures within
    NODE_FAULT_LOG_S of that line are DEBUG, their ends too; the next WARNING after it
    says how many there were."""
    server: RedisServer = redis_factory()
    clock = FakeClock()
    settings = RedisTierSettings(urls=(server.url,), cluster="false", timeout=0.2)
    link = RedisLink(settings, None, "flap", clock=clock)
    caplog.set_level(logging.DEBUG, logger="kvtierd.tiers.redis")

    def lines(level: int) -> list[str]:  # the node's lines (not "standalone server at")
        return [r.getMessage() for r in caplog.records if r.levelno == level and "node" in r.msg]

    def flap() -> None:  # one timeout, then (past the skip) one answer
        with stopped(server), pytest.raises((redis.TimeoutError, TimeoutError)):
            link.get(b"flap-key", 16)
        clock.advance(1.5)  # the node's skip (max(timeout, 1 s)) is over: a trial
        assert link.get(b"flap-key", 16) == b""

    try:
        assert link.get(b"flap-key", 16) == b""
        for _ in range(4):  # four faults within a minute
            flap()
            clock.advance(5.0)
        warnings, infos = lines(logging.WARNING), lines(logging.INFO)
        assert len(warnings) == 1 and "node 127.0.0.1" in warnings[0], warnings
        assert "more times" not in warnings[0]
        assert len(infos) == 1 and "answers again" in infos[0], infos
        assert sum("failed again" in line for line in lines(logging.DEBUG)) == 3
        clock.advance(NODE_FAULT_LOG_S)
        flap()  # a minute after the last line: logged again, with what it hid
        warnings, infos = lines(logging.WARNING), lines(logging.INFO)
        assert len(warnings) == 2 and len(infos) == 2, (warnings, infos)
        assert "it failed 3 more times since the last such line" in warnings[1], warnings
    finally:
        link.close()


def test_a_node_that_answers_clusterdown_is_one_fault_of_that_node(
    redis_cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A master that answers ``CLUSTERDOWN`` (restarted and not rejoined yet, or a slot
    nobody serves) is down: one WARNING naming it, however many calls and of what
    kind it fails (not one line per kind of call, as for a refusal the operator must
    fix), the tier's own lines about it DEBUG, and an INFO once it serves again."""
    cluster: RedisClusterNodes = redis_cluster_factory()
    link = link_of(cluster.urls, cluster="true")
    caplog.set_level(logging.INFO, logger="kvtierd.tiers.redis")

    def lines(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and "node" in r.msg]

    try:
        key = b"down-key"
        assert link.per_node("EXISTS", [key]) == ([0], 0)
        name = link.node_for(key)[0]
        owner = next(node for node in cluster.nodes if name == f"127.0.0.1:{node.port}")
        with owner.client() as admin:
            slot = int(admin.execute_command("CLUSTER", "KEYSLOT", key))
            admin.execute_command("CLUSTER", "DELSLOTS", slot)
            for _ in range(3):
                replies, _ = link.per_node("EXISTS", [key])
                assert isinstance(replies[0], ClusterDownError), replies
                assert NodeFaults.node_down(replies[0])
                with pytest.raises(ClusterDownError):
                    link.get(key, 16)
            warnings = lines(logging.WARNING)
            assert len(warnings) == 1 and f"node {name} failed (ClusterDownError" in warnings[0]
            admin.execute_command("CLUSTER", "ADDSLOTS", slot)
        assert link.per_node("EXISTS", [key]) == ([0], 0)
        assert lines(logging.INFO) == [f"redis tier redis: node {name} answers again"]
    finally:
        link.close()
