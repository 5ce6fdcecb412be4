"""The KVTier gRPC servicer: validate, convert, call the pool, convert back.

No state lives here. Every handler validates every field before touching any
state, so a rejected call changes nothing. ``KvtierdError`` subclasses map to
their status code in one place (``_handle``); anything else is a bug, logged
with its trace and answered INTERNAL — the daemon keeps serving. Client
mistakes are never logged with a trace.

Requests whose bytes do not parse arrive as ``guards.UnparsableRequest``
(server.py installs the lenient deserializers): reading any of its fields
raises ``InvalidArgument``. Invariant: handlers read their request only inside
``_handle`` (or WatchEvents' own mapping), after ``authorize``, and before
changing any state, so garbage is INVALID_ARGUMENT over the Unix socket and
UNAUTHENTICATED over TCP without a token.

Authorization (``kvtierd.security``): ``authorize`` identifies the caller of
every call (``current_caller()`` inside a handler); a call naming a pool is
checked against the caller's principal, and a call on a session must come from
the principal that opened it. Without ``[[security.principals]]`` every caller
reaches every pool, as before. Refusals are audited.

The request path reads top to bottom: service -> session -> pool -> manager.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvtierd import __version__
from kvtierd.api import wire
from kvtierd.api.validation import (
    check_block_bytes,
    check_eviction_policy,
    check_keys,
    check_pool_name,
    check_text,
)
from kvtierd.api.watch import WatchStreams, end_stream
from kvtierd.contract import BlockEvent, PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.core.pools import PoolTable
from kvtierd.core.sessions import Session, SessionTable
from kvtierd.core.statistics import PoolStatistics, tier_views
from kvtierd.errors import (
    InvalidArgument,
    KvtierdError,
    OutOfRange,
    ShuttingDown,
)
from kvtierd.security.access import check_pool
from kvtierd.security.identity import Caller
from kvtierd.security.state import SecurityState
from kvtierd_client.wire.proto import pb2, pb2_grpc

log = logging.getLogger("kvtierd.service")

MAX_BATCH_OPS = 4096
# One TakeEvents answer carries at most this many event bytes (events.event_bytes);
# ``more`` says the session has further events. A client that does not read its
# answer then holds the daemon to a few MiB, not to the whole retained log.
TAKE_EVENTS_MAX_BYTES = 1 << 20

Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Any]
# The caller of the call being handled: set by ``_handle`` (each grpc.aio call
# runs in its own task, so a value never leaks into another call).
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("kvtierd_caller")
_AUDITED = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


def current_caller() -> Caller:
    """The caller of the call being handled (``LookupError`` outside a call)."""
    return _CALLER.get()


def _handle(method: Handler) -> Callable[..., Awaitable[Any]]:
    """Runs a synchronous handler body on the loop and maps its errors to statuses:
    ``KvtierdError`` (an unparsable request's included) to its code with its
    message, nothing logged; anything else to INTERNAL, logged with its trace."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KVTierService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Each outcome is observed before the answer leaves, so a client that
        # scrapes metrics after its call returned always sees the call counted.
        start = time.perf_counter()
        try:
            _CALLER.set(self.authorize(context))
            response = method(self, request, context)
            if inspect.iscoroutine(response):  # OpenSession may wait for a pool's creation
                response = await response
        except KvtierdError as exc:
            self._observe(name, exc.code.name, start)
            if exc.code in _AUDITED:
                self._security.call_denied(name, _CALLER.get(None), context.peer(), exc)
            await context.abort(exc.code, str(exc))
        except Exception as exc:
            self._observe(name, "INTERNAL", start)
            log.exception("%s failed with an internal error", name)
            await context.abort(grpc.StatusCode.INTERNAL, _internal_message(name, exc))
        self._observe(name, "OK", start)
        return response

    return wrapper


def _internal_message(name: str, exc: Exception) -> str:
    return f"internal error in {name}: {type(exc).__name__}: {exc} (see the daemon log)"


class KVTierService(pb2_grpc.KVTierServicer):
    def __init__(
        self,
        pools: PoolTable,
        sessions: SessionTable,
        *,
        max_keys_per_call: int,
        security: SecurityState,
        max_watch_streams: int = 64,
        watch_write_timeout: float = 10.0,
    ) -> None:
        self._pools = pools
        self._sessions = sessions
        self._max_keys = max_keys_per_call
        self._security = security
        self._started = time.monotonic()
        self.watches = WatchStreams(max_watch_streams, watch_write_timeout)
        self.shutting_down = False
        self.region_fd_socket = ""  # set by the daemon: security.region_access
        # (method, status code name, seconds) per handled call; set by the daemon
        self.observe_rpc: Callable[[str, str, float], None] | None = None
        # (session, peer) -> the OpenSessionResponse fast-lane fields to offer, or
        # None; set by the daemon when server.fast_lane is on (kvtierd.api.fastlane)
        self.offer_fast_lane: Callable[[Session, str], dict[str, Any] | None] | None = None

    def _observe(self, method: str, code: str, start: float) -> None:
        if self.observe_rpc is not None:
            self.observe_rpc(method, code, time.perf_counter() - start)

    # ----------------------------------------------------------------- auth

    def authorize(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller (``SecurityState.identify``): without principals Unix-socket
        peers are trusted (file permissions guard the socket); TCP peers must
        present ``authorization: Bearer <token>`` or a client certificate."""
        if self.shutting_down:
            raise ShuttingDown("kvtierd is shutting down; retry against the restarted daemon")
        return self._security.identify(context)

    def call_direct(self, name: str, caller: Caller, peer: str, request: Any) -> Any:
        """Runs the body of RPC ``name`` (a synchronous one: the fast lane's) for
        ``caller`` exactly as ``_handle`` does for a gRPC call: the same
        validation and service functions, metrics and audit. Returns the
        response; raises ``KvtierdError`` with the status the gRPC path would
        answer (an unexpected failure: INTERNAL, logged with its trace).
        ``_CALLER`` is set for the call only and reset after it."""
        start = time.perf_counter()
        token = _CALLER.set(caller)
        try:
            if self.shutting_down:
                raise ShuttingDown("kvtierd is shutting down; retry against the restarted daemon")
            response = _DIRECT_BODIES[name](self, request, None)
        except KvtierdError as exc:
            self._observe(name, exc.code.name, start)
            if exc.code in _AUDITED:
                self._security.call_denied(name, caller, peer, exc)
            raise
        except Exception as exc:
            self._observe(name, "INTERNAL", start)
            log.exception("%s failed with an internal error", name)
            raise KvtierdError(_internal_message(name, exc)) from exc  # code INTERNAL
        else:  # _observe inlined: this is the fast lane's whole per-call path
            observe = self.observe_rpc
            if observe is not None:
                observe(name, "OK", time.perf_counter() - start)
            return response
        finally:
            _CALLER.reset(token)

    # ----------------------------------------------------------------- sessions

    @_handle
    async def OpenSession(self, request: pb2.OpenSessionRequest, context: Any) -> Any:
        spec = request.pool
        check_pool_name(spec.name)
        check_block_bytes(spec.block_bytes)
        check_eviction_policy(spec.eviction_policy)
        check_text(spec.layout, "pool.layout", max_bytes=4096)
        check_text(request.client_name, "client_name")
        if spec.num_blocks > (1 << 40):
            raise InvalidArgument(f"pool.num_blocks: {spec.num_blocks} is absurdly large")
        caller = current_caller()
        check_pool(caller, spec.name, "open")
        pool = await self._pools.open(
            PoolSpec(
                name=spec.name,
                block_bytes=spec.block_bytes,
                num_blocks=spec.num_blocks,
                layout=spec.layout,
                eviction_policy=spec.eviction_policy,
            )
        )
        session = self._sessions.open(pool, request.client_name, caller.peer, caller.name)
        lane = None
        if self.offer_fast_lane is not None:
            lane = self.offer_fast_lane(session, context.peer())
        return pb2.OpenSessionResponse(
            session_id=session.id,
            region=pb2.Region(
                path=pool.region.path,
                num_blocks=pool.spec.num_blocks,
                block_bytes=pool.spec.block_bytes,
                st_dev=pool.region.identity()[0],  # the client maps only this very file
                st_ino=pool.region.identity()[1],
                fd_socket=self.region_fd_socket,  # "" until the daemon serves descriptors
            ),
            lease_ms=self._sessions.lease_ms,
            pool=_pool_spec_message(pool.spec),
            **(lane or {}),
        )

    @_handle
    def KeepAlive(self, request: pb2.KeepAliveRequest, context: Any) -> Any:
        self._live_session(request.session_id)
        return pb2.KeepAliveResponse(lease_ms=self._sessions.lease_ms)

    @_handle
    def CloseSession(self, request: pb2.CloseSessionRequest, context: Any) -> Any:
        self._sessions.close(request.session_id, principal=current_caller().name)
        return pb2.CloseSessionResponse()

    # ----------------------------------------------------------------- manager

    def _live_session(self, session_id: str) -> Session:
        """The session a validated call names, its lease renewed: every call on a
        session, KeepAlive included, is proof of its client's life. A session
        another principal opened is refused (``AccessDenied``) before its lease
        moves."""
        session = self._sessions.get(session_id, current_caller().name)
        self._sessions.renew(session)
        return session

    def _session_and_keys(self, request: Any) -> tuple[Session, list[bytes]]:
        keys = list(request.keys)
        check_keys(keys, self._max_keys)
        return self._live_session(request.session_id), keys

    @_handle
    def Lookup(self, request: pb2.LookupRequest, context: Any) -> Any:
        return _lookup(*self._session_and_keys(request), request)

    @_handle
    def Touch(self, request: pb2.TouchRequest, context: Any) -> Any:
        return _touch(*self._session_and_keys(request), request)

    @_handle
    def PrepareLoad(self, request: pb2.PrepareLoadRequest, context: Any) -> Any:
        return _prepare_load(*self._session_and_keys(request), request)

    @_handle
    def CompleteLoad(self, request: pb2.CompleteLoadRequest, context: Any) -> Any:
        return _complete_load(*self._session_and_keys(request), request)

    @_handle
    def PrepareStore(self, request: pb2.PrepareStoreRequest, context: Any) -> Any:
        return _prepare_store(*self._session_and_keys(request), request)

    @_handle
    def CompleteStore(self, request: pb2.CompleteStoreRequest, context: Any) -> Any:
        return _complete_store(*self._session_and_keys(request), request)

    @_handle
    def Batch(self, request: pb2.BatchRequest, context: Any) -> Any:
        """Runs the ops in order on one loop turn; each op's error is its own result."""
        if len(request.ops) > MAX_BATCH_OPS:
            raise InvalidArgument(
                f"ops: {len(request.ops)} operations; at most {MAX_BATCH_OPS} per Batch"
            )
        self._check_batch_keys(request.ops)
        session = self._live_session(request.session_id)
        return pb2.BatchResponse(results=[self._batch_op(session, op) for op in request.ops])

    def _check_batch_keys(self, ops: Any) -> None:
        """A Batch runs in one event-loop turn: its keys together are bounded like two
        calls' (a step's queued completions plus the call that carries them), so one
        Batch cannot hold every other client for seconds."""
        limit = 2 * self._max_keys
        total = 0
        for op in ops:
            which = op.WhichOneof("op")
            if which is not None:
                total += len(getattr(op, which).keys)
        if total > limit:
            raise InvalidArgument(
                f"ops: {total} keys in one Batch; at most {limit} (2 x "
                "limits.max_keys_per_call): split it into several Batches"
            )

    def _batch_op(self, session: Session, op: pb2.BatchOp) -> pb2.BatchResult:
        which = op.WhichOneof("op")
        try:
            if which is None:
                raise InvalidArgument("ops: an operation with no call set")
            call = getattr(op, which)
            if call.session_id and call.session_id != session.id:
                raise InvalidArgument(
                    f"ops.{which}.session_id: {call.session_id!r} is not the batch's session; "
                    "leave it empty"
                )
            keys = list(call.keys)
            check_keys(keys, self._max_keys)
            response = _BATCH_OPS[which](session, keys, call)
        except KvtierdError as exc:
            return pb2.BatchResult(code=exc.code.value[0], error=str(exc))
        return pb2.BatchResult(**{which: response})

    # ----------------------------------------------------------------- events

    @_handle
    def TakeEvents(self, request: pb2.TakeEventsRequest, context: Any) -> Any:
        session = self._live_session(request.session_id)
        taken = self._sessions.take_events(session, TAKE_EVENTS_MAX_BYTES)
        return pb2.TakeEventsResponse(
            events=[_event_message(seq, event) for seq, event in taken.events],
            dropped=taken.dropped,
            more=taken.more,
        )

    async def WatchEvents(self, request: pb2.WatchEventsRequest, context: Any) -> None:
        """Streams a pool's events. A coroutine writing with ``context.write`` (not a
        generator: a write must be able to time out); bounded by ``self.watches``."""
        caller = None
        try:
            caller = self.authorize(context)
            pool, cursor = self._watch_start(request, caller)
            self.watches.reserve()
        except KvtierdError as exc:
            if exc.code in _AUDITED:
                self._security.call_denied("WatchEvents", caller, context.peer(), exc)
            await context.abort(exc.code, str(exc))
        with self.watches.held():  # until the status is out: gRPC holds the last write
            try:
                await self._stream_events(pool, cursor, context)
            except KvtierdError as exc:
                await end_stream(context, exc)

    async def _stream_events(self, pool: Pool, cursor: int, context: Any) -> None:
        # Invariant: every event with seq <= cursor was sent, none after it. The
        # stream holds one event at a time (never a list the log has dropped), and
        # events dropped by the bounded log before it sent them end it with
        # OUT_OF_RANGE (a gap is never skipped silently).
        events = pool.events
        while not self.shutting_down:
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
            await self.watches.write(context, _event_message(cursor + 1, event), cursor + 1)
            cursor += 1

    def _watch_start(self, request: pb2.WatchEventsRequest, caller: Caller) -> tuple[Pool, int]:
        check_pool_name(request.pool, "pool")
        check_pool(caller, request.pool, "watch")
        pool = self._pools.get(request.pool)
        events = pool.events
        after = request.after_seq
        if after == -1:
            return pool, events.last_seq
        if after < -1:
            raise InvalidArgument(f"after_seq: {after}; use -1 (new events only) or a seq >= 0")
        if after > events.last_seq:
            raise OutOfRange(
                f"after_seq {after} is beyond pool {pool.spec.name!r}'s last event "
                f"{events.last_seq} (did the daemon restart?); resume with -1 or 0"
            )
        if after + 1 < events.oldest_seq:
            raise OutOfRange(
                f"events {after + 1}..{events.oldest_seq - 1} of pool {pool.spec.name!r} were "
                f"dropped (limits.events_retained, limits.events_retained_bytes); resume "
                f"from after_seq {events.oldest_seq - 1} or -1"
            )
        return pool, after

    # ----------------------------------------------------------------- stats

    @_handle
    def GetStats(self, request: pb2.GetStatsRequest, context: Any) -> Any:
        caller = current_caller()
        if request.pool:
            check_pool_name(request.pool, "pool")
            check_pool(caller, request.pool, "stat")
            pools = [self._pools.get(request.pool)]
        else:  # every pool the caller may stat
            pools = [pool for pool in self._pools if caller.principal.may_reach(pool.spec.name)]
        return pb2.GetStatsResponse(
            pools=[pool_stats_message(pool.statistics()) for pool in pools],
            memory_budget_bytes=self._pools.budget_bytes,
            memory_used_bytes=self._pools.used_bytes,
            uptime_seconds=time.monotonic() - self._started,
            sessions=len(self._sessions),
            version=__version__,
        )

    @_handle
    def FlushPool(self, request: pb2.FlushPoolRequest, context: Any) -> Any:
        check_pool_name(request.pool, "pool")
        check_pool(current_caller(), request.pool, "flush")
        evicted = self._pools.get(request.pool).flush()
        return pb2.FlushPoolResponse(evicted_blocks=evicted)

    @_handle
    def Explain(self, request: pb2.ExplainRequest, context: Any) -> Any:
        check_pool_name(request.pool, "pool")
        check_pool(current_caller(), request.pool, "explain")
        check_keys([request.key], 1, field="key")
        report = self._pools.get(request.pool).explain(request.key)
        return pb2.ExplainResponse(
            primary=wire.lookup_result(report.primary),
            ref_count=report.ref_count or 0,
            tiers=[
                pb2.TierPresence(tier=name, present=bool(present), known=present is not None)
                for name, present in report.tiers
            ],
            history=[
                pb2.KeyRecord(unix_time=r.unix_time, tier=r.tier, what=r.what)
                for r in report.history
            ],
            summary=report.summary,
        )


# ----------------------------------------------------------------- manager calls
# One function per manager call, shared by the single RPCs and Batch: the
# session is resolved and the keys validated by the caller.


def _lookup(session: Session, keys: list[bytes], request: Any) -> pb2.LookupResponse:
    if request.pin:
        results, block_ids = session.pool.lookup_and_pin(session.id, keys, prefix=request.prefix)
        return pb2.LookupResponse(results=wire.lookup_results(results), block_ids=block_ids)
    results = session.pool.lookup(keys, prefix=request.prefix)
    return pb2.LookupResponse(results=wire.lookup_results(results))


def _touch(session: Session, keys: list[bytes], request: Any) -> pb2.TouchResponse:
    session.pool.touch(keys)
    return pb2.TouchResponse()


def _prepare_load(session: Session, keys: list[bytes], request: Any) -> pb2.PrepareLoadResponse:
    return pb2.PrepareLoadResponse(block_ids=session.pool.prepare_load(session.id, keys))


def _complete_load(session: Session, keys: list[bytes], request: Any) -> pb2.CompleteLoadResponse:
    session.pool.complete_load(session.id, keys, unused=request.unused)
    return pb2.CompleteLoadResponse()


def _prepare_store(session: Session, keys: list[bytes], request: Any) -> pb2.PrepareStoreResponse:
    grant = session.pool.prepare_store(session.id, keys)
    if grant is None:
        return pb2.PrepareStoreResponse(accepted=False)
    return pb2.PrepareStoreResponse(
        accepted=True,
        keys_to_store=grant.keys_to_store,
        block_ids=grant.block_ids,
        evicted_keys=grant.evicted_keys,
    )


def _complete_store(session: Session, keys: list[bytes], request: Any) -> pb2.CompleteStoreResponse:
    session.pool.complete_store(session.id, keys, request.success)
    return pb2.CompleteStoreResponse()


# The synchronous RPC bodies the fast lane runs through ``call_direct`` (each
# ``_handle``-wrapped method's own body: one implementation for both paths).
_DIRECT_BODIES: dict[str, Callable[[KVTierService, Any, Any], Any]] = {
    name: getattr(KVTierService, name).__wrapped__
    for name in (
        "Lookup",
        "Touch",
        "PrepareLoad",
        "CompleteLoad",
        "PrepareStore",
        "CompleteStore",
        "Batch",
        "KeepAlive",
    )
}

_BATCH_OPS: dict[str, Callable[[Session, list[bytes], Any], Any]] = {
    "lookup": _lookup,
    "touch": _touch,
    "prepare_load": _prepare_load,
    "complete_load": _complete_load,
    "prepare_store": _prepare_store,
    "complete_store": _complete_store,
}


def _pool_spec_message(spec: PoolSpec) -> pb2.PoolSpec:
    return pb2.PoolSpec(
        name=spec.name,
        block_bytes=spec.block_bytes,
        num_blocks=spec.num_blocks,
        layout=spec.layout,
        eviction_policy=spec.eviction_policy,
    )


def _event_message(seq: int, event: BlockEvent) -> pb2.Event:
    return pb2.Event(
        seq=seq,
        keys=event.keys,
        medium=wire.medium(event.medium),
        removed=event.removed,
        tier=event.tier,
    )


def pool_stats_message(stats: PoolStatistics) -> pb2.PoolStats:
    """GetStats' view of one pool snapshot: its spec and, per tier, the numbers
    :func:`kvtierd.core.statistics.tier_views` computes (no other source)."""
    spec = stats.spec
    return pb2.PoolStats(
        name=spec.name,
        block_bytes=spec.block_bytes,
        num_blocks=spec.num_blocks,
        layout=spec.layout,
        eviction_policy=spec.eviction_policy,
        sessions=stats.sessions,
        region_path=stats.region_path,
        last_event_seq=stats.last_event_seq,
        warm_adopted_blocks=stats.warm_adopted_blocks,
        warm_dropped_blocks=stats.warm_dropped_blocks,
        journal_bytes=stats.journal_bytes,
        tiers=[
            pb2.TierStats(
                tier=view.name,
                medium=wire.medium(view.medium),
                # ints all; the stub types `ready` bool, which protobuf sets from 0 / 1 too
                **view.wire_numbers(),  # type: ignore[arg-type]
            )
            for view in tier_views(stats)
        ],
    )
