"""The request handlers driven through the gRPC servicer, without a socket: each RPC
is awaited with a minimal context. Error mapping (one status code per error type, INTERNAL for a
bug), validation before any state changes (a refused call renews no lease),
explicit lease renewal on an injected clock, Batch's per-op results, TakeEvents
paging, and the TCP token check."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import pytest
from fake_clock import FakeClock

from kvtierd.api.grpc_service import GrpcService
from kvtierd.api.handlers import MAX_BATCH_OPS, TAKE_EVENTS_MAX_BYTES, RequestHandlers
from kvtierd.api.watch import WatchStreams
from kvtierd.config import load_config
from kvtierd.contract import LookupResult
from kvtierd.core.pools import PoolTable
from kvtierd.core.sessions import SessionTable
from kvtierd.records.events import EVENT_OVERHEAD_BYTES
from kvtierd.security.state import SecurityState
from kvtierd_client.wire.proto import pb2

_T = TypeVar("_T")
BLOCK = 4096
LEASE = 2.0
MAX_KEYS = 8192
UNIX_PEER = "unix:/run/kvtierd/kvtierd.sock"
TOKEN = "secret-0123456789abcdef"
HIT, MISS = int(LookupResult.HIT), int(LookupResult.MISS)


class Aborted(Exception):
    """What ``context.abort`` raises (grpc.aio raises its own AbortError)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses."""

    def __init__(self, peer: str = UNIX_PEER, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer = peer
        self._metadata = metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


@dataclasses.dataclass
class Daemon:
    """A servicer over real pool and session tables (regions under ``tmp_path``)."""

    service: GrpcService
    handlers: RequestHandlers
    sessions: SessionTable
    pools: PoolTable
    clock: FakeClock
    observed: list[tuple[str, str]]

    def call(self, method: str, request: Any, context: Context | None = None) -> Any:
        handler = getattr(self.service, method)
        return run(lambda: handler(request, context or Context()))

    def refused(self, method: str, request: Any, context: Context | None = None) -> Aborted:
        with pytest.raises(Aborted) as info:
            self.call(method, request, context)
        return info.value

    def open(self, pool: str = "p", num_blocks: int = 16) -> str:
        spec = pb2.PoolSpec(name=pool, block_bytes=BLOCK, num_blocks=num_blocks)
        return self.call("OpenSession", pb2.OpenSessionRequest(pool=spec)).session_id

    def store(self, session_id: str, keys: list[bytes]) -> None:
        self.call("PrepareStore", pb2.PrepareStoreRequest(session_id=session_id, keys=keys))
        request = pb2.CompleteStoreRequest(session_id=session_id, keys=keys, success=True)
        self.call("CompleteStore", request)


def run(scenario: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    return asyncio.run(scenario())


@pytest.fixture
def daemon(tmp_path) -> Iterator[Daemon]:
    defaults = load_config(env={})
    memory = dataclasses.replace(
        defaults.memory, shm_dir=str(tmp_path), budget=256 << 20, prefault=False,
        warm_restart=False,  # its journal's ready records land later: GetStats would move
    )  # fmt: skip
    clock = FakeClock()
    pools = PoolTable(memory, defaults.limits, gid=None)
    sessions = SessionTable(LEASE, 16, clock=clock)
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    security = SecurityState((), str(tokens), max_ticket_holders=16)
    observed: list[tuple[str, str]] = []
    handlers = RequestHandlers(
        pools,
        sessions,
        security,
        max_keys_per_call=MAX_KEYS,
        observe=lambda method, code, seconds: observed.append((method, code)),
    )
    service = GrpcService(handlers, security, WatchStreams(64, 10.0))
    yield Daemon(service, handlers, sessions, pools, clock, observed)
    sessions.close_all("test over")
    run(lambda: pools.close_all(wait_for_creations=1.0))


def test_open_session_answers_the_region_the_lease_and_the_pool(daemon):
    spec = pb2.PoolSpec(name="p", block_bytes=BLOCK, num_blocks=16, layout="L")
    response = daemon.call("OpenSession", pb2.OpenSessionRequest(pool=spec, client_name="c"))
    assert response.lease_ms == 2000
    assert (response.region.num_blocks, response.region.block_bytes) == (16, BLOCK)
    assert response.pool == pb2.PoolSpec(
        name="p", block_bytes=BLOCK, num_blocks=16, layout="L", eviction_policy="lru"
    )
    assert daemon.sessions.get(response.session_id).client_name == "c"
    assert daemon.observed == [("OpenSession", "OK")]


@pytest.mark.parametrize(
    ("method", "request_", "code", "message"),
    [
        ("KeepAlive", pb2.KeepAliveRequest(session_id="gone"), "NOT_FOUND", "is unknown"),
        ("Lookup", pb2.LookupRequest(session_id="gone", keys=[b"a"]), "NOT_FOUND", "session"),
        ("CloseSession", pb2.CloseSessionRequest(session_id="gone"), "NOT_FOUND", "session"),
        ("GetStats", pb2.GetStatsRequest(pool="nope"), "NOT_FOUND", "known pools"),
        ("FlushPool", pb2.FlushPoolRequest(pool=""), "INVALID_ARGUMENT", "pool"),
        ("Explain", pb2.ExplainRequest(pool="p", key=b""), "INVALID_ARGUMENT", "key"),
        (
            "OpenSession",
            pb2.OpenSessionRequest(pool=pb2.PoolSpec(name="p", block_bytes=100)),
            "INVALID_ARGUMENT",
            "block_bytes",
        ),
        (
            "OpenSession",
            pb2.OpenSessionRequest(pool=pb2.PoolSpec(name="p", block_bytes=BLOCK << 40)),
            "INVALID_ARGUMENT",
            "block_bytes",
        ),
    ],
)
def test_each_error_maps_to_its_status_code(daemon, method, request_, code, message):
    aborted = daemon.refused(method, request_)
    assert aborted.code.name == code and message in aborted.details
    assert daemon.observed == [(method, code)]


def test_key_validation_refuses_before_anything_changes(daemon):
    session = daemon.open()
    daemon.store(session, [b"a"])
    before = daemon.call("GetStats", pb2.GetStatsRequest(pool="p"))
    bad = [
        [b"a", b""],  # an empty key
        [b"a", b"x" * 257],  # a key over 256 bytes
        [b"a", b"a"],  # a key twice
        [b"k%d" % i for i in range(MAX_KEYS + 1)],  # too many keys
    ]
    for keys in bad:
        for method, request in (
            ("Lookup", pb2.LookupRequest(session_id=session, keys=keys, pin=True)),
            ("PrepareLoad", pb2.PrepareLoadRequest(session_id=session, keys=keys)),
            ("PrepareStore", pb2.PrepareStoreRequest(session_id=session, keys=keys)),
        ):
            assert daemon.refused(method, request).code is grpc.StatusCode.INVALID_ARGUMENT
    after = daemon.call("GetStats", pb2.GetStatsRequest(pool="p"))
    after.uptime_seconds = before.uptime_seconds
    assert after == before


def test_a_pool_refusal_is_failed_precondition_and_changes_nothing(daemon):
    session = daemon.open()
    daemon.store(session, [b"a"])
    aborted = daemon.refused(
        "PrepareLoad", pb2.PrepareLoadRequest(session_id=session, keys=[b"a", b"b"])
    )
    assert aborted.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "is MISS, not HIT" in aborted.details
    aborted = daemon.refused(
        "CompleteLoad", pb2.CompleteLoadRequest(session_id=session, keys=[b"a"])
    )
    assert "not pinned by this session" in aborted.details
    pool = daemon.pools.get("p")
    assert pool.manager.ref_count(b"a") == 0
    pool.check_invariants()


def test_a_bug_is_internal_logged_and_the_service_goes_on(daemon, monkeypatch, caplog):
    session = daemon.open()
    pool = daemon.pools.get("p")

    def broken(keys: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(pool, "touch", broken)
    with caplog.at_level(logging.ERROR, logger="kvtierd.api.handlers"):
        aborted = daemon.refused("Touch", pb2.TouchRequest(session_id=session, keys=[b"a"]))
    assert aborted.code is grpc.StatusCode.INTERNAL
    assert "internal error in Touch: RuntimeError: boom" in aborted.details
    assert "Touch failed with an internal error" in caplog.text
    monkeypatch.undo()
    daemon.call("Touch", pb2.TouchRequest(session_id=session, keys=[b"a"]))
    assert daemon.observed[-2:] == [("Touch", "INTERNAL"), ("Touch", "OK")]


def test_a_valid_call_renews_the_lease_and_a_refused_one_does_not(daemon):
    session_id = daemon.open()
    session = daemon.sessions.get(session_id)
    opened_until = session.expires_at
    daemon.clock.now += 1.5
    daemon.refused("Lookup", pb2.LookupRequest(session_id=session_id, keys=[b""]))
    assert session.expires_at == opened_until  # validation failed first: no renewal
    daemon.call("GetStats", pb2.GetStatsRequest())
    assert session.expires_at == opened_until  # not a call on the session
    daemon.call("Lookup", pb2.LookupRequest(session_id=session_id, keys=[b"a"]))
    assert session.expires_at == daemon.clock.now + LEASE
    daemon.clock.now += 1.5
    assert daemon.call("KeepAlive", pb2.KeepAliveRequest(session_id=session_id)).lease_ms == 2000
    assert session.expires_at == daemon.clock.now + LEASE
    daemon.clock.now += LEASE
    assert daemon.sessions.expire() == 1
    aborted = daemon.refused("KeepAlive", pb2.KeepAliveRequest(session_id=session_id))
    assert aborted.code is grpc.StatusCode.NOT_FOUND


def test_batch_answers_each_op_with_its_own_result_or_error(daemon):
    session = daemon.open()
    daemon.store(session, [b"a"])
    ops = [
        pb2.BatchOp(lookup=pb2.LookupRequest(keys=[b"a", b"b"])),
        pb2.BatchOp(prepare_load=pb2.PrepareLoadRequest(keys=[b"b"])),  # MISS: refused
        pb2.BatchOp(prepare_load=pb2.PrepareLoadRequest(keys=[b"a"])),
        pb2.BatchOp(complete_load=pb2.CompleteLoadRequest(keys=[b"a", b"a"])),  # a key twice
        pb2.BatchOp(complete_load=pb2.CompleteLoadRequest(keys=[b"a"])),
        pb2.BatchOp(touch=pb2.TouchRequest(session_id="another", keys=[b"a"])),
        pb2.BatchOp(),
    ]
    results = daemon.call("Batch", pb2.BatchRequest(session_id=session, ops=ops)).results
    assert list(results[0].lookup.results) == [HIT, MISS]
    assert results[1].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert len(results[2].prepare_load.block_ids) == 1
    assert results[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert results[4].WhichOneof("result") == "complete_load"
    assert "is not the batch's session" in results[5].error
    assert "no call set" in results[6].error
    assert daemon.pools.get("p").manager.ref_count(b"a") == 0


def test_batch_limits_its_ops_and_its_keys(daemon):
    session = daemon.open()
    many_ops = [pb2.BatchOp(touch=pb2.TouchRequest(keys=[b"a"]))] * (MAX_BATCH_OPS + 1)
    aborted = daemon.refused("Batch", pb2.BatchRequest(session_id=session, ops=many_ops))
    assert aborted.code is grpc.StatusCode.INVALID_ARGUMENT and "operations" in aborted.details
    keys = [b"k%d" % i for i in range(MAX_KEYS)]
    three_calls = [pb2.BatchOp(touch=pb2.TouchRequest(keys=keys))] * 3
    aborted = daemon.refused("Batch", pb2.BatchRequest(session_id=session, ops=three_calls))
    assert f"at most {2 * MAX_KEYS}" in aborted.details


def test_take_events_pages_and_keeps_one_cursor_per_session(daemon):
    """Scenario: 4096 stored keys of 256 bytes (over 1 MiB of events, split into
    events of at most 64 KiB); the first answer stops at about 1 MiB and says more
    follow; the next answer takes the rest; another session's cursor is its own."""
    writer = daemon.open(num_blocks=4096)
    reader = daemon.open(num_blocks=4096)
    keys = [i.to_bytes(2, "big") * 128 for i in range(4096)]
    daemon.store(writer, keys)
    first = daemon.call("TakeEvents", pb2.TakeEventsRequest(session_id=writer))
    assert first.more and first.dropped == 0
    rest = daemon.call("TakeEvents", pb2.TakeEventsRequest(session_id=writer))
    assert not rest.more
    # the first answer holds as many events as fit 1 MiB: one more would not
    first_bytes = sum(map(counted_bytes, first.events))
    assert first_bytes <= TAKE_EVENTS_MAX_BYTES < first_bytes + counted_bytes(rest.events[0])
    taken = [k for answer in (first, rest) for e in answer.events for k in e.keys]
    assert taken == keys
    seqs = [e.seq for answer in (first, rest) for e in answer.events]
    assert seqs == list(range(1, len(seqs) + 1))
    again = daemon.call("TakeEvents", pb2.TakeEventsRequest(session_id=writer))
    assert (list(again.events), again.more) == ([], False)
    from_reader = daemon.call("TakeEvents", pb2.TakeEventsRequest(session_id=reader))
    assert [e.seq for e in from_reader.events] == [e.seq for e in first.events]


def counted_bytes(event: pb2.Event) -> int:
    """What an event counts against the answer's byte limit (kvtierd.records.events)."""
    return pb2.Event(keys=event.keys).ByteSize() + EVENT_OVERHEAD_BYTES  # its keys packed


def test_tcp_peers_need_the_token_and_unix_peers_do_not(daemon):
    tcp = "ipv4:127.0.0.1:5000"
    request = pb2.GetStatsRequest()
    aborted = daemon.refused("GetStats", request, Context(peer=tcp))
    assert aborted.code is grpc.StatusCode.UNAUTHENTICATED
    wrong = Context(peer=tcp, metadata=(("authorization", "Bearer nope"),))
    assert daemon.refused("GetStats", request, wrong).code is grpc.StatusCode.UNAUTHENTICATED
    right = Context(peer=tcp, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert daemon.call("GetStats", request, right).version
    assert daemon.call("GetStats", request).version  # the Unix socket's peer


def test_a_daemon_shutting_down_answers_unavailable(daemon):
    session = daemon.open()
    daemon.handlers.stop_accepting()
    aborted = daemon.refused("KeepAlive", pb2.KeepAliveRequest(session_id=session))
    assert aborted.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in aborted.details
