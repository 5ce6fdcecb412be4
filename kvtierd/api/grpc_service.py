"""The KVTier gRPC servicer: a thin adapter over :class:`~kvtierd.api.handlers.RequestHandlers`.

Each RPC names its handler and how to identify its caller (``SecurityState.identify``
on the call's context: Unix peers without principals are trusted, TCP peers present a
bearer token or a client certificate); a ``KvtierdError`` becomes the call's status
with its message; a :class:`~kvtierd.api.handlers.Pending` answer (a Lookup
waiting for its remote tiers) is awaited here, the loop serving other calls
meanwhile. WatchEvents is the one streaming RPC: its start is the handlers'
(validation, authorization, audit), its writes are gRPC's and bounded here
(:class:`~kvtierd.api.watch.WatchStreams`: open streams, and per principal the
streams ended whose end their clients have not read). Event-loop only.
"""

from __future__ import annotations

from typing import Any

from kvtierd.api.handlers import Identify, Pending, RequestHandlers
from kvtierd.api.messages import event_message
from kvtierd.api.watch import WatchStreams, end_stream
from kvtierd.core.pool import Pool
from kvtierd.errors import KvtierdError, OutOfRange
from kvtierd.security.state import SecurityState
from kvtierd_client.wire.proto import pb2, pb2_grpc


class GrpcService(pb2_grpc.KVTierServicer):
    """The KVTier service of the gRPC servers (``kvtierd.api.server.build_server``)."""

    def __init__(
        self, handlers: RequestHandlers, security: SecurityState, watches: WatchStreams
    ) -> None:
        self._handlers = handlers
        self._security = security
        self.watches = watches

    def _identify(self, context: Any) -> Identify:
        return lambda: self._security.identify(context)

    async def _unary(self, name: str, request: Any, context: Any) -> Any:
        try:
            response = self._handlers.run(name, request, context.peer(), self._identify(context))
            if response.__class__ is Pending:  # a Lookup waiting for its remote tiers
                response = await response
            return response
        except KvtierdError as exc:
            await context.abort(exc.code, str(exc))

    async def OpenSession(self, request: pb2.OpenSessionRequest, context: Any) -> Any:
        try:
            return await self._handlers.open_session(
                request, context.peer(), self._identify(context)
            )
        except KvtierdError as exc:
            await context.abort(exc.code, str(exc))

    async def KeepAlive(self, request: pb2.KeepAliveRequest, context: Any) -> Any:
        return await self._unary("KeepAlive", request, context)

    async def CloseSession(self, request: pb2.CloseSessionRequest, context: Any) -> Any:
        return await self._unary("CloseSession", request, context)

    async def Lookup(self, request: pb2.LookupRequest, context: Any) -> Any:
        return await self._unary("Lookup", request, context)

    async def Touch(self, request: pb2.TouchRequest, context: Any) -> Any:
        return await self._unary("Touch", request, context)

    async def PrepareLoad(self, request: pb2.PrepareLoadRequest, context: Any) -> Any:
        return await self._unary("PrepareLoad", request, context)

    async def CompleteLoad(self, request: pb2.CompleteLoadRequest, context: Any) -> Any:
        return await self._unary("CompleteLoad", request, context)

    async def PrepareStore(self, request: pb2.PrepareStoreRequest, context: Any) -> Any:
        return await self._unary("PrepareStore", request, context)

    async def CompleteStore(self, request: pb2.CompleteStoreRequest, context: Any) -> Any:
        return await self._unary("CompleteStore", request, context)

    async def Batch(self, request: pb2.BatchRequest, context: Any) -> Any:
        return await self._unary("Batch", request, context)

    async def TakeEvents(self, request: pb2.TakeEventsRequest, context: Any) -> Any:
        return await self._unary("TakeEvents", request, context)

    async def GetStats(self, request: pb2.GetStatsRequest, context: Any) -> Any:
        return await self._unary("GetStats", request, context)

    async def FlushPool(self, request: pb2.FlushPoolRequest, context: Any) -> Any:
        return await self._unary("FlushPool", request, context)

    async def Explain(self, request: pb2.ExplainRequest, context: Any) -> Any:
        return await self._unary("Explain", request, context)

    async def WatchEvents(self, request: pb2.WatchEventsRequest, context: Any) -> None:
        """Streams a pool's events. A coroutine writing with ``context.write`` (not a
        generator: a write must be able to time out); bounded by ``self.watches``."""
        try:
            pool, cursor, principal = self._handlers.open_watch(
                request, context.peer(), self._identify(context)
            )
            slot = self.watches.reserve(principal)
        except KvtierdError as exc:
            await context.abort(exc.code, str(exc))
        with self.watches.held(slot):  # until the status is out: gRPC holds the last write
            try:
                await self._stream_events(pool, cursor, context)
            except KvtierdError as exc:
                await end_stream(context, exc, slot)  # open -> unread until it is read

    async def _stream_events(self, pool: Pool, cursor: int, context: Any) -> None:
        # Invariant: every event with seq <= cursor was sent, none after it. The
        # stream holds one event at a time (never a list the log has dropped), and
        # events dropped by the bounded log before it sent them end it with
        # OUT_OF_RANGE (a gap is never skipped silently).
        events = pool.events
        while not self._handlers.stopping:
            if cursor + 1 < events.oldest_seq:
                raise OutOfRange(
                    f"this WatchEvents stream fell {events.oldest_seq - cursor - 1} events "
                    f"behind pool {pool.spec.name!r}'s log (limits.events_retained, "
                    f"limits.events_retained_bytes); read faster or resume from after_seq "
                    f"{events.oldest_seq - 1}"
                )
            event = events.get(cursor + 1)
            if event is None:
                await events.wait_beyond(cursor)
                continue
            await self.watches.write(context, event_message(cursor + 1, event), cursor + 1)
            cursor += 1
