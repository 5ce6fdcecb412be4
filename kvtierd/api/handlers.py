"""The request handlers of the KVTier API: validate, call the pool, answer.

Both transports are thin adapters over this module: the gRPC servicer
(:mod:`kvtierd.api.grpc_service`) and the fast lane (:mod:`kvtierd.api.fastlane`)
call :meth:`RequestHandlers.run` with the method's name, its request, the peer and
how to identify the caller. Validation, the mapping of errors to statuses, the
metrics of each call and the audit of refusals are written here, once.

No state lives here. Every handler validates every field before touching any
state, so a rejected call changes nothing. ``KvtierdError`` subclasses carry
their status code; anything else is a bug, logged with its trace and answered
INTERNAL: the daemon keeps serving. Client mistakes are never logged with a
trace.

Requests whose bytes do not parse arrive as ``guards.UnparsableRequest`` (both
transports install the lenient parsers): reading any of its fields raises
``InvalidArgument``. Invariant: a handler reads its request only after the caller
was identified and before changing any state, so garbage is INVALID_ARGUMENT over
the Unix socket and UNAUTHENTICATED over TCP without a token.

Authorization (``kvtierd.security``): each call's caller is identified first
(``identify``, the transport's); a call naming a pool is checked against the
caller's principal, and a call on a session must come from the principal that
opened it. Without ``[[security.principals]]`` every caller reaches every pool.
Refusals (PERMISSION_DENIED, UNAUTHENTICATED) are audited.

Waiting for remote tiers (``limits.remote_lookup_wait``): a Lookup -- alone or
in a Batch -- whose keys a remote tier may hold and no tier knows about is
answered after the tiers asked their media (:mod:`kvtierd.tiering.remote`), for
at most that long. :meth:`RequestHandlers.run` then returns a :class:`Pending`
instead of the response: the transport awaits it (the loop serves other calls
meanwhile) and answers with what it returns, exactly as it would have answered
the response (errors, metrics, audit: the same). Everything is validated before
the wait; after it the session is looked up again (it may have ended) and the
call runs as always, from what the tiers learnt. A call that needs no remote
tier never waits and costs what it did.

The request path reads top to bottom: handlers -> keycalls (:mod:`kvtierd.api.keycalls`,
one function per manager call) -> session's pool -> manager.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import grpc

from kvtierd import __version__
from kvtierd.api import keycalls, wire
from kvtierd.api.messages import event_message, pool_spec_message, pool_stats_message
from kvtierd.api.validation import (
    check_block_bytes,
    check_eviction_policy,
    check_keys,
    check_pool_name,
    check_text,
)
from kvtierd.contract import PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.core.pools import PoolTable
from kvtierd.core.sessions import Session, SessionTable
from kvtierd.errors import (
    InvalidArgument,
    KvtierdError,
    OutOfRange,
    ShuttingDown,
    Unavailable,
)
from kvtierd.security.access import check_pool
from kvtierd.security.identity import Caller
from kvtierd.security.state import SecurityState
from kvtierd.tiering.remote import RemoteWait
from kvtierd_client.wire.proto import pb2

log = logging.getLogger(__name__)

MAX_BATCH_OPS = 4096
# One TakeEvents answer carries at most this many event bytes (events.event_bytes);
# ``more`` says the session has further events. A client that does not read its
# answer then holds the daemon to a few MiB, not to the whole retained log.
TAKE_EVENTS_MAX_BYTES = 1 << 20

# (session, peer) -> the OpenSessionResponse fields offering the session a fast lane,
# or None (kvtierd.api.fastlane.FastLane.offer)
LaneOffer = Callable[[Session, str], "dict[str, Any] | None"]
# (method, status code name, seconds): one call's outcome (kvtierd.ops.metrics)
ObserveCall = Callable[[str, str, float], None]
# the transport's way to name the caller of the call being handled; raises
# KvtierdError (UNAUTHENTICATED, PERMISSION_DENIED) for a caller it refuses
Identify = Callable[[], Caller]

_AUDITED = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


def _internal_message(name: str, exc: Exception) -> str:
    return f"internal error in {name}: {type(exc).__name__}: {exc} (see the daemon log)"


def _ignore_call(method: str, code: str, seconds: float) -> None:
    """The default observer: no metrics."""


class Pending:
    """A call's answer that waits (a Lookup waiting for its remote tiers): the
    transport awaits it and answers with its value, or its ``KvtierdError`` as the
    call's status. Awaited once; nothing else of the call runs meanwhile."""

    __slots__ = ("_answer",)

    def __init__(self, answer: Coroutine[Any, Any, Any]) -> None:
        self._answer = answer

    def __await__(self) -> Generator[Any, None, Any]:
        return self._answer.__await__()


class RequestHandlers:
    """The API's handlers over the daemon's pools and sessions.

    Collaborators, all given at construction: ``pools`` and ``sessions`` (the
    state), ``security`` (pool checks' principals and the audit log),
    ``max_keys_per_call``, ``region_fd_socket`` (where clients get a region's
    descriptor; "" when none is served), ``offer_lane`` (the fast lane's offer to
    a new session; None without a lane), ``observe`` (each call's outcome) and
    ``remote_lookup_wait`` (seconds a Lookup may wait for remote tiers; 0: never)."""

    def __init__(
        self,
        pools: PoolTable,
        sessions: SessionTable,
        security: SecurityState,
        *,
        max_keys_per_call: int,
        region_fd_socket: str = "",
        offer_lane: LaneOffer | None = None,
        observe: ObserveCall = _ignore_call,
        remote_lookup_wait: float = 0.0,
    ) -> None:
        self._pools = pools
        self._sessions = sessions
        self._security = security
        self._max_keys = max_keys_per_call
        self._region_fd_socket = region_fd_socket
        self._offer_lane = offer_lane
        self._observe = observe
        self._remote_wait = remote_lookup_wait
        self._started = time.monotonic()
        self._stopping = False
        self._pools_ready: asyncio.Event | None = None  # set: pools may be created
        self._pools_wait = 0.0  # seconds an OpenSession waits for _pools_ready
        self._pools_held_by = ""  # why pools are held, for the UNAVAILABLE message

    def hold_pools_until(self, ready: asyncio.Event, wait: float, why: str) -> None:
        """Until ``ready`` is set, OpenSession waits (at most ``wait`` seconds, then
        UNAVAILABLE naming ``why``) before it creates or opens a pool: a takeover,
        whose replaced daemon still holds the regions (docs/operations/upgrades.md)."""
        self._pools_ready = ready
        self._pools_wait = wait
        self._pools_held_by = why

    async def _pools_may_open(self) -> None:
        ready = self._pools_ready
        if ready is None or ready.is_set():
            return
        try:
            await asyncio.wait_for(ready.wait(), self._pools_wait)
        except asyncio.TimeoutError:
            raise Unavailable(
                f"no pool opens yet: {self._pools_held_by} (waited {self._pools_wait:g}s); "
                "retry OpenSession"
            ) from None

    def stop_accepting(self) -> None:
        """From now on every call is refused with UNAVAILABLE (the daemon is stopping)."""
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ----------------------------------------------------------------- dispatch

    def run(self, name: str, request: Any, peer: str, identify: Identify) -> Any:
        """Runs the unary RPC ``name`` for the caller ``identify`` names and returns
        its response, or a :class:`Pending` the transport awaits for it (a Lookup
        waiting for remote tiers: module doc). Raises ``KvtierdError`` with the
        status to answer (an unexpected failure: INTERNAL, logged with its trace).
        Every call's outcome is observed before the answer leaves, so a client that
        scrapes metrics after its call returned always sees it counted."""
        start = time.perf_counter()
        caller = None
        try:
            caller = self._admit(identify)
            response = _UNARY[name](self, caller, peer, request)
        except KvtierdError as exc:
            self._refused(name, exc, caller, peer, start)
            raise
        except Exception as exc:
            raise self._internal(name, exc, start) from exc
        if response.__class__ is Pending:
            return Pending(self._finish(name, response, caller, peer, start))
        self._observe(name, "OK", time.perf_counter() - start)
        return response

    async def _finish(
        self, name: str, pending: Pending, caller: Caller, peer: str, start: float
    ) -> Any:
        """:meth:`run`'s end for an answer that waited: errors, metrics, audit alike."""
        try:
            response = await pending
        except KvtierdError as exc:
            self._refused(name, exc, caller, peer, start)
            raise
        except Exception as exc:
            raise self._internal(name, exc, start) from exc
        self._observe(name, "OK", time.perf_counter() - start)
        return response

    async def open_session(self, request: Any, peer: str, identify: Identify) -> Any:
        """``OpenSession``, as :meth:`run` runs the others (it may wait for the
        pool's creation, so it is a coroutine)."""
        name = "OpenSession"
        start = time.perf_counter()
        caller = None
        try:
            caller = self._admit(identify)
            response = await self._open_session(caller, peer, request)
        except KvtierdError as exc:
            self._refused(name, exc, caller, peer, start)
            raise
        except Exception as exc:
            raise self._internal(name, exc, start) from exc
        self._observe(name, "OK", time.perf_counter() - start)
        return response

    def _admit(self, identify: Identify) -> Caller:
        if self._stopping:
            raise ShuttingDown("kvtierd is shutting down; retry against the restarted daemon")
        return identify()

    def _refused(
        self, name: str, exc: KvtierdError, caller: Caller | None, peer: str, start: float
    ) -> None:
        self._observe(name, exc.code.name, time.perf_counter() - start)
        if exc.code in _AUDITED:
            self._security.call_denied(name, caller, peer, exc)

    def _internal(self, name: str, exc: Exception, start: float) -> KvtierdError:
        self._observe(name, "INTERNAL", time.perf_counter() - start)
        log.exception("%s failed with an internal error", name)
        return KvtierdError(_internal_message(name, exc))  # code INTERNAL

    # ----------------------------------------------------------------- sessions

    async def _open_session(self, caller: Caller, peer: str, request: Any) -> Any:
        spec = request.pool
        check_pool_name(spec.name)
        check_block_bytes(spec.block_bytes)
        check_eviction_policy(spec.eviction_policy)
        check_text(spec.layout, "pool.layout", max_bytes=4096)
        check_text(request.client_name, "client_name")
        if spec.num_blocks > (1 << 40):
            raise InvalidArgument(f"pool.num_blocks: {spec.num_blocks} is absurdly large")
        check_pool(caller, spec.name, "open")
        await self._pools_may_open()
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
        lane = self._offer_lane(session, peer) if self._offer_lane is not None else None
        return pb2.OpenSessionResponse(
            session_id=session.id,
            region=pb2.Region(
                path=pool.region.path,
                num_blocks=pool.spec.num_blocks,
                block_bytes=pool.spec.block_bytes,
                st_dev=pool.region.identity()[0],  # the client maps only this very file
                st_ino=pool.region.identity()[1],
                fd_socket=self._region_fd_socket,
            ),
            lease_ms=self._sessions.lease_ms,
            pool=pool_spec_message(pool.spec),
            **(lane or {}),
        )

    def keep_alive(self, caller: Caller, peer: str, request: Any) -> Any:
        self._live_session(caller, request.session_id)
        return pb2.KeepAliveResponse(lease_ms=self._sessions.lease_ms)

    def close_session(self, caller: Caller, peer: str, request: Any) -> Any:
        self._sessions.close(request.session_id, principal=caller.name)
        return pb2.CloseSessionResponse()

    def _live_session(self, caller: Caller, session_id: str) -> Session:
        """The session a validated call names, its lease renewed: every call on a
        session, KeepAlive included, is proof of its client's life. A session
        another principal opened is refused (``AccessDenied``) before its lease
        moves."""
        session = self._sessions.get(session_id, caller.name)
        self._sessions.renew(session)
        return session

    def _session_and_keys(self, caller: Caller, request: Any) -> tuple[Session, list[bytes]]:
        keys = list(request.keys)
        check_keys(keys, self._max_keys)
        return self._live_session(caller, request.session_id), keys

    # ----------------------------------------------------------------- manager

    def lookup(self, caller: Caller, peer: str, request: Any) -> Any:
        session, keys = self._session_and_keys(caller, request)
        if self._remote_wait and session.pool.tiering.remote:
            wait = session.pool.remote_wait(keys, prefix=request.prefix)
            if wait is not None:
                return Pending(self._after_wait(wait, caller, request, self._lookup_again))
        return keycalls.lookup(session, keys, request)

    def _lookup_again(self, caller: Caller, request: Any) -> Any:
        """A Lookup that waited for remote tiers, run as always."""
        return keycalls.lookup(*self._session_and_keys(caller, request), request)

    async def _after_wait(
        self,
        wait: RemoteWait,
        caller: Caller,
        request: Any,
        answer: Callable[[Caller, Any], Any],
    ) -> Any:
        """Waits (at most ``remote_lookup_wait``) for the remote tiers a call asked,
        then answers it with ``answer`` (its session looked up again)."""
        await wait.wait(self._remote_wait)
        session = self._sessions.get(request.session_id, caller.name)  # may have ended
        session.pool.tiering.waited(wait)
        return answer(caller, request)

    def touch(self, caller: Caller, peer: str, request: Any) -> Any:
        return keycalls.touch(*self._session_and_keys(caller, request), request)

    def prepare_load(self, caller: Caller, peer: str, request: Any) -> Any:
        return keycalls.prepare_load(*self._session_and_keys(caller, request), request)

    def complete_load(self, caller: Caller, peer: str, request: Any) -> Any:
        return keycalls.complete_load(*self._session_and_keys(caller, request), request)

    def prepare_store(self, caller: Caller, peer: str, request: Any) -> Any:
        return keycalls.prepare_store(*self._session_and_keys(caller, request), request)

    def complete_store(self, caller: Caller, peer: str, request: Any) -> Any:
        return keycalls.complete_store(*self._session_and_keys(caller, request), request)

    def batch(self, caller: Caller, peer: str, request: Any) -> Any:
        """Runs the ops in order on one loop turn; each op's error is its own result."""
        if len(request.ops) > MAX_BATCH_OPS:
            raise InvalidArgument(
                f"ops: {len(request.ops)} operations; at most {MAX_BATCH_OPS} per Batch"
            )
        self._check_batch_keys(request.ops)
        session = self._live_session(caller, request.session_id)
        if self._remote_wait and session.pool.tiering.remote:
            wait = keycalls.batch_remote_wait(session, request.ops, self._max_keys)
            if wait is not None:
                return Pending(self._after_wait(wait, caller, request, self._batch_again))
        return pb2.BatchResponse(results=[self._batch_op(session, op) for op in request.ops])

    def _batch_again(self, caller: Caller, request: Any) -> Any:
        """A Batch whose lookups waited for remote tiers, run as always."""
        session = self._live_session(caller, request.session_id)
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
            response = keycalls.BATCH_OPS[which](session, keys, call)
        except KvtierdError as exc:
            return pb2.BatchResult(code=exc.code.value[0], error=str(exc))
        return pb2.BatchResult(**{which: response})

    # ----------------------------------------------------------------- events

    def take_events(self, caller: Caller, peer: str, request: Any) -> Any:
        session = self._live_session(caller, request.session_id)
        taken = self._sessions.take_events(session, TAKE_EVENTS_MAX_BYTES)
        return pb2.TakeEventsResponse(
            events=[event_message(seq, event) for seq, event in taken.events],
            dropped=taken.dropped,
            more=taken.more,
        )

    def open_watch(self, request: Any, peer: str, identify: Identify) -> tuple[Pool, int, str]:
        """Where a WatchEvents stream starts: its pool, the seq it has sent up to, and
        the principal it runs as (its streams are bounded per principal). Raises
        ``KvtierdError`` (a refusal audited, as :meth:`run`'s); streams are not
        counted in the per-call metrics."""
        caller = None
        try:
            caller = self._admit(identify)
            return (*self._watch_start(caller, request), caller.name)
        except KvtierdError as exc:
            if exc.code in _AUDITED:
                self._security.call_denied("WatchEvents", caller, peer, exc)
            raise

    def _watch_start(self, caller: Caller, request: Any) -> tuple[Pool, int]:
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

    def get_stats(self, caller: Caller, peer: str, request: Any) -> Any:
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

    def flush_pool(self, caller: Caller, peer: str, request: Any) -> Any:
        check_pool_name(request.pool, "pool")
        check_pool(caller, request.pool, "flush")
        evicted = self._pools.get(request.pool).flush()
        return pb2.FlushPoolResponse(evicted_blocks=evicted)

    def explain(self, caller: Caller, peer: str, request: Any) -> Any:
        check_pool_name(request.pool, "pool")
        check_pool(caller, request.pool, "explain")
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


# The unary RPCs by their wire name: what RequestHandlers.run dispatches.
Body = Callable[[RequestHandlers, Caller, str, Any], Any]
_UNARY: dict[str, Body] = {
    "KeepAlive": RequestHandlers.keep_alive,
    "CloseSession": RequestHandlers.close_session,
    "Lookup": RequestHandlers.lookup,
    "Touch": RequestHandlers.touch,
    "PrepareLoad": RequestHandlers.prepare_load,
    "CompleteLoad": RequestHandlers.complete_load,
    "PrepareStore": RequestHandlers.prepare_store,
    "CompleteStore": RequestHandlers.complete_store,
    "Batch": RequestHandlers.batch,
    "TakeEvents": RequestHandlers.take_events,
    "GetStats": RequestHandlers.get_stats,
    "FlushPool": RequestHandlers.flush_pool,
    "Explain": RequestHandlers.explain,
}
UNARY_METHODS = frozenset(_UNARY)


__all__ = ["MAX_BATCH_OPS", "TAKE_EVENTS_MAX_BYTES", "Pending", "RequestHandlers", "UNARY_METHODS"]
