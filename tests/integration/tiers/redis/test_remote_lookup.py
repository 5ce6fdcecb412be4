"""Remote presence in the lookup itself (issue #32): a Lookup whose keys no local tier
holds asks Redis within the call and answers HIT_PENDING for what the server holds,
waiting at most ``limits.remote_lookup_wait``; the event loop and every other caller go
on meanwhile; a hung node costs its own keys and the wait, never more; own blocks the
server dropped answer MISS before any promotion, and a block gone at its promotion is
promoted again as soon as it is back. Real daemons, real redis-server processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from daemon_harness import DaemonProcess, ctl, eventually
from engine_harness import HIT, MISS, PENDING, Engine, block_keys, payload
from lane_harness import bound_raw, call_frame, read_frame
from redis.cluster import RedisCluster
from redis_harness import (
    WAIT_FOR_REDIS,
    RedisClusterNodes,
    RedisServer,
    promoted,
    redis_config,
    redis_key,
    stopped,
    tier_warnings,
)

from kvtierd_client.client import Client
from kvtierd_client.wire.lane_frames import OK
from kvtierd_client.wire.proto import pb2


def _limits(wait: str) -> str:
    return f'[limits]\nremote_lookup_wait = "{wait}"\n'


def test_a_first_lookup_answers_hit_pending_for_what_another_node_stored(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    """Over the fast lane, over gRPC and inside a Batch: the first lookup on a node
    that never saw the keys answers HIT_PENDING (the MISS-then-probe path answered
    MISS), and what is then promoted is the bytes stored."""
    config = redis_config(redis_server.url, key_prefix) + WAIT_FOR_REDIS
    writer_node, reader_node = daemons(config), daemons(config)
    lane_keys, grpc_keys, batch_keys = (block_keys(f"first-{k}", 4) for k in "lgb")
    writer = Engine(writer_node, pool_name, num_blocks=16)
    writer.store(lane_keys + grpc_keys + batch_keys)
    writer.settle_cascades()

    reader = Engine(reader_node, pool_name, num_blocks=16)  # its calls: the fast lane
    assert reader.session.lookup(lane_keys, prefix=True) == [PENDING] * 4
    with Client(reader_node.address, fast_lane=False) as grpc_only:
        session = grpc_only.open_session(pool_name, block_bytes=65536, num_blocks=16, layout="L")
        assert session.lookup(grpc_keys) == [PENDING] * 4
        session.close()
    looked, _ = reader.session.batch(
        [("lookup", batch_keys, {"prefix": True}), ("touch", lane_keys, {})]
    )
    assert looked == [PENDING] * 4
    everything = lane_keys + grpc_keys + batch_keys
    promoted(reader, everything)
    assert reader.load(everything) == [payload(k) for k in everything]
    stats = reader.tier_stats()
    assert stats.lookup_waits == 3 and stats.lookup_wait_timeouts == 0
    assert stats.probes >= 1 and stats.promoted_blocks == 12
    writer.close()
    reader.close()


def _exists_calls(server: redis.Redis) -> int:
    return int(server.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def test_a_prefix_lookup_asks_only_past_its_local_hits_and_never_past_a_known_miss(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    server = redis_factory()  # its own: every EXISTS it counts is this test's
    # what a probe learns stays known for the whole test, however slow the machine
    config = redis_config(server.url, key_prefix, presence_ttl="1h") + WAIT_FOR_REDIS
    writer_node, reader_node = daemons(config), daemons(config)
    local, remote, later = block_keys("local", 4), block_keys("remote", 4), block_keys("later", 2)
    absent = [b"never-stored"]
    writer = Engine(writer_node, pool_name, num_blocks=32)
    writer.store(remote + later)
    writer.settle_cascades()
    reader = Engine(reader_node, pool_name, num_blocks=32)
    reader.store(local)  # in its primary: local hits, never asked
    reader.settle_cascades()
    client = redis.Redis.from_url(server.url)

    before = _exists_calls(client)
    chain = local + remote + absent + later[:1]
    assert reader.session.lookup(chain, prefix=True) == [HIT] * 4 + [PENDING] * 4 + [MISS] * 2
    assert _exists_calls(client) - before == 6  # remote, absent, later[0]: one round trip

    before = _exists_calls(client)
    chain = local + remote + absent + later[1:]  # a key nobody asked about, past the miss
    results = reader.session.lookup(chain, prefix=True)
    assert results[:4] == [HIT] * 4 and results[-2:] == [MISS, MISS]
    # a lookup that waits for a probe of its own: any probe the one above started (in
    # the background, one node: in order) is answered by the time it returns
    assert reader.session.lookup([b"sync"]) == [MISS]
    assert _exists_calls(client) - before == 1  # "sync" only: past a known miss, unasked
    promoted(reader, remote)
    client.close()
    writer.close()
    reader.close()


@dataclass
class _Spread:
    """Keys a writer node stored on a 3-master Cluster, and the master of the first
    of them (the victim of a fault): some keys are on it, some are not."""

    cluster: RedisClusterNodes
    keys: list[bytes]
    victim: RedisServer
    on_victim: list[bool]

    @property
    def elsewhere(self) -> list[bytes]:
        return [k for k, on in zip(self.keys, self.on_victim, strict=True) if not on]


def _spread_keys(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name: str,
    tag: str,
) -> tuple[_Spread, str]:
    """A Cluster holding 12 keys one node stored; the configuration every node of the
    test uses (a 300 ms lookup wait, a 5 s call timeout: far apart)."""
    cluster = redis_cluster_factory()
    urls = ", ".join(f'"{url}"' for url in cluster.urls)
    config = (
        _limits("300ms") + f'[[tiers]]\ntype = "redis"\nname = "redis"\nurls = [{urls}]\n'
        f'cluster = true\nkey_prefix = "{key_prefix}"\ntimeout = "5s"\npresence_ttl = "1h"\n'
    )
    keys = block_keys(tag, 12)
    writer = Engine(daemons(config), pool_name, num_blocks=32)
    writer.store(keys)
    writer.settle_cascades()
    writer.close()
    slots = RedisCluster.from_url(cluster.urls[0])
    ports = [slots.get_node_from_key(redis_key(key_prefix, pool_name, k)).port for k in keys]
    slots.close()
    victim = next(node for node in cluster.nodes if node.port == ports[0])
    on_victim = [p == victim.port for p in ports]
    assert any(on_victim) and not all(on_victim)
    return _Spread(cluster, keys, victim, on_victim), config


def _fault_logged_once(node: DaemonProcess, victim: RedisServer) -> None:
    faults = tier_warnings(node.log())  # once: the node, not each probe it failed
    assert len(faults) == 1 and f"node 127.0.0.1:{victim.port} failed" in faults[0], faults


def test_a_hung_node_costs_its_own_keys_and_the_wait_never_more(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """One master stops answering (SIGSTOP) for longer than the tier's timeout: a
    lookup answers within remote_lookup_wait (plus the machine's noise), the other
    masters' keys answer HIT_PENDING in that very lookup, nothing wrong is served,
    and the daemon logs the fault once."""
    spread, config = _spread_keys(redis_cluster_factory, daemons, key_prefix, pool_name, "hung")
    keys, on_victim = spread.keys, spread.on_victim
    reader_node = daemons(config)
    reader = Engine(reader_node, pool_name, num_blocks=32)
    settled = [MISS if hung else HIT for hung in on_victim]
    with stopped(spread.victim):
        for attempt in range(3):  # the probe in flight, then the node skipped
            started = time.monotonic()
            results = reader.session.lookup(keys)
            took = time.monotonic() - started
            assert took < 3.0, f"lookup {attempt} took {took:.2f}s (the node's timeout: 5s)"
            if attempt:  # the others promoted meanwhile; the hung node's still unknown
                eventually(lambda: reader.wait_settled(keys) == settled, 30.0, "promoted")
            else:
                assert results == [MISS if hung else PENDING for hung in on_victim]
                assert took >= 0.25, "it did not wait for the hung node at all"
        good = spread.elsewhere
        assert reader.load(good) == [payload(k) for k in good]
        eventually(lambda: tier_warnings(reader_node.log()), 20.0, "the fault logged")
        reader.session.lookup(keys)
    _fault_logged_once(reader_node, spread.victim)
    stats = reader.tier_stats()
    assert stats.lookup_wait_timeouts >= 1 and stats.checksum_failures == 0
    reader.close()


def test_a_killed_node_costs_its_own_keys_in_the_lookup_and_no_wait(
    redis_cluster_factory: Callable[..., RedisClusterNodes],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """One master is killed (SIGKILL: its connections reset, its port refuses) under a
    node that never saw the keys: its first lookup answers HIT_PENDING for the other
    masters' keys and MISS for the dead one's in that very lookup, well within the
    tier's timeout; the live keys are promoted bit-exact, the dead node's stay MISS
    (never an error, never other bytes), and the daemon logs the fault once."""
    spread, config = _spread_keys(redis_cluster_factory, daemons, key_prefix, pool_name, "dead")
    keys, on_victim = spread.keys, spread.on_victim
    reader_node = daemons(config)
    reader = Engine(reader_node, pool_name, num_blocks=32)
    assert reader.session.lookup([b"connected"]) == [MISS]  # its links open, then the kill
    spread.victim.kill()
    for attempt in range(3):
        started = time.monotonic()
        results = reader.session.lookup(keys)
        took = time.monotonic() - started
        assert took < 3.0, f"lookup {attempt} took {took:.2f}s (the node's timeout: 5s)"
        if not attempt:
            assert results == [MISS if dead else PENDING for dead in on_victim], results
    settled = [MISS if dead else HIT for dead in on_victim]
    eventually(lambda: reader.wait_settled(keys) == settled, 30.0, "the live keys promoted")
    good = spread.elsewhere
    assert reader.load(good) == [payload(k) for k in good]
    eventually(lambda: tier_warnings(reader_node.log()), 20.0, "the fault logged")
    for _ in range(3):  # more lookups of the dead node's keys: no more lines
        assert reader.session.lookup(keys) == settled
    _fault_logged_once(reader_node, spread.victim)
    stats = reader.tier_stats()
    assert stats.checksum_failures == 0 and stats.promoted_blocks == len(good)
    assert reader_node.alive()
    reader.close()


def test_a_waiting_lookup_keeps_its_lanes_answers_in_order_and_holds_no_one_else(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    server = redis_factory()
    daemon = daemons(redis_config(server.url, key_prefix, timeout="5s") + _limits("1s"))
    stub = daemon.stub()
    other = Engine(daemon, pool_name + "-other", num_blocks=8)
    other.store(block_keys("mine", 2))
    response, lane = bound_raw(stub, pool_name)
    session_id = response.session_id
    lookup = pb2.LookupRequest(session_id=session_id, keys=block_keys("unknown", 3))
    took: list[float] = []

    def others_meanwhile() -> None:  # another session's calls while the lookup waits
        for _ in range(10):
            started = time.monotonic()
            other.session.lookup(block_keys("mine", 2))
            took.append(time.monotonic() - started)

    with stopped(server):
        started = time.monotonic()
        lane.sendall(
            call_frame("Lookup", lookup)
            + call_frame("KeepAlive", pb2.KeepAliveRequest(session_id=session_id))
        )
        meanwhile = threading.Thread(target=others_meanwhile)
        meanwhile.start()
        first, second = read_frame(lane), read_frame(lane)
        waited = time.monotonic() - started
        meanwhile.join()
    assert first is not None and second is not None and first[0] == second[0] == OK
    answer = pb2.LookupResponse.FromString(first[1])  # the Lookup's answer comes first
    assert list(answer.results) == [pb2.LOOKUP_RESULT_MISS] * 3
    assert pb2.KeepAliveResponse.FromString(second[1]).lease_ms > 0
    assert 0.9 <= waited < 4.0, waited  # the wait (1s), not the node's timeout
    assert len(took) == 10 and max(took) < 0.9, took  # nobody else waited for it
    lane.close()
    other.close()


def test_an_own_block_the_server_evicted_answers_miss_before_any_promotion(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """A held key not seen within presence_ttl is asked again in the lookup: one the
    server dropped answers MISS, not a HIT_PENDING whose promotion fails."""
    server = redis_factory()
    daemon = daemons(redis_config(server.url, key_prefix, presence_ttl="1ms") + WAIT_FOR_REDIS)
    engine = Engine(daemon, pool_name, num_blocks=16)
    keys = block_keys("own", 4)
    engine.store(keys)
    engine.settle_cascades()
    assert engine.client.flush_pool(pool_name) == 4
    client = redis.Redis.from_url(server.url)
    assert client.delete(redis_key(key_prefix, pool_name, keys[1])) == 1  # as maxmemory would
    assert engine.session.lookup(keys) == [PENDING, MISS, PENDING, PENDING]
    kept = [keys[0], *keys[2:]]
    promoted(engine, kept)
    assert engine.load(kept) == [payload(k) for k in kept]
    stats = engine.tier_stats()
    assert stats.promotion_failures == 0 and stats.used_blocks == 3  # dropped, not tried
    client.close()
    engine.close()


def test_a_block_gone_at_its_promotion_is_promoted_again_as_soon_as_it_is_back(
    redis_factory: Callable[..., RedisServer],
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Without a wait the tier trusts a key it stored: the promotion finds it gone and
    the key answers MISS -- a plain MISS, not a 30-second ban: once another node
    stores it again, the lookups after the negative answer's presence_ttl (1 s)
    promote it."""
    server = redis_factory()
    config = redis_config(server.url, key_prefix, presence_ttl="1s") + _limits("0s")
    node_a, node_b = daemons(config), daemons(config)
    key = [b"comes-back"]
    first = Engine(node_a, pool_name)
    first.store(key)
    first.settle_cascades()
    assert first.client.flush_pool(pool_name) == 1
    client = redis.Redis.from_url(server.url)
    client.delete(redis_key(key_prefix, pool_name, key[0]))
    assert first.wait_settled(key) == [MISS]  # HIT_PENDING, then the promotion found nothing
    assert first.tier_stats().promotion_failures == 1
    history = ctl(node_a.address, "explain", pool_name, key[0].decode()).stdout
    assert "promotion found it gone" in history, history
    again = Engine(node_b, pool_name)
    again.store(key)  # another node computes it again
    again.settle_cascades()
    promoted(first, key, timeout=10.0)  # not held back for 30 s
    assert first.load(key) == [payload(key[0])]
    client.close()
    first.close()
    again.close()


def test_a_stop_with_queued_cascades_drops_them_within_its_bound_and_says_how_many(
    redis_factory: Callable[..., RedisServer], key_prefix: str, pool_name
):
    from daemon_harness import start_daemon

    server = redis_factory()
    config = redis_config(server.url, key_prefix, timeout="5s").replace(
        "threads = 4", "threads = 2"
    )
    daemon = start_daemon("--shutdown-grace", "1s", config=config)
    try:
        engine = Engine(daemon, pool_name, num_blocks=64)
        with stopped(server):
            for key in block_keys("queued", 30):  # one cascade job each, behind a hung write
                engine.store([key])
            engine.close()
            started = time.monotonic()
            assert daemon.stop(timeout=60) == 0
            took = time.monotonic() - started
        log = daemon.log()
        assert "tier jobs not finished within server.shutdown_grace (1s)" in log, log[-3000:]
        dropped = int(log.split(" queued tier jobs dropped")[0].rsplit("stopping: ", 1)[1])
        assert 25 <= dropped <= 30, log[-3000:]
        # calls' grace + the jobs' grace + the I/O threads' join, and the process's end
        assert took < 1 + 1 + 2 + 6, took
    finally:
        daemon.cleanup()
