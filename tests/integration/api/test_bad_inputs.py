"""Bad input on every RPC: the right status, a message that says what to fix,
no state change, and the daemon keeps serving."""

from __future__ import annotations

import functools

import grpc
import pytest
from daemon_harness import wait_tier_jobs

from kvtierd_client.wire.proto import pb2

BLOCK = 4096
OK_KEY = b"k" * 36


@pytest.fixture
def stub(daemon):
    return daemon.stub()


@pytest.fixture
def session(stub, pool_name):
    """A pool of 8 blocks holding one ready key, one pending key, one pinned key."""
    response = stub.OpenSession(
        pb2.OpenSessionRequest(
            pool=pb2.PoolSpec(name=pool_name, block_bytes=BLOCK, num_blocks=8, layout="L1"),
            client_name="bad-inputs",
        )
    )
    sid = response.session_id
    stub.PrepareStore(pb2.PrepareStoreRequest(session_id=sid, keys=[b"ready", b"pinned"]))
    stub.CompleteStore(pb2.CompleteStoreRequest(session_id=sid, keys=[b"ready", b"pinned"],
                                                success=True))  # fmt: skip
    stub.PrepareLoad(pb2.PrepareLoadRequest(session_id=sid, keys=[b"pinned"]))
    stub.PrepareStore(pb2.PrepareStoreRequest(session_id=sid, keys=[b"pending"]))
    return sid


def snapshot(stub, pool_name, sid):
    wait_tier_jobs(stub, pool_name)  # cascade pins are transient
    stats = stub.GetStats(pb2.GetStatsRequest(pool=pool_name)).pools[0]
    tier = stats.tiers[0]
    lookups = stub.Lookup(
        pb2.LookupRequest(session_id=sid, keys=[b"ready", b"pinned", b"pending", b"absent"])
    ).results
    return (
        tier.used_blocks, tier.pinned_blocks, tier.pending_blocks, tier.evictions,
        stats.last_event_seq, list(lookups), stats.sessions,
    )  # fmt: skip


def expect(code: grpc.StatusCode, call, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), info.value.details()


def key_cases(sid: str):
    """Key-list defects shared by every keyed RPC: (keys, expected code, message fragment)."""
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    return [
        ([b""], INVALID, "empty key"),
        ([b"x" * 257], INVALID, "257 bytes"),
        ([OK_KEY, b"a", OK_KEY], INVALID, "duplicate"),
        ([i.to_bytes(3, "big") for i in range(65537)], INVALID, "65537 keys"),
    ]


KEYED = [
    ("Lookup", pb2.LookupRequest),
    ("Touch", pb2.TouchRequest),
    ("PrepareLoad", pb2.PrepareLoadRequest),
    ("CompleteLoad", pb2.CompleteLoadRequest),
    ("PrepareStore", pb2.PrepareStoreRequest),
    ("CompleteStore", pb2.CompleteStoreRequest),
]


@pytest.mark.parametrize(("rpc", "message"), KEYED)
def test_bad_keys_rejected_without_state_change(daemon, stub, pool_name, session, rpc, message):
    before = snapshot(stub, pool_name, session)
    call = getattr(stub, rpc)
    for bad_keys, code, fragment in key_cases(session):
        expect(code, functools.partial(call, message(session_id=session, keys=bad_keys)), fragment)
    unknown = message(session_id="nope", keys=[OK_KEY])
    expect(grpc.StatusCode.NOT_FOUND, functools.partial(call, unknown), "session")
    assert snapshot(stub, pool_name, session) == before
    assert daemon.alive()


def test_state_preconditions(daemon, stub, pool_name, session):
    before = snapshot(stub, pool_name, session)
    FP = grpc.StatusCode.FAILED_PRECONDITION
    expect(FP, lambda: stub.PrepareLoad(pb2.PrepareLoadRequest(
        session_id=session, keys=[b"ready", b"absent"])), "MISS", "not HIT")  # fmt: skip
    expect(FP, lambda: stub.PrepareLoad(pb2.PrepareLoadRequest(
        session_id=session, keys=[b"pending"])), "HIT_PENDING")  # fmt: skip
    expect(FP, lambda: stub.CompleteLoad(pb2.CompleteLoadRequest(
        session_id=session, keys=[b"pinned", b"ready"])), "not pinned by this session")  # fmt: skip
    assert snapshot(stub, pool_name, session) == before
    assert daemon.alive()


def test_other_session_cannot_release_or_complete(daemon, stub, pool_name, session):
    other = stub.OpenSession(pb2.OpenSessionRequest(
        pool=pb2.PoolSpec(name=pool_name, block_bytes=BLOCK, layout="L1"))).session_id  # fmt: skip
    before = snapshot(stub, pool_name, session)
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: stub.CompleteLoad(
        pb2.CompleteLoadRequest(session_id=other, keys=[b"pinned"])), "not pinned")  # fmt: skip
    # completing keys another session reserved does not complete them
    stub.CompleteStore(pb2.CompleteStoreRequest(session_id=other, keys=[b"pending"], success=True))
    stub.CloseSession(pb2.CloseSessionRequest(session_id=other))
    after = snapshot(stub, pool_name, session)
    assert after[:6] == before[:6]


OPEN_CASES = [
    (dict(name=""), grpc.StatusCode.INVALID_ARGUMENT, "pool.name"),
    (dict(name="a b"), grpc.StatusCode.INVALID_ARGUMENT, "pool.name"),
    (dict(name="x" * 129), grpc.StatusCode.INVALID_ARGUMENT, "pool.name"),
    (dict(block_bytes=0), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 4096"),
    (dict(block_bytes=4097), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 4096"),
    (dict(block_bytes=(1 << 30) + 4096), grpc.StatusCode.INVALID_ARGUMENT, "1 GiB"),
    (dict(eviction_policy="fifo"), grpc.StatusCode.INVALID_ARGUMENT, "lru, arc"),
    (dict(num_blocks=1 << 20, block_bytes=1 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "memory budget"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "code", "fragment"), OPEN_CASES)
def test_open_session_rejects(daemon, stub, pool_name, fields, code, fragment):
    spec = dict(name=pool_name + "-new", block_bytes=BLOCK, num_blocks=4)
    spec.update(fields)
    before = stub.GetStats(pb2.GetStatsRequest())
    expect(code, lambda: stub.OpenSession(pb2.OpenSessionRequest(pool=pb2.PoolSpec(**spec))),
           fragment)  # fmt: skip
    after = stub.GetStats(pb2.GetStatsRequest())
    assert [p.name for p in after.pools] == [p.name for p in before.pools]
    assert after.memory_used_bytes == before.memory_used_bytes
    assert after.sessions == before.sessions
    assert daemon.alive()


def test_budget_error_carries_numbers(stub, pool_name):
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb2.OpenSessionRequest(pool=pb2.PoolSpec(
            name=pool_name, block_bytes=1 << 20, num_blocks=100_000)))  # fmt: skip
    details = info.value.details()
    assert "100000 blocks x 1048576 bytes" in details and "memory.budget" in details


def test_join_mismatch_names_both(stub, pool_name, session):
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: stub.OpenSession(pb2.OpenSessionRequest(
        pool=pb2.PoolSpec(name=pool_name, block_bytes=2 * BLOCK, layout="L1"))),
        "block_bytes 4096", "8192")  # fmt: skip
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: stub.OpenSession(pb2.OpenSessionRequest(
        pool=pb2.PoolSpec(name=pool_name, block_bytes=BLOCK, layout="L2"))),
        "'L1'", "'L2'")  # fmt: skip
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: stub.OpenSession(pb2.OpenSessionRequest(
        pool=pb2.PoolSpec(name=pool_name, block_bytes=BLOCK, layout="L1",
                          eviction_policy="arc"))), "'lru'", "'arc'")  # fmt: skip


def test_session_rpcs_reject_unknown_sessions(stub):
    NF = grpc.StatusCode.NOT_FOUND
    expect(NF, lambda: stub.KeepAlive(pb2.KeepAliveRequest(session_id="missing")), "unknown")
    expect(NF, lambda: stub.CloseSession(pb2.CloseSessionRequest(session_id="")), "unknown")
    expect(NF, lambda: stub.TakeEvents(pb2.TakeEventsRequest(session_id="0" * 32)), "unknown")


def test_stats_and_watch_reject(stub, pool_name, session):
    unknown = pb2.GetStatsRequest(pool="no-such-pool")
    expect(grpc.StatusCode.NOT_FOUND, lambda: stub.GetStats(unknown), "does not exist")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: stub.GetStats(pb2.GetStatsRequest(pool="bad name")), "pool")  # fmt: skip
    for request, code in [
        (pb2.WatchEventsRequest(pool="bad name"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb2.WatchEventsRequest(pool="no-such-pool"), grpc.StatusCode.NOT_FOUND),
        (pb2.WatchEventsRequest(pool=pool_name, after_seq=-5), grpc.StatusCode.INVALID_ARGUMENT),
        (pb2.WatchEventsRequest(pool=pool_name, after_seq=10**9), grpc.StatusCode.OUT_OF_RANGE),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.WatchEvents(request, timeout=5)))
        assert info.value.code() == code, info.value.details()


def test_daemon_still_serves_after_everything(daemon, stub, pool_name, session):
    assert daemon.alive()
    results = stub.Lookup(pb2.LookupRequest(session_id=session, keys=[b"ready"])).results
    assert list(results) == [pb2.LOOKUP_RESULT_HIT]
