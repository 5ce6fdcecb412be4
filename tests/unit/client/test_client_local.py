"""The client without a daemon: addresses, error mapping, codec, keepalive over fake stubs."""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import re
import threading
import time
import traceback
from typing import Any

import grpc
import pytest

from kvtierd_client._rpc.connection import OPEN_SESSION_TIMEOUT
from kvtierd_client.aio import AsyncClient
from kvtierd_client.client import Client, LookupResult, StoreResult
from kvtierd_client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvtierError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from kvtierd_client.wire import address as address_mod
from kvtierd_client.wire.address import (
    default_address,
    default_runtime_dir,
    default_socket_path,
    to_grpc_target,
)
from kvtierd_client.wire.proto import pb2

# -- addresses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("unix:///run/kvtierd/kvtierd.sock", "unix:/run/kvtierd/kvtierd.sock"),
        ("unix:/run/kvtierd/kvtierd.sock", "unix:/run/kvtierd/kvtierd.sock"),
        ("/tmp/k.sock", "unix:/tmp/k.sock"),
        ("  /tmp/k.sock ", "unix:/tmp/k.sock"),
        ("/tmp/with:colon.sock", "unix:/tmp/with:colon.sock"),
        ("localhost:50051", "localhost:50051"),
        ("127.0.0.1:1", "127.0.0.1:1"),
        ("kvtierd.svc.cluster.local:65535", "kvtierd.svc.cluster.local:65535"),
        ("my_host:9000", "my_host:9000"),
        ("[::1]:7000", "[::1]:7000"),
        ("[fe80::1%eth0]:7000", "[fe80::1%eth0]:7000"),
        ("tls://kvtier.example:7070", "kvtier.example:7070"),
        ("tls://[::1]:7000", "[::1]:7000"),
    ],
)
def test_to_grpc_target_accepts(address, target):
    assert to_grpc_target(address) == target


@pytest.mark.parametrize(
    "address",
    [
        "", "   ", "kvtierd.sock", "./kvtierd.sock", "~/kvtierd.sock", "/", "unix:", "unix:/",
        "unix:///", "unix:relative.sock", "unix://host/tmp/k.sock", "unix://tmp/k.sock",
        "localhost", "localhost:", ":50051", "localhost:0", "localhost:65536", "host:port",
        "::1:7000", "[::1]", "[::1]:", "http://localhost:80", "tcp://localhost:80",
        "dns:///localhost:80", "two words:80", "-bad:80", None, 8080, "tls://", "tls:///x.sock",
        "tls://unix:/x.sock", "tls://localhost", "tls://localhost:0",
    ],
)  # fmt: skip
def test_to_grpc_target_rejects(address):
    with pytest.raises(ValueError, match=r"invalid kvtierd address.*unix:///abs/path.*host:port"):
        to_grpc_target(address)


def test_runtime_dir_for_root(monkeypatch):
    monkeypatch.setattr(address_mod.os, "geteuid", lambda: 0)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    assert default_runtime_dir() == "/run/kvtierd"
    assert default_socket_path() == "/run/kvtierd/kvtierd.sock"


def test_runtime_dir_for_users(monkeypatch):
    monkeypatch.setattr(address_mod.os, "geteuid", lambda: 1234)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_runtime_dir() == "/run/user/1234/kvtierd"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert default_runtime_dir() == "/tmp/kvtierd-1234"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_runtime_dir() == "/tmp/kvtierd-1234"
    assert default_socket_path() == "/tmp/kvtierd-1234/kvtierd.sock"


def test_default_address(monkeypatch):
    monkeypatch.setattr(address_mod.os, "geteuid", lambda: 1234)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("KVTIERD_ADDRESS", raising=False)
    assert default_address() == "unix:///tmp/kvtierd-1234/kvtierd.sock"
    assert to_grpc_target(default_address()) == "unix:/tmp/kvtierd-1234/kvtierd.sock"
    monkeypatch.setenv("KVTIERD_ADDRESS", "localhost:7000")
    assert default_address() == "localhost:7000"
    assert Client().address == "localhost:7000"


def test_client_rejects_bad_address():
    with pytest.raises(ValueError, match="invalid kvtierd address"):
        Client("not an address")


# -- error mapping ---------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self.status, self.message = code, details

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.INTERNAL, Internal),
        (grpc.StatusCode.UNKNOWN, KvtierError),
        (grpc.StatusCode.OUT_OF_RANGE, OutOfRange),
        (grpc.StatusCode.ABORTED, KvtierError),
    ],
)
def test_from_rpc_error_maps_codes(code, cls):
    err = from_rpc_error(FakeRpcError(code, "key 0 is empty"), "unix:///x.sock")
    assert type(err) is cls
    assert isinstance(err, KvtierError) and not isinstance(err, grpc.RpcError)
    assert err.code is code
    assert str(err) == f"{code.name}: {err.details}"
    assert "key 0 is empty" in err.details
    assert err.address == "unix:///x.sock"


def test_daemon_messages_are_kept_as_is():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "pool mismatch"), "a")
    assert str(err) == "FAILED_PRECONDITION: pool mismatch"


def test_unavailable_names_the_address():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"), "/s.sock")
    assert "/s.sock" in str(err)
    assert "not running" in str(err) and "socket is not accessible" in str(err)
    assert "connect failed" in str(err)


def test_deadline_names_the_address():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline"), "h:1")
    assert isinstance(err, DeadlineExceeded) and "h:1" in str(err)


def test_rpc_error_without_code():
    err = from_rpc_error(grpc.RpcError("boom"), "a")
    assert type(err) is KvtierError and err.code is grpc.StatusCode.UNKNOWN


def test_errors_pickle():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.OUT_OF_RANGE, "far"), "addr")
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.code, again.details, again.address) == (
        OutOfRange, grpc.StatusCode.OUT_OF_RANGE, "far", "addr",
    )  # fmt: skip
    assert str(pickle.loads(pickle.dumps(NotFound("gone")))) == "NOT_FOUND: gone"


def test_missing_socket_is_unavailable(tmp_path):
    path = str(tmp_path / "absent" / "kvtierd.sock")
    with Client(path, timeout=2.0) as client:
        with pytest.raises(Unavailable, match="not running") as info:
            client.get_stats()
        assert path in str(info.value)
        with pytest.raises(Unavailable, match=re.escape(path)):
            client.open_session("p", block_bytes=4096)
        with pytest.raises(Unavailable, match=re.escape(path)), client.watch_events("p") as stream:
            next(stream)


def shown(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def test_an_unreachable_daemon_is_one_error_not_a_chain(tmp_path):
    """The client's error is shown alone: the gRPC error it stands for (30 lines of
    traceback before the clear last line) is kept as ``__context__``, not printed."""
    with Client(str(tmp_path / "absent" / "kvtierd.sock"), timeout=2.0) as client:
        with pytest.raises(Unavailable) as info:
            client.get_stats()
        with pytest.raises(Unavailable) as streamed, client.watch_events("p") as stream:
            next(stream)

    async def async_errors() -> list[BaseException]:
        async with AsyncClient(f"unix://{tmp_path}/absent/k.sock", timeout=2.0) as client:
            with pytest.raises(Unavailable) as answered:
                await client.get_stats()
            with pytest.raises(Unavailable) as streamed_async:
                async for _ in client.watch_events("p"):
                    pass
        return [answered.value, streamed_async.value]

    for error in (info.value, streamed.value, *asyncio.run(async_errors())):
        assert isinstance(error.__context__, grpc.RpcError)  # still there for a debugger
        assert "grpc" not in shown(error).replace("grpc.StatusCode", ""), shown(error)
        assert "direct cause" not in shown(error) and "During handling" not in shown(error)


def test_missing_socket_is_unavailable_async(tmp_path):
    path = "unix://" + str(tmp_path / "kvtierd.sock")

    async def main() -> None:
        async with AsyncClient(path, timeout=2.0) as client:
            with pytest.raises(Unavailable, match=re.escape(path)):
                await client.get_stats()
            with pytest.raises(Unavailable, match=re.escape(path)):
                async for _ in client.watch_events("p"):
                    pass

    asyncio.run(main())


def test_closed_client_raises_kvtier_error(tmp_path):
    client = Client(str(tmp_path / "k.sock"))
    client.close()
    client.close()
    with pytest.raises(KvtierError, match="client is closed"):
        client.get_stats()


# -- fake stubs ------------------------------------------------------------------------

SESSION = pb2.OpenSessionResponse(
    session_id="s-1",
    region=pb2.Region(path="/dev/shm/kvtierd-p", num_blocks=4, block_bytes=4096),
    lease_ms=30,
    pool=pb2.PoolSpec(name="p", block_bytes=4096, num_blocks=4, eviction_policy="lru"),
)


class FakeStub:
    """Answers like the daemon would; records every call with its keyword arguments.

    ``called`` is notified at every call: ``wait_until`` waits on it, no polling."""

    def __init__(self, lease_ms: int = 30) -> None:
        self.lease_ms = lease_ms
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.keepalive_errors: list[grpc.RpcError | None] = []  # None: answer normally
        self.lock = threading.RLock()
        self.called = threading.Condition(self.lock)

    def count(self, rpc: str) -> int:
        with self.lock:
            return sum(1 for name, _, _ in self.calls if name == rpc)

    def record(self, rpc: str, request: Any, kwargs: dict[str, Any]) -> None:
        with self.called:
            self.calls.append((rpc, request, kwargs))
            self.called.notify_all()

    def wait_until(self, predicate, timeout: float = 5.0) -> None:
        """Waits for calls until ``predicate()`` holds (checked at each call)."""
        with self.called:
            assert self.called.wait_for(predicate, timeout), "condition not reached in time"

    def OpenSession(self, request, **kwargs):  # noqa: N802
        self.record("OpenSession", request, kwargs)
        response = pb2.OpenSessionResponse()
        response.CopyFrom(SESSION)
        response.lease_ms = self.lease_ms
        return response

    def KeepAlive(self, request, **kwargs):  # noqa: N802
        self.record("KeepAlive", request, kwargs)
        with self.lock:
            error = self.keepalive_errors.pop(0) if self.keepalive_errors else None
        if error is not None:
            raise error
        return pb2.KeepAliveResponse(lease_ms=self.lease_ms)

    def CloseSession(self, request, **kwargs):  # noqa: N802
        self.record("CloseSession", request, kwargs)
        return pb2.CloseSessionResponse()

    def Lookup(self, request, **kwargs):  # noqa: N802
        self.record("Lookup", request, kwargs)
        return pb2.LookupResponse(results=[(len(k) % 4) + 1 for k in request.keys])

    def PrepareStore(self, request, **kwargs):  # noqa: N802
        self.record("PrepareStore", request, kwargs)
        if len(request.keys) > 2:
            return pb2.PrepareStoreResponse(accepted=False)
        return pb2.PrepareStoreResponse(
            accepted=True, keys_to_store=request.keys, block_ids=range(len(request.keys)),
            evicted_keys=[b"old"],
        )  # fmt: skip

    def GetStats(self, request, **kwargs):  # noqa: N802
        self.record("GetStats", request, kwargs)
        return pb2.GetStatsResponse(version="fake")


class AsyncFakeStub(FakeStub):
    """The same answers as coroutines, like a ``grpc.aio`` stub."""

    def __getattribute__(self, name: str) -> Any:
        method = super().__getattribute__(name)
        if not name[:1].isupper():
            return method

        async def call(request, **kwargs):
            return method(request, **kwargs)

        return call


def test_session_calls_encode_and_decode():
    stub = FakeStub()
    client = Client("/tmp/unused.sock", stub=stub, timeout=3.0, token="sekret")
    session = client.open_session("p", block_bytes=4096, keepalive=False)
    assert (session.session_id, session.lease_ms, session.pool.name) == ("s-1", 30, "p")
    assert session.region.path == "/dev/shm/kvtierd-p"

    results = session.lookup([b"a", bytearray(b"bb"), memoryview(b"ccc"), b"dddd"], "r-1")
    assert results == [LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY,
                       LookupResult.MISS]  # fmt: skip
    assert all(type(r) is LookupResult for r in results)
    assert session.prepare_store((b"k1", b"k2")) == StoreResult([b"k1", b"k2"], [0, 1], [b"old"])
    assert session.prepare_store([b"1", b"2", b"3"]) is None
    assert client.get_stats().version == "fake"

    for rpc, request, kwargs in stub.calls:
        # OpenSession waits at least OPEN_SESSION_TIMEOUT (a big pool's region creation)
        assert kwargs["timeout"] == (OPEN_SESSION_TIMEOUT if rpc == "OpenSession" else 3.0), rpc
        assert kwargs["metadata"] == (("authorization", "Bearer sekret"),), rpc
        if rpc not in ("OpenSession", "GetStats"):
            assert request.session_id == "s-1"
    open_request = stub.calls[0][1]
    assert (open_request.pool.name, open_request.pool.block_bytes) == ("p", 4096)
    assert stub.calls[1][1].request_id == "r-1"


@pytest.mark.parametrize("keys", [["text"], [b"ok", 3], b"single", "single"])
def test_keys_must_be_bytes(keys):
    session = Client("/tmp/unused.sock", stub=FakeStub()).open_session("p", 4096, keepalive=False)
    with pytest.raises(InvalidArgument, match="Lookup: .*bytes"):
        session.lookup(keys)


def test_out_of_range_fields_are_invalid_argument():
    client = Client("/tmp/unused.sock", stub=FakeStub())
    with pytest.raises(InvalidArgument, match="OpenSession"):
        client.open_session("p", block_bytes=4096, num_blocks=-1)


def test_keepalive_runs_every_third_of_the_lease_and_stops_on_close():
    stub = FakeStub(lease_ms=30)  # one KeepAlive every 10 ms
    client = Client("/tmp/unused.sock", stub=stub, timeout=3.0)
    session = client.open_session("p", block_bytes=4096)
    keepalive = session.keepalive
    assert keepalive is not None and keepalive.daemon
    started = time.monotonic()
    stub.wait_until(lambda: stub.count("KeepAlive") >= 5)
    assert time.monotonic() - started >= 0.04  # paced, not a busy loop
    deadlines = [kw["timeout"] for rpc, _, kw in stub.calls if rpc == "KeepAlive"]
    assert all(d <= 0.1 for d in deadlines)  # never longer than the interval (min 0.1 s)

    session.close()
    assert keepalive.join(1.0), "the keepalive thread outlived close()"
    after = stub.count("KeepAlive")
    stats = keepalive.statistics()
    assert not stats.running and stats.interval_s is None
    assert stats.renewals == after  # every KeepAlive that reached the daemon was answered
    assert stub.count("KeepAlive") == after  # its thread ended: no KeepAlive after close
    session.close()  # idempotent
    assert stub.count("CloseSession") == 1
    with pytest.raises(NotFound, match="closed"):
        session.lookup([b"k"])


def test_client_close_closes_its_sessions():
    stub = FakeStub(lease_ms=30)
    with Client("/tmp/unused.sock", stub=stub) as client:
        sessions = [client.open_session("p", block_bytes=4096) for _ in range(2)]
    assert stub.count("CloseSession") == 2
    for session in sessions:
        assert session.keepalive.join(1.0)
        assert not session.keepalive.statistics().running


def test_keepalive_not_found_expires_the_session(caplog):
    stub = FakeStub(lease_ms=30)
    stub.keepalive_errors.append(FakeRpcError(grpc.StatusCode.NOT_FOUND, "unknown session"))
    session = Client("/tmp/unused.sock", stub=stub).open_session("p", block_bytes=4096)
    assert session.keepalive.join(2.0)
    assert stub.count("KeepAlive") == 1
    assert session.keepalive.statistics().failures == 1
    assert session.closed
    with pytest.raises(NotFound, match="session expired or closed by the daemon"):
        session.lookup([b"k"])
    assert stub.count("Lookup") == 0
    session.close()  # nothing to close on the daemon
    assert stub.count("CloseSession") == 0
    assert "expired or closed by the daemon" in caplog.text


def test_keepalive_warns_once_per_failure_streak(caplog):
    caplog.set_level(logging.INFO, logger="kvtierd_client")
    stub = FakeStub(lease_ms=30)
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed")
    stub.keepalive_errors.extend([unavailable] * 3 + [None] + [unavailable] * 2)
    session = Client("/tmp/unused.sock", stub=stub).open_session("p", block_bytes=4096)
    stub.wait_until(lambda: stub.count("KeepAlive") >= 9)
    session.close()
    assert session.keepalive.join(1.0)
    stats = session.keepalive.statistics()
    assert (stats.failures, stats.failing) == (5, False)  # both streaks ended in a success
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # two streaks
    assert "s-1" in warnings[0].getMessage() and "UNAVAILABLE" in warnings[0].getMessage()
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_unreferenced_session_stops_its_keepalive():
    stub = FakeStub(lease_ms=30)
    client = Client("/tmp/unused.sock", stub=stub)
    session = client.open_session("p", block_bytes=4096)
    keepalive = session.keepalive
    del session
    gc.collect()
    assert keepalive.join(2.0), "a collected session's keepalive thread goes on"
    assert keepalive.statistics().interval_s is None


def test_event_stream_cancel_ends_iteration():
    class FakeCall:
        def __init__(self) -> None:
            self.cancelled = threading.Event()
            self.reading = threading.Event()  # a next() is blocked on the stream

        def __iter__(self):
            return self

        def __next__(self):
            self.reading.set()
            if self.cancelled.wait(5.0):
                raise FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled")
            return pb2.Event(seq=1)

        def cancel(self) -> None:
            self.cancelled.set()

    call = FakeCall()

    class StreamStub(FakeStub):
        def WatchEvents(self, request, **kwargs):  # noqa: N802
            self.record("WatchEvents", request, kwargs)
            return call

    stub = StreamStub()
    stream = Client("/tmp/unused.sock", stub=stub).watch_events("p", after_seq=7)
    canceller = threading.Thread(target=lambda: call.reading.wait(5) and stream.cancel())
    canceller.start()  # cancels from another thread once next() blocks
    assert list(stream) == []
    canceller.join(5)
    _, request, kwargs = stub.calls[0]
    assert (request.pool, request.after_seq, kwargs["timeout"]) == ("p", 7, None)


# -- asyncio ---------------------------------------------------------------------------


def test_async_session_and_keepalive_task():
    stub = AsyncFakeStub(lease_ms=30)

    async def main() -> None:
        client = AsyncClient("/tmp/unused.sock", stub=stub, timeout=3.0, token="t")
        session = await client.open_session("p", block_bytes=4096)
        assert await session.lookup([b"a", b"bb"]) == [LookupResult.HIT, LookupResult.HIT_PENDING]
        assert (await session.prepare_store([b"k"])).block_ids == [0]
        # the stub answers in this loop: wait for its calls from a thread
        await asyncio.to_thread(stub.wait_until, lambda: stub.count("KeepAlive") >= 3)
        keepalive = session.keepalive
        await session.close()
        assert not keepalive.statistics().running
        after = stub.count("KeepAlive")
        assert keepalive.statistics().renewals == after  # every KeepAlive was answered
        await keepalive.wait_stopped()
        assert stub.count("KeepAlive") == after  # its task ended: no KeepAlive after close
        await session.close()
        assert stub.count("CloseSession") == 1
        with pytest.raises(NotFound):
            await session.touch([b"k"])
        await client.close()

    asyncio.run(main())
    assert all(kw["metadata"] == (("authorization", "Bearer t"),) for _, _, kw in stub.calls)


def test_async_keepalive_not_found_expires_the_session():
    stub = AsyncFakeStub(lease_ms=30)
    stub.keepalive_errors.append(FakeRpcError(grpc.StatusCode.NOT_FOUND, "unknown session"))

    async def main() -> None:
        async with AsyncClient("/tmp/unused.sock", stub=stub) as client:
            session = await client.open_session("p", block_bytes=4096)
            await asyncio.wait_for(session.keepalive.wait_stopped(), 5)
            assert session.closed
            with pytest.raises(NotFound, match="session expired or closed by the daemon"):
                await session.lookup([b"k"])

    asyncio.run(main())
    assert stub.count("KeepAlive") == 1 and stub.count("CloseSession") == 0
