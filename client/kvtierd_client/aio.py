"""asyncio client of kvtierd (``grpc.aio``), with the same surface as ``kvtierd_client.client``.

Typical use (create the client inside a running event loop)::

    async with AsyncClient() as client:
        async with await client.open_session("llama/tp1", block_bytes=64 << 10) as session:
            results = await session.lookup(keys)
            grant = await session.prepare_store(keys)
            ...
            await session.complete_store(grant.keys_to_store)

Everything but the awaiting is shared with the sync client: requests and answers
(``kvtierd_client._rpc.codec``), the channel and error mapping
(``kvtierd_client._rpc.connection``), the session's lease proof
(``kvtierd_client._rpc.session_state``) and the keepalive schedule
(``kvtierd_client._rpc.keepalive``). Errors are the same
``kvtierd_client.errors.KvtierError`` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvtierd_client._rpc import codec
from kvtierd_client._rpc.codec import EventPages, Op
from kvtierd_client._rpc.connection import Connection, WatchStream
from kvtierd_client._rpc.fastlane import AsyncFastLane, offered
from kvtierd_client._rpc.keepalive import KeepaliveTask
from kvtierd_client._rpc.session_state import SessionState
from kvtierd_client.errors import KvtierError, UntrustedAddress
from kvtierd_client.tls import aio_channel
from kvtierd_client.wire.lane_frames import LANE_METHODS
from kvtierd_client.wire.proto import pb2
from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = ["AsyncClient", "AsyncEventStream", "AsyncSession", "LookupResult", "StoreResult"]

R = TypeVar("R")

log = logging.getLogger(__name__)


class AsyncClient(Connection):
    """An asyncio connection to kvtierd over one ``grpc.aio`` channel.

    Same arguments as ``kvtierd_client.client.Client``; create it while an event
    loop runs (the channel binds to it). Raises ``ValueError`` for a malformed
    address; an unreachable daemon shows up as ``Unavailable`` on the first call.
    """

    _open_channel = staticmethod(aio_channel)
    _closed_channel_error = grpc.aio.UsageError  # the channel was closed under the call

    async def _call(self, op: Op[R], *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        """Runs ``op`` with a deadline; gRPC failures become ``KvtierError``."""
        method, request, deadline = self._prepare(op, args, kwargs, timeout)
        try:
            response = await self._credentials.call_async(method, request, deadline)
        except (grpc.RpcError, grpc.aio.UsageError) as err:
            self._raise_call_error(err)
        return op.decode(response)

    async def _lane_call(
        self,
        lane: AsyncFastLane,
        op: Op[R],
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> R:
        """Runs ``op`` over a session's fast lane; raises as ``_call``."""
        request, deadline = self._lane_request(op, args, kwargs, timeout)
        return op.decode(await lane.call(op.rpc, request, deadline))

    # -- RPCs ------------------------------------------------------------------------

    async def open_session(
        self, pool: str, block_bytes: int, num_blocks: int = 0, layout: str = "",
        eviction_policy: str = "", client_name: str = "", keepalive: bool = True,
        timeout: float | None = None,
    ) -> AsyncSession:  # fmt: skip
        """Creates or joins ``pool``; returns a session bound to it (RPC ``OpenSession``).

        Arguments (``timeout`` too) as :meth:`kvtierd_client.client.Client.open_session`
        (no completion queue). With ``keepalive`` an asyncio task renews the lease
        every ``lease_ms / 3`` until the session is closed. Raises ``InvalidArgument``,
        ``FailedPrecondition`` (pool mismatch), ``ResourceExhausted`` (memory budget),
        ``Unavailable``, ``DeadlineExceeded``, ``Unauthenticated`` / ``PermissionDenied``,
        ``UntrustedAddress``.
        """
        daemon_uid = await asyncio.to_thread(self._daemon.daemon_uid)
        sent_at = time.monotonic()
        response = await self._call(
            codec.OPEN_SESSION, pool, block_bytes, num_blocks, layout, eviction_policy, client_name,
            timeout=self._open_session_timeout(timeout),
        )  # fmt: skip
        await asyncio.to_thread(self._daemon.check_announced, response, daemon_uid)
        session = AsyncSession(self, response, sent_at, keepalive=keepalive)
        session.daemon_uid = daemon_uid
        if self.fast_lane and offered(response):
            lane = AsyncFastLane(response, self.address, daemon_uid)
            try:
                await lane.connect(self.timeout)
                session._lane = lane
                self._keep_lane(lane)
            except UntrustedAddress:
                with contextlib.suppress(KvtierError):
                    await session.close()
                raise
            except KvtierError as err:
                log.warning(
                    "kvtierd session %s: no fast lane, using gRPC: %s", session.session_id, err
                )
        self._register(session)
        return session

    async def get_stats(self, pool: str = "") -> pb2.GetStatsResponse:
        """Statistics of ``pool``, or of every pool when empty (RPC ``GetStats``).

        Raises ``NotFound`` (unknown pool), ``Unavailable``, ``DeadlineExceeded``.
        """
        return await self._call(codec.GET_STATS, pool)

    async def flush_pool(self, pool: str) -> int:
        """As :meth:`kvtierd_client.client.Client.flush_pool`."""
        return await self._call(codec.FLUSH_POOL, pool)

    def watch_events(
        self, pool: str, after_seq: int = -1, *, timeout: float | None = None
    ) -> AsyncEventStream:
        """A live async iterator over ``pool``'s events with ``seq > after_seq``
        (RPC ``WatchEvents``; -1: only new events). No deadline unless ``timeout``;
        stop it with ``.cancel()``, after which iteration ends quietly. Iterating
        raises ``NotFound`` (unknown pool), ``InvalidArgument``, ``Unavailable``, ..."""
        return AsyncEventStream(self._watch(pool, after_seq, timeout), self)

    async def close(self) -> None:
        """Closes every open session of this client (RPC ``CloseSession``, errors
        ignored), then the channel; ongoing event streams end. Idempotent."""
        for session in self._sessions_to_close():
            with self._closing(session):
                await session.close()
        for lane in self._lanes_to_close():
            lane.close()
        channel = self._finish_close()
        if channel is not None:
            await channel.close()
        self._credentials.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncEventStream(WatchStream, AsyncIterator[pb2.Event]):
    """Async iterator over a ``WatchEvents`` stream; ``cancel()`` ends it."""

    def __init__(self, call: Any, client: AsyncClient) -> None:
        super().__init__(call, client)
        self._iterator = call.__aiter__()

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> pb2.Event:
        """The next event; waits until one arrives. Raises a ``KvtierError`` subclass."""
        if self._cancelled:
            raise StopAsyncIteration
        try:
            event: pb2.Event = await self._iterator.__anext__()
        except grpc.RpcError as err:
            error = self._error_of(err)
            if error is None:
                raise StopAsyncIteration from None
            raise error from None  # the message says it all; __context__ keeps it
        except asyncio.CancelledError:
            if self._cancelled and not _current_task_cancelling():
                raise StopAsyncIteration from None
            raise
        return event

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


def _current_task_cancelling() -> bool:
    """Whether the running task itself was asked to cancel (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


class AsyncSession(SessionState):
    """A session bound to one pool, returned by ``AsyncClient.open_session``.

    Same attributes, methods and exceptions as ``kvtierd_client.client.Session``,
    as coroutines (no completion queue: every call is one round trip).
    ``keepalive`` is the task renewing the lease (None without keepalive). Keep a
    reference while you use it: a session nobody references stops its keepalive
    and expires with its lease.
    """

    def __init__(
        self,
        client: AsyncClient,
        response: pb2.OpenSessionResponse,
        sent_at: float,
        *,
        keepalive: bool = True,
    ) -> None:
        super().__init__(client.address, response, sent_at)
        self.client = client
        self.keepalive: KeepaliveTask | None = None
        if keepalive:
            self.keepalive = KeepaliveTask(self, lambda: client.timeout)

    async def _call(self, op: Op[R], *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        with self._tracked_call():
            lane = self._lane
            if lane is not None and op.rpc in LANE_METHODS and lane.usable:
                return await self.client._lane_call(
                    lane, op, self.session_id, *args, timeout=timeout, **kwargs
                )
            return await self.client._call(op, self.session_id, *args, timeout=timeout, **kwargs)

    def _mark_gone(self) -> None:
        super()._mark_gone()
        self._close_lane()
        if self.keepalive is not None:
            self.keepalive.stop()

    # -- RPCs ------------------------------------------------------------------------

    async def lookup(
        self, keys: Sequence[bytes], request_id: str = "", *, prefix: bool = False
    ) -> list[LookupResult]:
        """As :meth:`kvtierd_client.session.Session.lookup`."""
        return await self._call(codec.LOOKUP, keys, request_id=request_id, prefix=prefix)

    async def touch(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` recently used, the first most recent (RPC ``Touch``)."""
        await self._call(codec.TOUCH, keys)

    async def prepare_load(self, keys: Sequence[bytes], request_id: str = "") -> list[int]:
        """Pins ``keys`` for reading; returns their block ids (RPC ``PrepareLoad``).

        Raises ``FailedPrecondition`` when a key is not HIT.
        """
        return await self._call(codec.PREPARE_LOAD, keys, request_id=request_id)

    async def complete_load(self, keys: Sequence[bytes], *, unused: bool = False) -> None:
        """Releases this session's pins on ``keys`` (RPC ``CompleteLoad``); they count
        as loads unless ``unused`` (the rows were not read, e.g. lookup pins no load
        claimed).

        Raises ``FailedPrecondition`` for keys this session did not pin.
        """
        await self._call(codec.COMPLETE_LOAD, keys, unused=unused)

    async def prepare_store(
        self, keys: Sequence[bytes], request_id: str = ""
    ) -> StoreResult | None:
        """Reserves rows for the keys not already present (RPC ``PrepareStore``);
        None when there is no room now (nothing changed)."""
        return await self._call(codec.PREPARE_STORE, keys, request_id=request_id)

    async def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Makes this session's reserved ``keys`` readable, or frees them when not
        ``success`` (RPC ``CompleteStore``)."""
        await self._call(codec.COMPLETE_STORE, keys, success=success)

    async def take_events(self) -> list[pb2.Event]:
        """As :meth:`kvtierd_client.session.Session.take_events`."""
        pages = EventPages()
        while pages.more:
            pages.add(await self._call(codec.TAKE_EVENTS))
        return pages.events

    async def keep_alive(self) -> int:
        """Renews the lease now and returns its length in ms (RPC ``KeepAlive``)."""
        self.lease_ms = await self._call(codec.KEEP_ALIVE)
        return self.lease_ms

    async def close(self) -> None:
        """Cancels the keepalive task and closes the session (RPC ``CloseSession``).
        Idempotent; a session the daemon already dropped closes without error.
        Raises ``Unavailable`` / ``DeadlineExceeded`` when the daemon does not answer."""
        if self._closed:
            return
        usable = not self._gone and not self.client.closed
        self._begin_close()
        task = None if self.keepalive is None else self.keepalive.stop()
        self.client._forget(self)
        if task is not None:
            await asyncio.wait([task])
        try:
            if usable:
                with self._closing_call():
                    await self.client._call(codec.CLOSE_SESSION, self.session_id)
        finally:
            self._close_lane()  # after CloseSession: the close is answered, not implied

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
