"""Every buffer of the daemon is bounded in bytes (issue #15): the event log, each
WatchEvents stream, the number of streams and the size of a request (the RSS under
a churn of new long keys: tests/integration/core/test_memory_bounds.py). Real
daemon, real socket."""

from __future__ import annotations

import grpc
import pytest
from daemon_harness import eventually
from raw_calls import first_seq_or_code, long_keys, open_session, read_until_error, store

from kvtierd_client.wire.proto import pb2, pb2_grpc

# ----------------------------------------------------------------- event log


def test_event_log_byte_limit_drops_events_like_the_count_limit(make_daemon, pool_name):
    """Scenario: a 64 KiB event log and one CompleteStore of 1,000 200-byte keys
    (~240 KB of events, split into 64 KiB parts): the oldest parts go at once.
    TakeEvents reports them as dropped, a stream that was behind ends with
    OUT_OF_RANGE naming the byte limit, and a resume from the oldest kept works."""
    daemon = make_daemon("--events-retained-bytes", "64KiB")
    stub = daemon.stub()
    session = open_session(stub, pool_name, 2048)
    stream = stub.WatchEvents(pb2.WatchEventsRequest(pool=pool_name, after_seq=-1), timeout=10)
    store(stub, session, [b"%0200d" % i for i in range(1000)])
    taken = stub.TakeEvents(pb2.TakeEventsRequest(session_id=session))
    assert taken.dropped > 0
    kept_keys = sum(len(event.keys) for event in taken.events)
    assert 0 < kept_keys < 1000 and taken.events[-1].keys[-1] == b"%0200d" % 999
    _, error = read_until_error(stream)
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "events_retained_bytes" in error.details()
    oldest = taken.events[0].seq
    resumed = stub.WatchEvents(
        pb2.WatchEventsRequest(pool=pool_name, after_seq=oldest - 1), timeout=10
    )
    assert next(resumed).seq == oldest
    resumed.cancel()


# ----------------------------------------------------------------- WatchEvents


def test_a_stream_whose_client_does_not_read_ends_with_out_of_range(make_daemon, pool_name):
    """Scenario: one stream is never read while ~4 MB of events are stored, another
    is read. The unread one ends within limits.watch_write_timeout (the daemon
    logs it); read later, it yields every event it was sent, in order, then
    OUT_OF_RANGE saying to resume after the last seq received. The read stream
    got every event.

    The unread stream's channel does not probe bandwidth-delay, so its client
    does not grow the stream's 64 KiB flow-control window to megabytes: the
    daemon's write waits after a few events, as for any client that stops
    reading once its window is full."""
    daemon = make_daemon("--watch-write-timeout", "300ms")
    stub = daemon.stub()
    session = open_session(stub, pool_name, 16384)
    unprobed = grpc.insecure_channel(daemon.target, options=[("grpc.http2.bdp_probe", 0)])
    idle = pb2_grpc.KVTierStub(unprobed).WatchEvents(
        pb2.WatchEventsRequest(pool=pool_name, after_seq=0)
    )
    reader = stub.WatchEvents(pb2.WatchEventsRequest(pool=pool_name, after_seq=0), timeout=30)
    for n in range(16):
        store(stub, session, long_keys(n * 1000, 1000))
    last = stub.GetStats(pb2.GetStatsRequest(pool=pool_name)).pools[0].last_event_seq
    seqs = [event.seq for _, event in zip(range(last), reader, strict=False)]
    assert seqs == list(range(1, last + 1))
    reader.cancel()
    eventually(lambda: "not taken within 0.3s" in daemon.log(), 30, "the write timeout logged")
    received, error = read_until_error(idle)
    unprobed.close()
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "limits.watch_write_timeout" in error.details()
    assert "resume from after_seq" in error.details()
    assert received == list(range(1, len(received) + 1)) and len(received) < last


def test_watch_streams_beyond_the_limit_are_refused_until_one_ends(make_daemon, pool_name):
    """Scenario: with limits.max_watch_streams = 2, a third stream gets
    RESOURCE_EXHAUSTED naming the limit and changes nothing; once a stream is
    cancelled its slot is free again."""
    daemon = make_daemon("--max-watch-streams", "2")
    stub = daemon.stub()
    session = open_session(stub, pool_name, 16)
    store(stub, session, [b"k"])

    def watch() -> grpc.Call:
        return stub.WatchEvents(pb2.WatchEventsRequest(pool=pool_name, after_seq=0), timeout=10)

    streams = [watch(), watch()]
    assert [next(stream).seq for stream in streams] == [1, 1]  # both are served
    with pytest.raises(grpc.RpcError) as error:
        next(watch())
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_watch_streams" in error.value.details()
    streams[0].cancel()

    def served() -> grpc.Call | None:
        stream = watch()
        answer = first_seq_or_code(stream)
        if answer == 1:
            return stream
        assert answer == grpc.StatusCode.RESOURCE_EXHAUSTED
        return None

    # the daemon learns of the cancellation asynchronously
    stream = eventually(served, 30, "the cancelled stream's slot freed")
    stream.cancel()
    streams[1].cancel()


# ----------------------------------------------------------------- request size


def test_a_request_over_the_receive_limit_is_refused_before_it_is_parsed(make_daemon, pool_name):
    """Scenario: with limits.max_keys_per_call = 1024 the daemon reads requests of
    at most ~1.5 MiB (a Batch of two calls of 1,024 256-byte keys, plus 1 MiB).
    4 MiB of garbage gets RESOURCE_EXHAUSTED from gRPC (parsed, it would fail to
    decode), so does a well-formed 4 MiB Lookup; a request under the size limit
    but over the key limit is parsed and refused with INVALID_ARGUMENT; the
    daemon keeps serving."""
    daemon = make_daemon("--max-keys-per-call", "1024")
    stub = daemon.stub()
    session = open_session(stub, pool_name, 16)
    with grpc.insecure_channel(daemon.target) as channel:
        raw_lookup = channel.unary_unary("/kvtier.v1.KVTier/Lookup")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as garbage:
            raw_lookup(b"\xff" * (4 << 20), timeout=10)
    assert garbage.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    huge = pb2.LookupRequest(session_id=session, keys=long_keys(0, 16384))
    with pytest.raises(grpc.RpcError) as too_big:
        stub.Lookup(huge, timeout=10)
    assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as too_many:
        stub.Lookup(pb2.LookupRequest(session_id=session, keys=long_keys(0, 2048)), timeout=10)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limits.max_keys_per_call" in too_many.value.details()
    answer = stub.Lookup(pb2.LookupRequest(session_id=session, keys=long_keys(0, 1024)))
    assert set(answer.results) == {pb2.LOOKUP_RESULT_MISS}
