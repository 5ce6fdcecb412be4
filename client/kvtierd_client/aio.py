"""asyncio client of kvtierd (``grpc.aio``), with the same surface as ``kvtierd_client.client``.

Typical use (create the client inside a running event loop)::

    async with AsyncClient() as client:
        async with await client.open_session("llama/tp1", block_bytes=64 << 10) as session:
            results = await session.lookup(keys)
            grant = await session.prepare_store(keys)
            ...
            await session.complete_store(grant.keys_to_store)

Requests are built and responses decoded by the codec of ``kvtierd_client.client``;
errors are the same ``kvtierd_client.errors.KvtierError`` subclasses.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from kvtierd_client.address import default_address, to_grpc_target
from kvtierd_client.client import (
    _R,
    CLOSE_SESSION,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    DEFAULT_CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT,
    FLUSH_POOL,
    GET_STATS,
    KEEP_ALIVE,
    LOOKUP,
    OPEN_SESSION,
    PREPARE_LOAD,
    PREPARE_STORE,
    TAKE_EVENTS,
    TOUCH,
    WATCH_EVENTS,
    LookupResult,
    StoreResult,
    _FailureStreak,
    _Op,
    _SessionState,
    after_keepalive,
    client_closed_error,
    keepalive_deadline,
    keepalive_interval,
    log,
)
from kvtierd_client.credentials import CallCredentials
from kvtierd_client.errors import KvtierError, NotFound, from_rpc_error
from kvtierd_client.proto import pb2, pb2_grpc

__all__ = ["AsyncClient", "AsyncEventStream", "AsyncSession", "LookupResult", "StoreResult"]


class AsyncClient:
    """An asyncio connection to kvtierd over one ``grpc.aio`` channel.

    Same arguments as ``kvtierd_client.client.Client``; create it while an event
    loop runs (the channel binds to it). Raises ``ValueError`` for a malformed
    address; an unreachable daemon shows up as ``Unavailable`` on the first call.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        channel_options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS,
        token: str | None = None,
        stub: Any = None,
    ) -> None:
        self.address: str = address or default_address()
        self.target: str = to_grpc_target(self.address)
        self.timeout = timeout
        self._credentials = CallCredentials(self.address, token, timeout, tickets=stub is None)
        self._channel: grpc.aio.Channel | None = None
        if stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=list(channel_options))
            stub = pb2_grpc.KVTierStub(self._channel)
        self._stub = stub
        self._closed = False
        self._sessions: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    # -- plumbing --------------------------------------------------------------------

    async def _call(
        self, op: _Op[_R], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> _R:
        """Runs ``op`` with a deadline; gRPC failures become ``KvtierError``."""
        request = op.request(*args, **kwargs)
        if self._closed:
            raise client_closed_error(self.address)
        method = getattr(self._stub, op.rpc)
        deadline = self.timeout if timeout is None else timeout
        try:
            response = await self._credentials.call_async(method, request, deadline)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from err
        except grpc.aio.UsageError as err:  # the channel was closed under the call
            raise client_closed_error(self.address) from err
        return op.decode(response)

    def _forget(self, session: AsyncSession) -> None:
        self._sessions.discard(session)

    # -- RPCs ------------------------------------------------------------------------

    async def open_session(
        self,
        pool: str,
        block_bytes: int,
        num_blocks: int = 0,
        layout: str = "",
        eviction_policy: str = "",
        client_name: str = "",
        keepalive: bool = True,
    ) -> AsyncSession:
        """Creates or joins ``pool``; returns a session bound to it (RPC ``OpenSession``).

        With ``keepalive`` an asyncio task renews the lease every ``lease_ms / 3``
        until the session is closed. Raises ``InvalidArgument``, ``FailedPrecondition``
        (pool mismatch), ``ResourceExhausted`` (memory budget), ``Unavailable``,
        ``DeadlineExceeded``, ``Unauthenticated`` / ``PermissionDenied``.
        """
        sent_at = time.monotonic()
        response = await self._call(
            OPEN_SESSION, pool, block_bytes, num_blocks, layout, eviction_policy, client_name
        )
        session = AsyncSession(self, response, keepalive=keepalive)
        session._renewed(sent_at)
        self._sessions.add(session)
        return session

    async def get_stats(self, pool: str = "") -> pb2.GetStatsResponse:
        """Statistics of ``pool``, or of every pool when empty (RPC ``GetStats``).

        Raises ``NotFound`` (unknown pool), ``Unavailable``, ``DeadlineExceeded``.
        """
        return await self._call(GET_STATS, pool)

    async def flush_pool(self, pool: str) -> int:
        """As :meth:`kvtierd_client.Client.flush_pool`."""
        return await self._call(FLUSH_POOL, pool)

    def watch_events(
        self, pool: str, after_seq: int = -1, *, timeout: float | None = None
    ) -> AsyncEventStream:
        """A live async iterator over ``pool``'s events with ``seq > after_seq``
        (RPC ``WatchEvents``; -1: only new events). No deadline unless ``timeout``;
        stop it with ``.cancel()``, after which iteration ends quietly. Iterating
        raises ``NotFound`` (unknown pool), ``InvalidArgument``, ``Unavailable``, ..."""
        if self._closed:
            raise client_closed_error(self.address)
        request = WATCH_EVENTS.request(pool, after_seq)
        metadata = self._credentials.metadata
        call = self._stub.WatchEvents(request, timeout=timeout, metadata=metadata)
        return AsyncEventStream(call, self)

    async def close(self) -> None:
        """Closes every open session of this client (RPC ``CloseSession``, errors
        ignored), then the channel; ongoing event streams end. Idempotent."""
        if self._closed:
            return
        for session in list(self._sessions):
            try:
                await session.close()
            except KvtierError as err:
                log.debug("closing kvtierd session %s: %s", session.session_id, err)
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
        self._credentials.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncClient {self.address}{' closed' if self._closed else ''}>"


class AsyncEventStream(AsyncIterator[pb2.Event]):
    """Async iterator over a ``WatchEvents`` stream; ``cancel()`` ends it."""

    def __init__(self, call: Any, client: AsyncClient) -> None:
        self._call = call
        self._iterator = call.__aiter__()
        self._client = client
        self._cancelled = False

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> pb2.Event:
        """The next event; waits until one arrives. Raises a ``KvtierError`` subclass."""
        if self._cancelled:
            raise StopAsyncIteration
        try:
            return await self._iterator.__anext__()
        except grpc.RpcError as err:
            if self._cancelled or self._client.closed:
                raise StopAsyncIteration from None
            raise from_rpc_error(err, self._client.address) from err
        except asyncio.CancelledError:
            if self._cancelled and not _current_task_cancelling():
                raise StopAsyncIteration from None
            raise

    def cancel(self) -> None:
        """Stops the stream; a pending ``__anext__`` ends the iteration."""
        self._cancelled = True
        cancel = getattr(self._call, "cancel", None)
        if cancel is not None:
            cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


def _current_task_cancelling() -> bool:
    """Whether the running task itself was asked to cancel (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


class AsyncSession(_SessionState):
    """A session bound to one pool, returned by ``AsyncClient.open_session``.

    Same attributes, methods and exceptions as ``kvtierd_client.client.Session``,
    as coroutines. Keep a reference while you use it: a session nobody
    references stops its keepalive and expires with its lease.
    """

    def __init__(
        self, client: AsyncClient, response: pb2.OpenSessionResponse, *, keepalive: bool = True
    ) -> None:
        super().__init__(client.address, response)
        self.client = client
        self._keepalive_task: asyncio.Task[None] | None = None
        if keepalive:
            self._keepalive_task = asyncio.get_running_loop().create_task(
                _keepalive_loop(weakref.ref(self), keepalive_interval(self.lease_ms)),
                name=f"kvtierd-keepalive-{self.session_id[:12]}",
            )

    # -- plumbing --------------------------------------------------------------------

    async def _call(
        self, op: _Op[_R], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> _R:
        self._check_usable()
        sent_at = time.monotonic()
        try:
            answer = await self.client._call(op, self.session_id, *args, timeout=timeout, **kwargs)
        except NotFound:
            self._mark_gone()
            raise
        self._renewed(sent_at)
        return answer

    def _mark_gone(self) -> None:
        super()._mark_gone()
        self._stop_keepalive()

    def _stop_keepalive(self) -> asyncio.Task[None] | None:
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            return task
        return None

    # -- RPCs ------------------------------------------------------------------------

    async def lookup(
        self, keys: Sequence[bytes], request_id: str = "", *, prefix: bool = False
    ) -> list[LookupResult]:
        """As :meth:`kvtierd_client.client.Session.lookup`."""
        return await self._call(LOOKUP, keys, request_id=request_id, prefix=prefix)

    async def touch(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` recently used, the first most recent (RPC ``Touch``)."""
        await self._call(TOUCH, keys)

    async def prepare_load(self, keys: Sequence[bytes], request_id: str = "") -> list[int]:
        """Pins ``keys`` for reading; returns their block ids (RPC ``PrepareLoad``).

        Raises ``FailedPrecondition`` when a key is not HIT.
        """
        return await self._call(PREPARE_LOAD, keys, request_id=request_id)

    async def complete_load(self, keys: Sequence[bytes], *, unused: bool = False) -> None:
        """Releases this session's pins on ``keys`` (RPC ``CompleteLoad``); they count
        as loads unless ``unused`` (the rows were not read, e.g. lookup pins no load
        claimed).

        Raises ``FailedPrecondition`` for keys this session did not pin.
        """
        await self._call(COMPLETE_LOAD, keys, unused=unused)

    async def prepare_store(
        self, keys: Sequence[bytes], request_id: str = ""
    ) -> StoreResult | None:
        """Reserves rows for the keys not already present (RPC ``PrepareStore``);
        None when there is no room now (nothing changed)."""
        return await self._call(PREPARE_STORE, keys, request_id=request_id)

    async def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Makes this session's reserved ``keys`` readable, or frees them when not
        ``success`` (RPC ``CompleteStore``)."""
        await self._call(COMPLETE_STORE, keys, success=success)

    async def take_events(self) -> list[pb2.Event]:
        """The pool's events since this session's last take (RPC ``TakeEvents``, one
        call per ~1 MiB of events: the daemon pages its answers)."""
        events: list[pb2.Event] = []
        while True:
            page = await self._call(TAKE_EVENTS)
            events.extend(page.events)
            if not page.more:
                return events

    async def keep_alive(self) -> int:
        """Renews the lease now and returns its length in ms (RPC ``KeepAlive``)."""
        self.lease_ms = await self._call(KEEP_ALIVE)
        return self.lease_ms

    async def close(self) -> None:
        """Cancels the keepalive task and closes the session (RPC ``CloseSession``).
        Idempotent; a session the daemon already dropped closes without error.
        Raises ``Unavailable`` / ``DeadlineExceeded`` when the daemon does not answer."""
        if self._closed:
            return
        usable = not self._gone and not self.client.closed
        self._closed = True
        self._end_beacon()  # copiers stop before the daemon aborts the reservations
        task = self._stop_keepalive()
        self.client._forget(self)
        if task is not None:
            await asyncio.wait([task])
        if not usable:
            return
        try:
            await self.client._call(CLOSE_SESSION, self.session_id)
        except NotFound:
            self._gone = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _keepalive_loop(ref: weakref.ref[AsyncSession], interval: float) -> None:
    """Body of a session's keepalive task; holds the session only while calling."""
    session = ref()
    if session is None:
        return
    streak = _FailureStreak(session.session_id)
    del session
    next_interval: float | None = interval
    while next_interval is not None:
        await asyncio.sleep(next_interval)
        session = ref()
        if session is None:
            return
        next_interval = await _keepalive_once(session, streak, next_interval)
        del session


async def _keepalive_once(
    session: AsyncSession, streak: _FailureStreak, interval: float
) -> float | None:
    deadline = keepalive_deadline(interval, session.client.timeout)
    outcome: int | KvtierError
    try:
        outcome = await session._call(KEEP_ALIVE, timeout=deadline)
        session.lease_ms = outcome
    except KvtierError as err:
        outcome = err
    return after_keepalive(session, streak, outcome, interval)
