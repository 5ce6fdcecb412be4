"""The Batch RPC (ordered ops of one session, one result each) and the client's
queued completions that ride on it."""

from __future__ import annotations

import threading

import grpc
import pytest
from daemon_harness import PoolEvents, eventually

from kvtierd_client._rpc import flusher
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import FailedPrecondition
from kvtierd_client.wire.proto import pb2

OK = 0
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def op(**call) -> pb2.BatchOp:
    return pb2.BatchOp(**call)


def keys_of(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


@pytest.fixture
def session_id(daemon, pool_name) -> str:
    stub = daemon.stub()
    response = stub.OpenSession(
        pb2.OpenSessionRequest(pool=pb2.PoolSpec(name=pool_name, block_bytes=4096, num_blocks=4))
    )
    return response.session_id


def test_ops_run_in_order_and_an_error_undoes_nothing(daemon, session_id):
    stub = daemon.stub()
    a, b = keys_of("a", "b")
    response = stub.Batch(
        pb2.BatchRequest(
            session_id=session_id,
            ops=[
                op(prepare_store=pb2.PrepareStoreRequest(keys=[a, b])),
                op(complete_store=pb2.CompleteStoreRequest(keys=[a], success=True)),
                op(prepare_load=pb2.PrepareLoadRequest(keys=[a, b])),  # b is pending: fails
                op(prepare_load=pb2.PrepareLoadRequest(keys=[a])),
                op(lookup=pb2.LookupRequest(keys=[a, b, b"c"])),
                op(complete_load=pb2.CompleteLoadRequest(keys=[a])),
                op(touch=pb2.TouchRequest(keys=[a])),
            ],
        )
    )
    codes = [r.code for r in response.results]
    assert codes == [OK, OK, grpc.StatusCode.FAILED_PRECONDITION.value[0], OK, OK, OK, OK]
    assert list(response.results[0].prepare_store.keys_to_store) == [a, b]
    assert "b" in response.results[2].error and "HIT_PENDING" in response.results[2].error
    assert list(response.results[3].prepare_load.block_ids) == [0]
    assert list(response.results[4].lookup.results) == [HIT, PENDING, MISS]
    assert response.results[6].HasField("touch")
    stats = stub.GetStats(pb2.GetStatsRequest()).pools
    primary = next(p for p in stats if p.name).tiers[0]
    assert primary.pinned_blocks == 0  # the one pin was taken and released


def test_bad_ops_fail_alone(daemon, session_id):
    stub = daemon.stub()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    response = stub.Batch(
        pb2.BatchRequest(
            session_id=session_id,
            ops=[
                op(lookup=pb2.LookupRequest(session_id="another", keys=[b"x"])),
                pb2.BatchOp(),
                op(prepare_store=pb2.PrepareStoreRequest(keys=[b"x", b"x"])),
                op(prepare_store=pb2.PrepareStoreRequest(keys=[b"x"])),
            ],
        )
    )
    assert [r.code for r in response.results] == [invalid, invalid, invalid, OK]
    assert "not the batch's session" in response.results[0].error
    assert "no call set" in response.results[1].error
    assert "duplicate" in response.results[2].error
    assert list(response.results[3].prepare_store.keys_to_store) == [b"x"]


def test_whole_batch_refusals(daemon, session_id):
    stub = daemon.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.Batch(pb2.BatchRequest(session_id="nope", ops=[op(touch=pb2.TouchRequest())]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    too_many = [op(touch=pb2.TouchRequest(keys=[b"k"]))] * 4097
    with pytest.raises(grpc.RpcError) as info:
        stub.Batch(pb2.BatchRequest(session_id=session_id, ops=too_many))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 4096" in info.value.details()


def test_queued_completions_ride_on_the_next_answer(daemon, pool_name):
    with Client(daemon.address) as client, Client(daemon.address) as other_client:
        session = client.open_session(
            pool_name, block_bytes=4096, num_blocks=8, queue_completions=True
        )
        other = other_client.open_session(pool_name, block_bytes=4096)
        a, b = keys_of("a", "b")
        session.rpcs = 0
        session.prepare_store([a, b])
        session.complete_store([a, b])  # queued: no round trip
        session.touch([a])  # queued
        assert session.rpcs == 1
        assert session.prepare_load([a]) == [0]  # carries both completions first
        assert session.rpcs == 2
        session.complete_load([a])
        session.complete_load([b])  # b was never pinned: a deferred error
        assert session.lookup([a, b]) == [HIT, HIT]
        assert session.rpcs == 3
        assert len(session.deferred_errors) == 1
        assert isinstance(session.deferred_errors[0], FailedPrecondition)
        assert other.prepare_load([a]) == [0]  # a's pin by `session` was released in order
        other.complete_load([a])


def test_queued_completions_flush_on_a_timer_and_at_close(daemon, pool_name):
    with Client(daemon.address) as client, Client(daemon.address) as other_client:
        session = client.open_session(pool_name, block_bytes=4096, queue_completions=True)
        other = other_client.open_session(pool_name, block_bytes=4096)
        with PoolEvents(other_client, pool_name) as events:
            session.prepare_store(keys_of("t"))
            session.complete_store(keys_of("t"))
            eventually(  # the short timer sends it
                lambda: other.lookup(keys_of("t")) == [HIT],
                30, "the queued completion sent", wake=events.wait,
            )  # fmt: skip
        session.prepare_store(keys_of("u"))
        session.complete_store(keys_of("u"))
        session.close()  # flushes first
        assert other.lookup(keys_of("u")) == [HIT]


def test_steady_state_steps_start_no_thread_per_queued_completion(daemon, pool_name):
    """Each step's call carries the previous step's completions; the flush deadline
    must not cost a thread start per step (``Thread.start`` waits for the new thread
    to run: milliseconds on a loaded machine, on the caller's critical path)."""
    started = []  # one entry per thread started (thread idents get reused: not a set)
    seen = threading.local()

    def count_new_threads(frame, event, arg):  # noqa: ANN001, ANN202 (trace hook)
        if not getattr(seen, "counted", False):
            seen.counted = True
            started.append(threading.current_thread().name)

    with Client(daemon.address) as client:
        session = client.open_session(
            pool_name, block_bytes=4096, num_blocks=4, queue_completions=True
        )
        threading.settrace(count_new_threads)  # runs first in every thread started later
        try:
            for step in range(50):
                key = keys_of(f"s{step}")
                session.prepare_store(key)  # carries the previous step's completion
                session.complete_store(key)  # queued
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
        assert session.rpcs == 50
        assert len(started) <= 1, f"{len(started)} threads started for 50 steps"
        session.close()


def test_flush_deadline_thread_exits_when_idle_and_comes_back(daemon, pool_name, monkeypatch):
    monkeypatch.setattr(flusher, "IDLE_EXIT", 0.05)
    with Client(daemon.address) as client, Client(daemon.address) as other_client:
        session = client.open_session(pool_name, block_bytes=4096, queue_completions=True)
        other = other_client.open_session(pool_name, block_bytes=4096)
        name = f"kvtierd-flush-{session.session_id[:12]}"

        def flush_threads() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t.name == name]

        def join_flush_threads(seconds: float) -> None:
            for thread in flush_threads():
                thread.join(seconds)

        for key in keys_of("i1", "i2"):
            with PoolEvents(other_client, pool_name) as events:
                session.prepare_store([key])
                session.complete_store([key])  # no carrier call: the deadline sends it
                eventually(
                    lambda key=key: other.lookup([key]) == [HIT],
                    30, "the queued completion sent", wake=events.wait,
                )  # fmt: skip
            eventually(  # idle: it exits
                lambda: not flush_threads(), 30, "the idle flush thread exited",
                wake=join_flush_threads,
            )  # fmt: skip
        session.close()


def test_lookup_and_pin_and_a_whole_step_in_one_round_trip(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(
            pool_name, block_bytes=4096, num_blocks=8, queue_completions=True
        )
        a, b, c, d = keys_of("a", "b", "c", "d")
        session.prepare_store([a, b, d])
        session.complete_store([a, b, d])  # queued
        results, block_ids = session.lookup_and_pin([a, b, c, d], prefix=True)
        assert results == [HIT, HIT, MISS, MISS] and block_ids == [0, 1, -1, -1]
        with pytest.raises(FailedPrecondition):  # pinned: a flush cannot take them
            session.prepare_load([c])
        assert client.flush_pool(pool_name) == 1  # only d was evictable
        session.rpcs = 0
        out = session.batch(
            [
                ("complete_load", [a, b], {}),
                ("prepare_store", [c], {}),
                ("lookup_and_pin", [a, c], {}),
                ("prepare_load", [d], {}),  # d was flushed: this one fails alone
            ]
        )
        assert session.rpcs == 1
        assert out[0] is None
        assert out[1].keys_to_store == [c]
        assert out[2] == ([HIT, PENDING], [0, -1])
        assert isinstance(out[3], FailedPrecondition)
        session.complete_load([a])
        session.complete_store([c])
        assert session.lookup([a, c]) == [HIT, HIT]
        assert client.flush_pool(pool_name) == 3  # no pin left behind
