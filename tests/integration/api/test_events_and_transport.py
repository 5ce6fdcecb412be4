"""WatchEvents streams and resumes by seq; TakeEvents cursors are per session;
TCP requires a bearer token; the asyncio client works against the real daemon."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import grpc
import pytest
from daemon_harness import start_daemon

from kvtierd_client.aio import AsyncClient
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import OutOfRange, Unauthenticated
from kvtierd_client.wire.proto import pb2, pb2_grpc


def store(session, *keys: bytes) -> None:
    grant = session.prepare_store(list(keys))
    session.complete_store(grant.keys_to_store)


def test_watch_events_streams_and_resumes(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=2)
        store(session, b"a", b"b")
        store(session, b"c")  # evicts a: removed event, then stored event
        with client.watch_events(pool_name, after_seq=0, timeout=10) as stream:
            first = [next(stream) for _ in range(3)]
        assert [(e.seq, e.removed, list(e.keys)) for e in first] == [
            (1, False, [b"a", b"b"]), (2, True, [b"a"]), (3, False, [b"c"]),
        ]  # fmt: skip
        # resume after seq 2: only what came later, then live events as they happen
        with client.watch_events(pool_name, after_seq=2, timeout=10) as stream:
            assert next(stream).seq == 3
            store(session, b"d")
            live = [next(stream), next(stream)]
        assert [(e.seq, e.removed) for e in live] == [(4, True), (5, False)]
        assert all(e.tier == "primary" for e in first + live)


def test_take_events_cursor_is_per_session(daemon, pool_name):
    with Client(daemon.address) as client:
        one = client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        store(one, b"x")
        two = client.open_session(pool_name, block_bytes=4096)  # opened after x: sees later only
        store(one, b"y")
        assert [list(e.keys) for e in one.take_events()] == [[b"x"], [b"y"]]
        assert [list(e.keys) for e in two.take_events()] == [[b"y"]]
        assert one.take_events() == [] and two.take_events() == []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tcp_requires_bearer_token(tmp_path):
    token = "t0ken-for-tests-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# kvtierd tokens\n{token}\n")
    os.chmod(tokens, 0o600)
    port = _free_port()
    workdir_socket = tmp_path / "s.sock"
    daemon = start_daemon(
        "--tokens-file", str(tokens), "--listen", f"127.0.0.1:{port}",
        "--listen", f"unix://{workdir_socket}",
    )  # fmt: skip
    try:
        with Client(f"127.0.0.1:{port}") as anonymous, pytest.raises(Unauthenticated):
            anonymous.get_stats()
        wrong = Client(f"127.0.0.1:{port}", token="wrong-token-0123456789")
        with wrong, pytest.raises(Unauthenticated):
            wrong.get_stats()
        with Client(f"127.0.0.1:{port}", token=token) as client:
            session = client.open_session("tcp-pool", block_bytes=4096, num_blocks=2)
            store(session, b"k")
            assert session.lookup([b"k"]) == [LookupResult.HIT]
        # the unix socket is trusted by file permissions: no token needed
        with grpc.insecure_channel(f"unix:{workdir_socket}") as channel:
            stats = pb2_grpc.KVTierStub(channel).GetStats(pb2.GetStatsRequest(), timeout=5)
        assert [p.name for p in stats.pools] == ["tcp-pool"]
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def test_tokens_file_readable_by_others_is_refused(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("a-long-enough-token-123\n")
    os.chmod(tokens, 0o644)
    daemon = start_daemon("--tokens-file", str(tokens), wait=False)
    try:
        assert daemon.proc.wait(30) == 2
        assert "security.tokens_file" in daemon.log() and "others" in daemon.log()
    finally:
        daemon.cleanup()


def test_async_client_round_trip(daemon, pool_name):
    async def scenario() -> list[LookupResult]:
        client = AsyncClient(daemon.address)
        try:
            session = await client.open_session(pool_name, block_bytes=4096, num_blocks=4)
            grant = await session.prepare_store([b"p", b"q"])
            assert grant.block_ids == [0, 1]
            await session.complete_store(grant.keys_to_store)
            ids = await session.prepare_load([b"q"])
            assert ids == [1]
            await session.complete_load([b"q"])
            results = await session.lookup([b"p", b"q", b"r"])
            await session.close()
            return results
        finally:
            await client.close()

    assert asyncio.run(scenario()) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def test_watch_events_never_skips_events_appended_while_sending(daemon, pool_name):
    """Events appended while the stream waits on the transport are sent later, in
    order: the stream's seqs are consecutive."""
    with Client(daemon.address) as client:
        sessions = [
            client.open_session(pool_name, block_bytes=4096, num_blocks=512) for _ in range(3)
        ]

        def storm(n: int) -> None:
            for i in range(100):
                store(sessions[n], b"w%d-%d" % (n, i))

        # from the log's last seq, not -1 ("new events only"): the stream may reach the
        # daemon after the writers' first stores on a busy machine
        last = client.get_stats(pool_name).pools[0].last_event_seq
        with client.watch_events(pool_name, after_seq=last, timeout=120) as stream:
            writers = [threading.Thread(target=storm, args=(n,)) for n in range(3)]
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
            seqs = [next(stream).seq for _ in range(300)]
    assert seqs == list(range(last + 1, last + 301))


def test_watch_events_that_falls_behind_the_log_ends_with_out_of_range(pool_name):
    """A stream whose unsent events the bounded log dropped ends with OUT_OF_RANGE
    naming where to resume, instead of skipping the gap."""
    daemon = start_daemon("--events-retained", "16")
    try:
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=8192)
            stream = client.watch_events(pool_name, after_seq=-1, timeout=60)
            keys = [b"%0200d" % i for i in range(60 * 1000)]  # 60 events of 200 KB each
            for i in range(0, len(keys), 1000):
                store(session, *keys[i : i + 1000])
            with pytest.raises(OutOfRange, match="fell .* behind"):
                for _ in stream:  # what was sent before the gap, then the error
                    pass
            stream.cancel()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
