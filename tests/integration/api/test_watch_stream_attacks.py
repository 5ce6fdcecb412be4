"""WatchEvents streams whose clients stay connected and never read (issue #33 item 4).

A stream ended for not reading (``limits.watch_write_timeout``) kept its place among
``limits.max_watch_streams`` until its client read or disconnected: gRPC queues the
end behind the message the client does not take, and the handler waited for it. So
``max_watch_streams`` clients that connected and never read refused WatchEvents to
everyone, for as long as they stayed (a strict xfail since issue #15's attack pass).

Now a stream being ended gives its place back at once and counts as *unread* until
its end is read or its client goes; each principal may leave
``limits.max_unread_watch_streams`` of those (they hold gRPC's copy of their last
event), then its own new streams are refused, nobody else's. Real daemon, real
sockets, real principals (tokens over TCP).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from daemon_harness import DaemonProcess, eventually, free_port, start_daemon
from raw_calls import first_seq_or_code, long_keys, open_session, store
from users_harness import principals_toml

from kvtierd_client.wire.proto import pb2, pb2_grpc

Metadata = tuple[tuple[str, str], ...]


class IdleClient:
    """A client that opens a WatchEvents stream from the first event and never reads
    it, nor leaves (until :meth:`close`); its channel does not probe bandwidth-delay,
    so its window stays 64 KiB and the daemon's writes soon wait."""

    def __init__(self, target: str, pool: str, metadata: Metadata = ()) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
        request = pb2.WatchEventsRequest(pool=pool, after_seq=0)
        # kept: a call object collected is a call cancelled
        self.call = pb2_grpc.KVTierStub(self.channel).WatchEvents(request, metadata=metadata)

    def close(self) -> None:
        self.channel.close()


def ended_for_not_reading(daemon: DaemonProcess, count: int) -> None:
    eventually(
        lambda: daemon.log().count("not taken within") >= count,
        20, f"{count} idle streams ended with OUT_OF_RANGE",
    )  # fmt: skip


def test_clients_that_connect_and_never_read_cannot_keep_other_readers_out(make_daemon, pool_name):
    """Scenario: limits.max_watch_streams = 2; two clients open a stream each, never
    read and stay connected; 16,000 long keys are stored. Both streams end for not
    reading; at once a third reader is served, and the idle ones still get their
    events and the end when they read. Before: refused RESOURCE_EXHAUSTED until an
    idle client left (the test waited five write timeouts more)."""
    daemon = make_daemon("--max-watch-streams", "2", "--watch-write-timeout", "200ms")
    stub = daemon.stub()
    session = open_session(stub, pool_name, 16384)
    idle = [IdleClient(daemon.target, pool_name) for _ in range(2)]
    try:
        for n in range(16):
            store(stub, session, long_keys(n * 1000, 1000))
        ended_for_not_reading(daemon, 2)
        stream = stub.WatchEvents(pb2.WatchEventsRequest(pool=pool_name, after_seq=0), timeout=5)
        assert first_seq_or_code(stream) == 1, "a reader that comes later is served"
        stream.cancel()
    finally:
        for client in idle:
            client.close()


def test_a_client_that_leaves_unread_streams_is_refused_more_than_its_limit(make_daemon, pool_name):
    """Scenario: limits.max_unread_watch_streams = 2 and room for 8 open streams;
    two idle streams end for not reading. A third stream of the same (local)
    principal is refused with RESOURCE_EXHAUSTED naming the limit, so what ended
    streams hold stays bounded; once one idle client leaves, new streams are served
    again."""
    daemon = make_daemon(
        "--max-watch-streams", "8", "--max-unread-watch-streams", "2",
        "--watch-write-timeout", "200ms",
    )  # fmt: skip
    stub = daemon.stub()
    session = open_session(stub, pool_name, 16384)
    idle = [IdleClient(daemon.target, pool_name) for _ in range(2)]
    try:
        for n in range(16):
            store(stub, session, long_keys(n * 1000, 1000))
        ended_for_not_reading(daemon, 2)
        refused = stub.WatchEvents(pb2.WatchEventsRequest(pool=pool_name, after_seq=0), timeout=5)
        with pytest.raises(grpc.RpcError) as error:
            next(refused)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_unread_watch_streams" in error.value.details()
        idle.pop().close()

        def served() -> bool:
            stream = stub.WatchEvents(
                pb2.WatchEventsRequest(pool=pool_name, after_seq=0), timeout=5
            )
            answer = first_seq_or_code(stream)
            stream.cancel()
            assert answer in (1, grpc.StatusCode.RESOURCE_EXHAUSTED), answer
            return answer == 1

        # the daemon learns of the client's leaving asynchronously
        eventually(served, 30, "a stream served once an idle client left")
    finally:
        for client in idle:
            client.close()


@pytest.fixture
def two_token_principals(tmp_path) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon on TCP too, with principals team-a (pools a/*) and team-b (b/*) by
    token and a bare token reaching every pool; one unread ended stream allowed
    per principal. Yields the daemon and its TCP target."""
    tokens = tmp_path / "tokens"
    tokens.write_text("team-a-token-0123456789 team-a\nteam-b-token-0123456789 team-b\n"
                      "bare-token-0123456789abc\n")  # fmt: skip
    os.chmod(tokens, 0o600)
    config = principals_toml(
        {"name": "admin", "uids": [0], "pools": ["*"]},
        {"name": "team-a", "pools": ["a/*"]},
        {"name": "team-b", "pools": ["b/*"]},
    )
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(
        "--tokens-file", str(tokens), "--listen", address, "--max-watch-streams", "8",
        "--max-unread-watch-streams", "1", "--watch-write-timeout", "200ms",
        "--memory-budget", "256MiB", config=config,
    )  # fmt: skip
    try:
        yield daemon, address
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def test_one_principals_unread_streams_do_not_refuse_another_principals(two_token_principals):
    """Scenario: team-a leaves an idle stream that ends for not reading (its limit
    of unread ended streams: 1). team-a's next stream is refused naming the limit
    and its principal; team-b's stream is served."""
    daemon, address = two_token_principals
    admin = grpc.insecure_channel(address)
    stub = pb2_grpc.KVTierStub(admin)
    every_pool = bearer("bare-token-0123456789abc")

    def session_of(pool: str) -> str:
        spec = pb2.PoolSpec(name=pool, block_bytes=4096, num_blocks=16384)
        request = pb2.OpenSessionRequest(pool=spec)
        return stub.OpenSession(request, metadata=every_pool).session_id

    def stored(session: str, start: int, count: int) -> None:
        grant = stub.PrepareStore(
            pb2.PrepareStoreRequest(session_id=session, keys=long_keys(start, count)),
            metadata=every_pool,
        )
        stub.CompleteStore(
            pb2.CompleteStoreRequest(session_id=session, keys=grant.keys_to_store, success=True),
            metadata=every_pool,
        )

    def watch(pool: str, token: str) -> int | grpc.StatusCode | str:
        stream = stub.WatchEvents(
            pb2.WatchEventsRequest(pool=pool, after_seq=0), timeout=5, metadata=bearer(token)
        )
        try:
            return next(stream).seq
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        finally:
            stream.cancel()

    a_session, b_session = session_of("a/p"), session_of("b/p")
    idle = IdleClient(address, "a/p", bearer("team-a-token-0123456789"))
    try:
        for n in range(16):
            stored(a_session, n * 1000, 1000)
        ended_for_not_reading(daemon, 1)
        stored(b_session, 0, 1)
        refused = watch("a/p", "team-a-token-0123456789")
        assert isinstance(refused, str) and refused.startswith("RESOURCE_EXHAUSTED"), refused
        assert "'team-a'" in refused and "limits.max_unread_watch_streams" in refused
        assert watch("b/p", "team-b-token-0123456789") == 1
    finally:
        idle.close()
        admin.close()
