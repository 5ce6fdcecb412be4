"""kvtierd.tiers.redis.health: the server's health summed over its masters' INFO answers."""

from __future__ import annotations

from kvtierd.tiers.redis.health import ServerHealth, summarize


def info(maxmemory: int, used: int, system: int = 1 << 30, evicted: int = 0):
    memory = {"maxmemory": maxmemory, "used_memory": used, "total_system_memory": system}
    return memory, {"evicted_keys": evicted}


def test_bounded_masters_add_up():
    health = summarize("cluster", 3, [info(100, 10, evicted=1), info(200, 20, evicted=2)])
    assert health == ServerHealth(
        mode="cluster",
        nodes_known=3,
        nodes_reachable=2,
        max_memory_bytes=300,
        used_memory_bytes=30,
        system_memory_bytes=2 << 30,
        evicted_keys=3,
    )


def test_one_master_without_maxmemory_makes_the_server_unbounded():
    health = summarize("cluster", 2, [info(100, 10), info(0, 20)])
    assert health.max_memory_bytes == 0 and health.used_memory_bytes == 30


def test_no_answer_is_no_node_reachable_and_no_memory():
    health = summarize("standalone", 1, [])
    assert (health.nodes_reachable, health.max_memory_bytes, health.used_memory_bytes) == (0, 0, 0)
