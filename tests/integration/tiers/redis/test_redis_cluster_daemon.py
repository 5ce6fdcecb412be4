"""The redis tier on a real 3-master Redis Cluster (``redis-cli --cluster create``),
through real daemons: a block stored through one daemon is promoted bit-exact on
another; a killed node costs its own keys only (MISS, counted, no client error)
and the tier recovers when it returns; a cluster at ``maxmemory`` with
``allkeys-lru`` takes every store and its evicted keys come to answer MISS, never
wrong bytes. Skipped without ``redis-server``.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon_harness import DaemonProcess, ctl, eventually
from engine_harness import HIT, MISS, PENDING, Engine, block_keys, payload
from redis.cluster import RedisCluster
from redis_harness import (
    VALUE_BYTES,
    WAIT_FOR_REDIS,
    RedisClusterNodes,
    RedisServer,
    promoted,
    redis_key,
    tier_warnings,
)

CLUSTER_OPTIONS = {"info_interval": "300ms", "timeout": "500ms"}


def cluster_config(
    urls: tuple[str, ...], prefix: str, cluster: str = "true", **options: object
) -> str:
    extra = "".join(f'{key} = "{value}"\n' for key, value in {**CLUSTER_OPTIONS, **options}.items())
    quoted = ", ".join(f'"{url}"' for url in urls)
    mode = cluster if cluster == "auto" else cluster.lower()
    mode_line = f'cluster = "{mode}"\n' if mode == "auto" else f"cluster = {mode}\n"
    return (
        f'[[tiers]]\ntype = "redis"\nname = "redis"\nurls = [{quoted}]\n{mode_line}'
        f'key_prefix = "{prefix}"\nthreads = 4\n{extra}'
    )


def node_of(cluster: RedisClusterNodes, client: RedisCluster, name: bytes) -> RedisServer:
    """The node of ``cluster`` that owns the Redis key ``name``."""
    port = client.get_node_from_key(name).port
    return next(node for node in cluster.nodes if node.port == port)


def test_a_block_stored_through_one_daemon_is_served_by_another_via_the_cluster(
    redis_cluster: RedisClusterNodes,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    # asks INFO cluster; a lookup waits for the answers; what the reader probed stays
    # known until its explain below, however slow the machine
    config = cluster_config(redis_cluster.urls, key_prefix, cluster="auto", presence_ttl="1h")
    node_a, node_b = daemons(config + WAIT_FOR_REDIS), daemons(config + WAIT_FOR_REDIS)
    keys = block_keys("across", 9)
    writer = Engine(node_a, pool_name, num_blocks=16)
    writer.store(keys)
    writer.settle_cascades()
    stats = writer.tier_stats()
    assert stats.cascade_failures == 0 and stats.bytes_in == 9 * VALUE_BYTES
    client = RedisCluster.from_url(redis_cluster.urls[0])
    names = [redis_key(key_prefix, pool_name, k) for k in keys]
    assert sum(client.exists(name) for name in names) == 9
    assert len({node_of(redis_cluster, client, name).port for name in names}) >= 2

    reader = Engine(node_b, pool_name, num_blocks=16)
    assert reader.session.lookup(keys) == [PENDING] * 9  # asked of every node in the lookup
    promoted(reader, keys)
    assert reader.load(keys) == [payload(k) for k in keys]  # bit-exact
    stats = reader.tier_stats()
    assert stats.promoted_blocks == 9 and stats.bytes_out == 9 * VALUE_BYTES
    assert (stats.nodes_known, stats.nodes_reachable) == (3, 3)
    assert stats.server_capacity_bytes == 0  # no maxmemory: unbounded
    assert stats.server_used_bytes > 0 and stats.round_trip_us > 0
    assert "redis tier: cluster server at" in node_b.log()
    table = ctl(node_b.address, "stats", "--pool", pool_name).stdout.splitlines()
    remote = table[table.index("") + 1 :]  # the remote servers' table, under the tiers'
    assert remote[0].split()[:4] == ["pool", "remote", "tier", "nodes"]
    assert remote[1].split()[1:3] == ["redis", "3/3"] and "unbounded" in remote[1]
    explained = ctl(node_b.address, "explain", pool_name, keys[0].decode()).stdout
    assert "  redis: present (3/3 nodes up, round trip " in explained
    for engine in (writer, reader):
        engine.close()
    client.close()


def test_a_resharded_slot_is_followed_moved_answers_never_fail_a_key(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    cluster = redis_cluster_factory()
    config = cluster_config(cluster.urls, key_prefix)
    node_a, node_b = daemons(config), daemons(config)
    client = RedisCluster.from_url(cluster.urls[0])
    writer = Engine(node_a, pool_name, num_blocks=16)
    reader = Engine(node_b, pool_name, num_blocks=16)  # its slot map: read before the move
    keys = block_keys("moved", 6)
    writer.store(keys)
    writer.settle_cascades()
    assert writer.client.flush_pool(pool_name) == 6
    name = redis_key(key_prefix, pool_name, keys[0])
    source = node_of(cluster, client, name)
    target = next(node for node in cluster.nodes if node is not source)
    cluster.move_slot(client.keyslot(name), source, target)

    for engine in (writer, reader):  # a held key's GET, an unknown key's EXISTS: MOVED
        promoted(engine, keys)
        assert engine.load(keys) == [payload(k) for k in keys]
        stats = engine.tier_stats()
        assert stats.promotion_failures == 0 and stats.probe_failures == 0
    for engine in (writer, reader):
        engine.close()
    client.close()


def test_a_killed_node_costs_its_keys_only_and_the_tier_recovers_when_it_returns(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    cluster = redis_cluster_factory()
    daemon, prober = (daemons(cluster_config(cluster.urls, key_prefix)) for _ in range(2))
    client = RedisCluster.from_url(cluster.urls[0])
    engine = Engine(daemon, pool_name, num_blocks=16)
    keys = block_keys("before", 12)
    engine.store(keys)
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures == 0
    assert engine.client.flush_pool(pool_name) == 12
    victim = node_of(cluster, client, redis_key(key_prefix, pool_name, keys[0]))
    lost = [
        k for k in keys if node_of(cluster, client, redis_key(key_prefix, pool_name, k)) is victim
    ]
    kept = [k for k in keys if k not in lost]
    assert lost and kept

    victim.kill()
    results = dict(zip(keys, engine.wait_settled(keys), strict=True))  # no error to the client
    assert [results[k] for k in lost] == [MISS] * len(lost)
    assert [results[k] for k in kept] == [HIT] * len(kept)
    assert engine.load(kept) == [payload(k) for k in kept]  # the other nodes still serve
    # a daemon that never stored them probes: one pipeline per node, the dead one's
    # failure costs its own keys only
    other = Engine(prober, pool_name, num_blocks=16)
    promoted(other, kept)
    assert other.wait_settled(lost) == [MISS] * len(lost)
    assert other.load(kept) == [payload(k) for k in kept]
    # the dead node's probe failed: counted once it came back (the lookup may not wait)
    eventually(lambda: other.tier_stats().probe_failures >= 1, 20.0, "a probe failure counted")
    other.close()
    eventually(
        lambda: engine.tier_stats().nodes_reachable == 2, 20.0, "the health check saw 2 of 3"
    )
    stats = engine.tier_stats()
    assert stats.nodes_known == 3 and stats.promotion_failures >= len(lost)
    explained = ctl(daemon.address, "explain", pool_name, lost[0].decode()).stdout
    # held as far as the tier knows (its node did not say otherwise), and the node is down
    assert "  redis: present (2/3 nodes up" in explained, explained
    during = block_keys("during", 12)
    engine.store(during)  # the primary takes them; cascades to the dead node fail, counted
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures >= 1
    assert engine.load(during) == [payload(k) for k in during]
    faults = tier_warnings(daemon.log())  # once, however many blocks it failed
    assert len(faults) == 1 and f"node 127.0.0.1:{victim.port} failed" in faults[0], faults
    assert daemon.alive() and "redis tier redis: load failed" in daemon.log()  # DEBUG

    victim.start()  # same port, same nodes.conf: it rejoins with its slots (empty)
    cluster.wait_ok()
    eventually(
        lambda: engine.tier_stats().nodes_reachable == 3, 20.0, "the health check saw 3 of 3"
    )
    engine.client.flush_pool(pool_name)
    failed_before = engine.tier_stats().cascade_failures
    after = block_keys("after", 12)
    assert any(
        node_of(cluster, client, redis_key(key_prefix, pool_name, k)) is victim for k in after
    )
    engine.store(after)
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures == failed_before  # every node took its keys
    assert engine.client.flush_pool(pool_name) == 12
    promoted(engine, after)
    assert engine.load(after) == [payload(k) for k in after]
    engine.close()
    client.close()


def test_a_failover_is_found_by_the_topology_refresh(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    cluster = redis_cluster_factory(3, replicas=1)
    daemon = daemons(cluster_config(cluster.urls, key_prefix))
    client = RedisCluster.from_url(cluster.urls[0])
    engine = Engine(daemon, pool_name, num_blocks=16)
    before = block_keys("failover", 6)
    engine.store(before)
    engine.settle_cascades()
    assert engine.tier_stats().cascade_failures == 0
    master = node_of(cluster, client, redis_key(key_prefix, pool_name, before[0]))
    candidates = iter(  # keys of the slots the failed master served
        k for k in block_keys("on-failed-slots", 3000)
        if node_of(cluster, client, redis_key(key_prefix, pool_name, k)) is master
    )  # fmt: skip
    master.kill()  # its replica is promoted after cluster-node-timeout and an election
    survivors = [node for node in cluster.nodes if node is not master]
    cluster.wait_ok(survivors)
    client.close()

    def new_master_serves() -> bool:  # the tier re-read the topology: stores reach it again
        keys = [next(candidates), next(candidates)]
        failures = engine.tier_stats().cascade_failures
        engine.store(keys, retry_for=5.0)
        engine.settle_cascades()
        engine.client.flush_pool(pool_name)
        return engine.tier_stats().cascade_failures == failures

    eventually(new_master_serves, 30.0, lambda: daemon.log()[-3000:])
    assert engine.client.flush_pool(pool_name) >= 0
    results = engine.wait_settled(before)  # replicated before the kill, or lost: never wrong
    hits = [k for k, r in zip(before, results, strict=True) if r == HIT]
    assert engine.load(hits) == [payload(k) for k in hits]
    assert daemon.alive()
    engine.close()


def test_a_cluster_at_maxmemory_with_allkeys_lru_evicts_and_never_serves_wrong_bytes(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    cluster = redis_cluster_factory(3, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    daemon = daemons(cluster_config(cluster.urls, key_prefix))
    client = RedisCluster.from_url(cluster.urls[0])
    engine = Engine(daemon, pool_name, num_blocks=16)
    keys: list[bytes] = []
    for round_ in range(12):  # 192 blocks of 68 KiB: about 13 MiB into 3 x 4 MiB
        batch = block_keys(f"lru{round_}", 16)
        engine.store(batch)
        engine.settle_cascades()
        engine.client.flush_pool(pool_name)
        keys += batch
    stats = engine.tier_stats()
    assert stats.cascade_failures == 0 and stats.cascade_blocks == 192  # every store succeeded
    assert stats.server_capacity_bytes == 3 * (4 << 20)
    present = {k for k in keys if client.exists(redis_key(key_prefix, pool_name, k))}
    assert 0 < len(present) < len(keys), "the cluster evicted nothing (or everything)"

    def held_is_what_the_server_has() -> bool:  # the re-probe after evictions dropped them
        present.intersection_update(
            k for k in keys if client.exists(redis_key(key_prefix, pool_name, k))
        )
        return engine.tier_stats().used_blocks == len(present)

    eventually(held_is_what_the_server_has, 20.0, "the tier dropped what the server evicted")
    served = 0
    for i in range(0, len(keys), 8):
        chunk = keys[i : i + 8]
        results = engine.wait_settled(chunk)
        hits = [k for k, r in zip(chunk, results, strict=True) if r == HIT]
        if hits:
            assert engine.load(hits) == [payload(k) for k in hits]  # never wrong bytes
            served += len(hits)
        assert all(r == MISS for k, r in zip(chunk, results, strict=True) if k not in present)
        engine.client.flush_pool(pool_name)
    assert served > 0
    engine.close()
    client.close()
