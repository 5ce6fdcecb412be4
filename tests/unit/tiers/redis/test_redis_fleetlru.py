"""The fleet's LRU index (:mod:`kvtierd.tiers.redis.fleetlru`) against real servers:
admissions past the bound delete exactly the least recently used values, whoever
stored or promoted them; a promotion's touch keeps a block, and never brings back one
that was evicted; daemons admitting at once never evict more than the excess; a large
bound is spread over buckets on a Cluster's masters, each exact, adding up to the bound;
an index someone planted costs hits, never an unbounded answer or a raised error, and
its members scored in the future are dropped before an admission counts.
Skipped without ``redis-server``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from fake_clock import FakeClock
from redis.cluster import RedisCluster
from redis_harness import RedisClusterNodes, RedisServer

from kvtierd.tiers.redis.fleetlru import (
    BUCKET_BLOCKS,
    EXTRA_POPS,
    FUTURE_SKEW_S,
    MAX_BUCKETS,
    MAX_MEMBER_BYTES,
    FleetLru,
    bucket_count,
    bucket_limits,
)
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.settings import RedisTierSettings

SPACE = b"t:f00d:"


def _link(urls: tuple[str, ...]) -> RedisLink:
    return RedisLink(RedisTierSettings(urls=urls, timeout=5.0), None)


def _lru(link: RedisLink, capacity: int, clock: FakeClock | None = None) -> FleetLru:
    return FleetLru(
        link, key_prefix="t", fingerprint_hex="f00d", key_space=SPACE, capacity_blocks=capacity,
        clock=clock or FakeClock(1_700_000_000.0),
    )  # fmt: skip


@pytest.fixture
def standalone(redis_server: RedisServer) -> Iterator[tuple[RedisLink, redis.Redis]]:
    link = _link((redis_server.url,))
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()
    yield link, admin
    admin.flushall()
    admin.close()
    link.close()


def _store(admin: redis.Redis, keys: list[bytes]) -> None:
    for key in keys:
        admin.set(SPACE + key, b"value of " + key)


def _held(admin: redis.Redis, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if admin.exists(SPACE + k)]


def test_bucket_limits_add_up_to_the_capacity() -> None:
    assert bucket_count(1) == bucket_count(BUCKET_BLOCKS - 1) == 1
    assert bucket_count(2 * BUCKET_BLOCKS) == 2
    assert bucket_count(10**9) == MAX_BUCKETS
    for capacity, buckets in ((7, 1), (8193, 2), (10**6 + 3, MAX_BUCKETS)):
        limits = bucket_limits(capacity, buckets)
        assert sum(limits) == capacity and max(limits) - min(limits) <= 1


def test_past_the_bound_the_least_recently_used_values_are_deleted(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    link, admin = standalone
    clock = FakeClock(1_700_000_000.0)
    lru = _lru(link, 4, clock)
    keys = [b"k%d" % i for i in range(6)]
    _store(admin, keys[:4])
    assert lru.admit(keys[:4]).popped == []  # at the bound: nothing evicted
    clock.advance(1.0)
    assert lru.touch([keys[0]]) is None  # a promotion of the oldest: now the most recent
    clock.advance(1.0)
    _store(admin, keys[4:])
    admitted = lru.admit(keys[4:])
    assert admitted.error is None
    assert admitted.popped == [keys[1], keys[2]]  # the least recently used, oldest first
    assert _held(admin, keys) == [keys[0], keys[3], keys[4], keys[5]]
    assert admin.zcard(lru.index_names[0]) == 4


def test_within_one_admission_the_last_block_is_the_most_recent(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    """A prefix chain stored in one job: its head goes first, as the exact model puts
    them (each key scored by its place)."""
    link, admin = standalone
    lru = _lru(link, 3)
    chain = [b"z-head", b"a-middle", b"m-tail"]  # names that sort against their places
    _store(admin, chain)
    lru.admit(chain)
    _store(admin, [b"new"])
    assert lru.admit([b"new"]).popped == [b"z-head"]


def test_a_touch_never_brings_back_an_evicted_block(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    link, admin = standalone
    lru = _lru(link, 2)
    _store(admin, [b"a", b"b", b"c"])
    lru.admit([b"a", b"b"])
    assert lru.admit([b"c"]).popped == [b"a"]
    assert lru.touch([b"a", b"b"]) is None  # a promotion that raced the eviction
    members = admin.zrange(lru.index_names[0], 0, -1)
    assert sorted(members) == [b"b", b"c"]


def test_daemons_admitting_at_once_evict_only_the_excess(redis_server: RedisServer) -> None:
    """Four links (four daemons), two threads each, admit 200 blocks two at a time
    into a bound of 60: exactly 140 are popped and deleted, 60 stay. Five rounds: a
    count-then-pop outside the script evicted the same excess twice in about one round
    of two."""
    admin = redis.Redis.from_url(redis_server.url)
    links = [_link((redis_server.url,)) for _ in range(4)]
    lrus = [_lru(link, 60, FakeClock(1_700_000_000.0 + i)) for i, link in enumerate(links)]
    for round_ in range(5):
        admin.flushall()
        keys = [[b"r%d-%d-%d" % (round_, t, i) for i in range(25)] for t in range(8)]
        _store(admin, [k for chunk in keys for k in chunk])
        popped, errors = _admit_at_once(lrus, keys)
        assert errors == []
        assert len(popped) == len(set(popped)) == 140
        assert admin.zcard(lrus[0].index_names[0]) == 60
        assert len(_held(admin, [k for chunk in keys for k in chunk])) == 60
    for link in links:
        link.close()
    admin.flushall()
    admin.close()


def _admit_at_once(
    lrus: list[FleetLru], keys: list[list[bytes]]
) -> tuple[list[bytes], list[BaseException]]:
    """Each list of ``keys`` admitted two at a time by a thread of its own, through
    ``lrus`` in turn, every thread starting at once: what they popped, what failed."""
    popped: list[bytes] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(len(keys))

    def admit(t: int) -> None:
        start.wait()
        for i in range(0, len(keys[t]), 2):
            result = lrus[t % len(lrus)].admit(keys[t][i : i + 2])
            with lock:
                popped.extend(result.popped)
                errors.extend([result.error] if result.error else [])

    threads = [threading.Thread(target=admit, args=(t,)) for t in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return popped, errors


def test_a_large_bound_is_spread_over_a_clusters_masters(
    redis_cluster: RedisClusterNodes,
) -> None:
    """3 buckets' worth of capacity: three indexes, on at least two masters, each
    bounded by its own limit; admitting 200 more than the bound pops exactly 200."""
    link = RedisLink(RedisTierSettings(urls=tuple(redis_cluster.urls), timeout=5.0), None)
    capacity = 3 * BUCKET_BLOCKS
    lru = _lru(link, capacity)
    assert lru.buckets == 3
    keys = [b"c%06d" % i for i in range(capacity + 200)]
    admitted = lru.admit(keys)
    assert admitted.error is None and len(admitted.popped) == 200
    client = link.client()
    assert isinstance(client, RedisCluster)
    owners = {client.get_node_from_key(name).name for name in lru.index_names}
    assert len(owners) >= 2, owners
    for name, limit in zip(lru.index_names, lru.limits, strict=True):
        assert client.zcard(name) == limit
    for name in lru.index_names:
        client.delete(name)
    link.close()


def test_a_planted_index_costs_hits_never_an_unbounded_answer(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    """Someone who can write the server plants 5,000 junk members and one of 1 MiB,
    all older than any block, in a bound of 10: an admission of 2 blocks pops at most
    its own 2 plus EXTRA_POPS, never hands back the 1 MiB member (it is dropped from
    the index all the same), and later admissions work the junk off before they
    evict a block."""
    link, admin = standalone
    lru = _lru(link, 10)
    name = lru.index_names[0]
    admin.zadd(name, {b"huge" + bytes(1 << 20): 0.0})
    admin.zadd(name, {b"junk-%05d" % i: 1.0 + i for i in range(5000)})
    _store(admin, [b"a", b"b"])
    admitted = lru.admit([b"a", b"b"])
    assert admitted.error is None
    assert len(admitted.popped) == 2 + EXTRA_POPS - 1  # the huge one popped, not returned
    assert all(len(key) <= MAX_MEMBER_BYTES for key in admitted.popped)
    assert admin.zscore(name, b"huge" + bytes(1 << 20)) is None
    later = [b"c%d" % i for i in range(9)]
    for key in later:  # each pops its own excess and 512 of the junk's, the junk first
        _store(admin, [key])
        assert lru.admit([key]).error is None
        if key != later[-1]:
            assert admin.zcard(name) > 10 and _held(admin, [b"a", b"b"]) == [b"a", b"b"]
    assert admin.zcard(name) == 10  # the junk worked off: 11 blocks, the oldest evicted
    assert _held(admin, [b"a", b"b", *later]) == [b"b", *later]


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_index_members_from_the_future_are_dropped_before_an_admission_counts(
    request: pytest.FixtureRequest, topology: str
) -> None:
    """Scenario: a writer of the server puts 20 members at +inf and 20 at now + 1 h
    (past FUTURE_SKEW_S) in a bound of 10. An admission of 4 blocks drops them all
    before it counts: it evicts nothing, and the index holds its 4. Before: the 4
    were the least recent, so they popped themselves, as would every block after
    them until someone deleted the index."""
    if topology == "standalone":
        urls = (request.getfixturevalue("redis_server").url,)
    else:
        urls = tuple(request.getfixturevalue("redis_cluster").urls)
    link = _link(urls)
    admin = link.client()
    lru = _lru(link, 10)
    name = lru.index_names[0]
    now_us = 1_700_000_000 * 10**6
    assert FUTURE_SKEW_S < 3600
    admin.zadd(name, {b"inf-%02d" % i: float("inf") for i in range(20)})
    admin.zadd(name, {b"later-%02d" % i: now_us + 3600 * 10**6 + i for i in range(20)})
    keys = [b"a", b"b", b"c", b"d"]
    try:
        _store(admin, keys)
        admitted = lru.admit(keys)
        assert admitted.error is None and admitted.popped == []
        assert _held(admin, keys) == keys
        assert admin.zrange(name, 0, -1) == keys
    finally:
        admin.delete(name, *[SPACE + key for key in keys])
        link.close()


def test_members_within_the_skew_cost_hits_only_until_the_clock_passes_them(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    """What a writer of the server can still do: members scored a minute ahead (within
    FUTURE_SKEW_S, as a daemon's fast clock would) count, and outrank a block stored
    now, which evicts itself; once the clock passes them they are the least recent
    and go first."""
    link, admin = standalone
    clock = FakeClock(1_700_000_000.0)
    lru = _lru(link, 10, clock)
    name = lru.index_names[0]
    admin.zadd(name, {b"soon-%02d" % i: 1_700_000_060 * 10**6 + i for i in range(10)})
    _store(admin, [b"early", b"later"])
    assert lru.admit([b"early"]).popped == [b"early"]
    clock.advance(61.0)
    assert lru.admit([b"later"]).popped == [b"soon-00"]
    assert _held(admin, [b"early", b"later"]) == [b"later"]


def test_an_index_of_the_wrong_type_fails_the_admission_not_the_caller(
    standalone: tuple[RedisLink, redis.Redis],
) -> None:
    link, admin = standalone
    lru = _lru(link, 10)
    admin.set(lru.index_names[0], b"not a sorted set")
    admitted = lru.admit([b"a"])
    assert admitted.popped == [] and isinstance(admitted.error, redis.ResponseError)
    assert "WRONGTYPE" in str(admitted.error)
    assert isinstance(lru.touch([b"a"]), redis.ResponseError)
