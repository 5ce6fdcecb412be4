"""The redis tier's link to its server (:mod:`kvtierd.tiers.redis.link`) against real
servers: ``"auto"`` tells a Cluster from a standalone server, a server down at the
first call is asked again later (never refused for good), a per-node pipeline
fails the keys of a dead node only, and the health sums the masters' memory.
Skipped without ``redis-server``."""

from __future__ import annotations

import time

import pytest
import redis
from redis_harness import RedisClusterNodes, RedisServer

from kvtierd.tiers.redis.link import RESOLVE_RETRY_S, RedisLink
from kvtierd.tiers.redis.settings import RedisTierSettings


def link_of(urls: tuple[str, ...], cluster: str = "auto") -> RedisLink:
    return RedisLink(RedisTierSettings(urls=urls, cluster=cluster, timeout=1.0), None)


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
    link = link_of((server.url,))
    try:
        with pytest.raises(redis.ConnectionError, match="server not reached"):
            link.client()
        server.start()
        with pytest.raises(redis.ConnectionError):  # within RESOLVE_RETRY_S: not asked again
            link.client()
        time.sleep(RESOLVE_RETRY_S + 0.1)
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
