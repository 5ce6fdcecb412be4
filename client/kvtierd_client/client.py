"""Synchronous client of kvtierd's manager RPCs (service ``kvtier.v1.KVTier``).

Typical use::

    with Client() as client:                      # $KVTIERD_ADDRESS or the default socket
        with client.open_session("llama/tp1", block_bytes=64 << 10) as session:
            results = session.lookup(keys)        # [LookupResult.HIT, LookupResult.MISS, ...]
            grant = session.prepare_store(keys)   # StoreResult, or None when there is no room
            ...                                   # copy rows of session.region
            session.complete_store(grant.keys_to_store)

Every call passes a deadline (``Client.timeout`` seconds) and raises a
``kvtierd_client.errors.KvtierError`` subclass on failure, never a
``grpc.RpcError``: ``Unavailable`` when the daemon cannot be reached,
``DeadlineExceeded`` when it does not answer in time, ``NotFound`` when the
session is gone, ``InvalidArgument`` for malformed input, ...

The request encoders and response decoders (the ``_Op`` table below) are shared
with ``kvtierd_client.aio`` so both clients speak the wire the same way.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import grpc

from kvtierd_client.address import default_address, to_grpc_target
from kvtierd_client.credentials import CallCredentials
from kvtierd_client.errors import (
    Internal,
    InvalidArgument,
    KvtierError,
    NotFound,
    error_class,
    from_rpc_error,
)
from kvtierd_client.flusher import FlushDeadline
from kvtierd_client.lease_beacon import LeaseBeacon
from kvtierd_client.proto import pb2, pb2_grpc

__all__ = [
    "DEFAULT_CHANNEL_OPTIONS",
    "DEFAULT_TIMEOUT",
    "Client",
    "EventStream",
    "LookupResult",
    "Session",
    "StoreResult",
]

log = logging.getLogger("kvtierd_client")

_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}

DEFAULT_TIMEOUT = 5.0
"""Seconds each call may take before it fails with ``DeadlineExceeded``."""

DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.enable_http_proxy", 0),  # a local daemon is never behind $http_proxy
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),  # reconnect quickly after a daemon restart
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""gRPC channel arguments used when ``channel_options`` is not given (it replaces them)."""

_MIN_KEEPALIVE_DEADLINE = 0.1  # seconds


class LookupResult(enum.IntEnum):
    """Answer of a lookup for one key (wire: ``LOOKUP_RESULT_*``)."""

    MISS = 1  # in no tier
    HIT = 2  # readable in the primary tier now
    HIT_PENDING = 3  # a write into the primary is in flight; ask again
    RETRY = 4  # a tier cannot answer yet; ask again


@dataclass(frozen=True)
class StoreResult:
    """An accepted PrepareStore: ``block_ids[i]`` is the reserved row for ``keys_to_store[i]``.

    The rows belong to the session until it calls ``complete_store`` (or closes);
    ``evicted_keys`` left the primary tier to make room.
    """

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]


# --------------------------------------------------------------------------------------
# Codec shared with kvtierd_client.aio: one request encoder and one decoder per RPC.
# --------------------------------------------------------------------------------------

_R = TypeVar("_R")


@dataclass(frozen=True)
class _Op(Generic[_R]):
    """One RPC: its stub method name, request encoder and response decoder."""

    rpc: str
    encode: Callable[..., Any]
    decode: Callable[[Any], _R]

    def request(self, *args: Any, **kwargs: Any) -> Any:
        """The request message; malformed arguments raise ``InvalidArgument``."""
        try:
            return self.encode(*args, **kwargs)
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"{self.rpc}: {_encode_error(err, args)}") from err


def _encode_error(err: Exception, args: tuple[Any, ...]) -> str:
    for arg in args:
        if isinstance(arg, (list, tuple)) and any(not isinstance(k, bytes) for k in arg):
            bad = next(k for k in arg if not isinstance(k, bytes))
            return f"keys must be bytes, got {type(bad).__name__} {bad!r:.60}"
    return str(err)


def _key_list(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list of ``bytes`` (bytearray and memoryview are copied)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of bytes, not a single bytes or str value")
    return [bytes(k) if isinstance(k, (bytearray, memoryview)) else k for k in keys]


def _keys_request(request_type: Any) -> Callable[..., Any]:
    def encode(session_id: str, keys: Sequence[bytes], **fields: Any) -> Any:
        return request_type(session_id=session_id, keys=_key_list(keys), **fields)

    return encode


def _encode_open_session(
    pool: str,
    block_bytes: int,
    num_blocks: int,
    layout: str,
    eviction_policy: str,
    client_name: str,
) -> pb2.OpenSessionRequest:
    spec = pb2.PoolSpec(
        name=pool,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        layout=layout,
        eviction_policy=eviction_policy,
    )
    return pb2.OpenSessionRequest(pool=spec, client_name=client_name)


_LOOKUP_RESULTS = {int(r): r for r in LookupResult}


def _decode_lookup(response: pb2.LookupResponse) -> list[LookupResult]:
    try:
        return [_LOOKUP_RESULTS[r] for r in response.results]
    except KeyError as err:
        raise Internal(f"Lookup: the daemon answered an unknown result {err.args[0]}") from None


def _decode_block_ids(response: pb2.PrepareLoadResponse) -> list[int]:
    return list(response.block_ids)


def _decode_store(response: pb2.PrepareStoreResponse) -> StoreResult | None:
    if not response.accepted:
        return None
    return StoreResult(
        keys_to_store=list(response.keys_to_store),
        block_ids=list(response.block_ids),
        evicted_keys=list(response.evicted_keys),
    )


def _decode_events(response: pb2.TakeEventsResponse) -> pb2.TakeEventsResponse:
    """One page of events (``more``: the session has further events)."""
    if response.dropped:
        log.warning("kvtierd dropped %d events of this session's pool (log overflow)",
                    response.dropped)  # fmt: skip
    return response


def _decode_lease(response: pb2.KeepAliveResponse) -> int:
    return int(response.lease_ms)


def _nothing(_response: Any) -> None:
    return None


def _same(response: Any) -> Any:
    return response


OPEN_SESSION = _Op("OpenSession", _encode_open_session, _same)
KEEP_ALIVE = _Op("KeepAlive", lambda sid: pb2.KeepAliveRequest(session_id=sid), _decode_lease)
CLOSE_SESSION = _Op("CloseSession", lambda sid: pb2.CloseSessionRequest(session_id=sid), _nothing)
LOOKUP = _Op("Lookup", _keys_request(pb2.LookupRequest), _decode_lookup)
LOOKUP_AND_PIN = _Op(
    "Lookup",
    _keys_request(pb2.LookupRequest),
    lambda r: (_decode_lookup(r), list(r.block_ids)),
)
TOUCH = _Op("Touch", _keys_request(pb2.TouchRequest), _nothing)
PREPARE_LOAD = _Op("PrepareLoad", _keys_request(pb2.PrepareLoadRequest), _decode_block_ids)
COMPLETE_LOAD = _Op("CompleteLoad", _keys_request(pb2.CompleteLoadRequest), _nothing)
PREPARE_STORE = _Op("PrepareStore", _keys_request(pb2.PrepareStoreRequest), _decode_store)
COMPLETE_STORE = _Op("CompleteStore", _keys_request(pb2.CompleteStoreRequest), _nothing)
TAKE_EVENTS = _Op("TakeEvents", lambda sid: pb2.TakeEventsRequest(session_id=sid), _decode_events)
GET_STATS = _Op("GetStats", lambda pool: pb2.GetStatsRequest(pool=pool), _same)
FLUSH_POOL = _Op(
    "FlushPool", lambda pool: pb2.FlushPoolRequest(pool=pool), lambda r: r.evicted_blocks
)
BATCH = _Op(
    "Batch", lambda sid, ops: pb2.BatchRequest(session_id=sid, ops=ops), lambda r: r.results
)
# the BatchOp / BatchResult field of each call that a Batch can carry
_BATCH_FIELD = {
    "Lookup": "lookup",
    "Touch": "touch",
    "PrepareLoad": "prepare_load",
    "CompleteLoad": "complete_load",
    "PrepareStore": "prepare_store",
    "CompleteStore": "complete_store",
}
_BATCH_METHODS = {
    "lookup": LOOKUP,
    "lookup_and_pin": LOOKUP_AND_PIN,
    "touch": TOUCH,
    "prepare_load": PREPARE_LOAD,
    "complete_load": COMPLETE_LOAD,
    "prepare_store": PREPARE_STORE,
    "complete_store": COMPLETE_STORE,
}
DEFAULT_FLUSH_AFTER = 0.005  # seconds a queued completion may wait for a carrier call
EXPLAIN = _Op("Explain", lambda pool, key: pb2.ExplainRequest(pool=pool, key=key), _same)
WATCH_EVENTS = _Op(
    "WatchEvents", lambda pool, after: pb2.WatchEventsRequest(pool=pool, after_seq=after), _same
)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` as a bearer token (None without a token)."""
    return None if token is None else (("authorization", f"Bearer {token}"),)


def keepalive_interval(lease_ms: int) -> float:
    """Seconds between two KeepAlive calls for a lease of ``lease_ms``: a third of it."""
    return max(lease_ms, 1) / 3000.0


def keepalive_deadline(interval: float, timeout: float) -> float:
    """Deadline of one background KeepAlive: never longer than the interval."""
    return max(min(timeout, interval), _MIN_KEEPALIVE_DEADLINE)


def fence_margin(lease_ms: int) -> float:
    """Seconds the lease deadline keeps short of the proven lease: a tenth of it,
    at most half a second (time between the deadline check and the copy's start)."""
    return min(0.5, lease_ms / 10000.0)


def client_closed_error(address: str) -> KvtierError:
    return KvtierError("the client is closed", grpc.StatusCode.CANCELLED, address)


# --------------------------------------------------------------------------------------
# Session state and keepalive bookkeeping shared with kvtierd_client.aio
# --------------------------------------------------------------------------------------

SESSION_GONE = "session expired or closed by the daemon"


class _SessionState:
    """What a session knows about itself; the sync and async sessions both extend it."""

    def __init__(self, address: str, response: pb2.OpenSessionResponse) -> None:
        self.address = address
        self.session_id: str = response.session_id
        self.region: pb2.Region = response.region
        self.pool: pb2.PoolSpec = response.pool
        self.lease_ms: int = int(response.lease_ms)
        self._closed = False
        self._gone = False  # the daemon answered NOT_FOUND for this session
        # The write fence (README, "Lost leases"). The daemon renews a lease when a
        # call *arrives*, which is after this client sent it, so the send time of
        # the newest answered call plus the lease is a lower bound of the daemon's
        # expiry. Monotonic seconds (CLOCK_MONOTONIC: one clock for every process
        # of the host). Set from the OpenSession call by the client.
        self._lease_proven_until = 0.0
        self._beacon: LeaseBeacon | None = None

    def _renewed(self, sent_at: float) -> None:
        """An answered call sent at ``sent_at`` (monotonic) proved the lease alive."""
        until = sent_at + self.lease_ms / 1000.0
        if until > self._lease_proven_until:
            self._lease_proven_until = until
            if self._beacon is not None:
                self._beacon.publish(until)

    def lease_beacon(self) -> LeaseBeacon:
        """This session's lease proof, published live in shared memory for the
        processes that copy its rows (``kvtierd_client.lease_beacon``; the vLLM
        plug-in's workers). Created on first use; removed when the session closes."""
        if self._beacon is None:
            self._beacon = LeaseBeacon()
            self._beacon.publish(self._lease_proven_until)
            if self._closed or self._gone:
                self._beacon.declare_dead()
        return self._beacon

    def _end_beacon(self) -> None:
        if self._beacon is not None:
            self._beacon.close()

    @property
    def lease_deadline(self) -> float:
        """Monotonic time until which rows this session reserved or pinned may be
        copied to or from.

        A copy must *start* before it (``CopyEngine.submit_store`` / ``submit_load``
        check, with ``lease_deadline=``) and its end is checked against it too. It
        stays ahead while keepalives are answered; once it passes, the daemon may
        have expired the session, aborted its reservations and released its pins.
        0 once the session is closed or gone.
        """
        if self._closed or self._gone:
            return 0.0
        return self._lease_proven_until - fence_margin(self.lease_ms)

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or the daemon dropped the session."""
        return self._closed or self._gone

    def _check_usable(self) -> None:
        if self._gone:
            raise NotFound(f"{SESSION_GONE} (session {self.session_id})", address=self.address)
        if self._closed:
            raise NotFound(f"session {self.session_id} is closed", address=self.address)

    def _mark_gone(self) -> None:
        self._gone = True
        if self._beacon is not None:
            self._beacon.declare_dead()

    def __repr__(self) -> str:
        state = "gone" if self._gone else "closed" if self._closed else "open"
        return (
            f"<{type(self).__name__} {self.session_id} pool={self.pool.name!r} "
            f"rows={self.region.num_blocks}x{self.region.block_bytes} {state}>"
        )


class _FailureStreak:
    """Logs one warning when background keepalives start failing, one line when they recover."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.failing = False

    def failed(self, err: KvtierError, interval: float) -> None:
        if not self.failing:
            log.warning(
                "keepalive of kvtierd session %s failed (%s); retrying every %.2fs",
                self.session_id, err, interval,
            )  # fmt: skip
        self.failing = True

    def succeeded(self) -> None:
        if self.failing:
            log.info("keepalive of kvtierd session %s works again", self.session_id)
        self.failing = False


def after_keepalive(
    state: _SessionState, streak: _FailureStreak, outcome: int | KvtierError, interval: float
) -> float | None:
    """The next keepalive interval after one KeepAlive ``outcome``, or None to stop."""
    if state.closed:
        if isinstance(outcome, NotFound) and not state._closed:
            log.warning("kvtierd session %s: %s; its pins and reservations are released",
                        state.session_id, SESSION_GONE)  # fmt: skip
        return None
    if isinstance(outcome, KvtierError):
        streak.failed(outcome, interval)
        return interval
    streak.succeeded()
    return keepalive_interval(outcome)


# --------------------------------------------------------------------------------------
# Sync client
# --------------------------------------------------------------------------------------


class Client:
    """A connection to kvtierd over one gRPC channel (thread-safe).

    ``address``: ``unix:///abs/path``, ``/abs/path``, ``host:port``, ... (see
    ``kvtierd_client.address``); default ``$KVTIERD_ADDRESS`` or the default socket.
    ``timeout``: the deadline in seconds of every call. ``channel_options``
    replaces ``DEFAULT_CHANNEL_OPTIONS``. ``token``: sent as
    ``authorization: Bearer <token>`` on every call. ``stub``: use this object
    instead of a ``KVTierStub`` over a new channel (tests inject fakes here).
    Over a Unix socket of a daemon with principals, the client proves its
    process's uid with a peer ticket (``kvtierd_client.credentials``).

    Raises ``ValueError`` for a malformed address. Connecting is lazy: an
    unreachable daemon shows up as ``Unavailable`` on the first call.
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
        self._channel: grpc.Channel | None = None
        if stub is None:
            self._channel = grpc.insecure_channel(self.target, options=list(channel_options))
            stub = pb2_grpc.KVTierStub(self._channel)
        self._stub = stub
        self._closed = False
        self._lock = threading.Lock()
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()

    # -- plumbing --------------------------------------------------------------------

    def _call(self, op: _Op[_R], *args: Any, timeout: float | None = None, **kwargs: Any) -> _R:
        """Runs ``op`` with a deadline; gRPC failures become ``KvtierError``."""
        request = op.request(*args, **kwargs)
        if self._closed:
            raise client_closed_error(self.address)
        method = getattr(self._stub, op.rpc)
        deadline = self.timeout if timeout is None else timeout
        try:
            response = self._credentials.call(method, request, deadline)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from err
        except ValueError as err:  # grpc: "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise client_closed_error(self.address) from err
            raise
        return op.decode(response)

    def _forget(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)

    # -- RPCs ------------------------------------------------------------------------

    def open_session(
        self,
        pool: str,
        block_bytes: int,
        num_blocks: int = 0,
        layout: str = "",
        eviction_policy: str = "",
        client_name: str = "",
        keepalive: bool = True,
        queue_completions: bool = False,
        flush_after: float = DEFAULT_FLUSH_AFTER,
    ) -> Session:
        """Creates or joins ``pool`` and returns a session bound to it (RPC ``OpenSession``).

        ``num_blocks`` 0 takes the daemon's default capacity; ``layout`` is a
        fingerprint every session of the pool must share; ``eviction_policy`` is
        "lru" (default) or "arc". With ``keepalive`` a daemon thread renews the
        lease every ``lease_ms / 3`` until the session is closed.

        With ``queue_completions``, ``complete_store`` / ``complete_load`` / ``touch``
        return at once and are sent, in call order, with the session's next call
        that needs an answer (one ``Batch`` round trip), or after ``flush_after``
        seconds (default 5 ms), or by ``flush()`` / ``close()``. The daemon applies
        the session's calls in the order they were made; a queued call's error is
        logged and kept in ``session.deferred_errors`` instead of raising.

        Raises ``InvalidArgument`` (bad name, block size, policy), ``FailedPrecondition``
        (the pool exists with another block size or layout), ``ResourceExhausted``
        (the memory budget cannot fit the pool), ``Unavailable``, ``DeadlineExceeded``,
        ``Unauthenticated`` / ``PermissionDenied``.
        """
        sent_at = time.monotonic()
        response = self._call(
            OPEN_SESSION, pool, block_bytes, num_blocks, layout, eviction_policy, client_name
        )
        session = Session(
            self,
            response,
            keepalive=keepalive,
            queue_completions=queue_completions,
            flush_after=flush_after,
        )
        session._renewed(sent_at)
        with self._lock:
            self._sessions.add(session)
        return session

    def renew_lease(self, session_id: str, *, timeout: float | None = None) -> int:
        """Renews the lease of session ``session_id`` (RPC ``KeepAlive``), which may
        belong to another process of the same engine (the session id is its
        capability); returns the lease in ms. Raises ``NotFound`` once the daemon
        forgot the session, ``Unavailable`` / ``DeadlineExceeded``."""
        return self._call(KEEP_ALIVE, session_id, timeout=timeout)

    def get_stats(self, pool: str = "") -> pb2.GetStatsResponse:
        """Statistics of ``pool``, or of every pool when empty (RPC ``GetStats``).

        Raises ``NotFound`` (unknown pool), ``Unavailable``, ``DeadlineExceeded``.
        """
        return self._call(GET_STATS, pool)

    def explain(self, pool: str, key: bytes) -> pb2.ExplainResponse:
        """Why ``key`` is or is not served in ``pool`` (RPC ``Explain``); changes nothing.

        Raises ``NotFound`` (unknown pool), ``InvalidArgument`` (bad key).
        """
        return self._call(EXPLAIN, pool, key)

    def flush_pool(self, pool: str) -> int:
        """Evicts every ready, unpinned block of ``pool``'s primary tier; returns how
        many (RPC ``FlushPool``). Pinned and in-flight blocks stay; secondary tiers
        keep their copies.

        Raises ``NotFound`` (unknown pool), ``Unavailable``, ``DeadlineExceeded``.
        """
        return self._call(FLUSH_POOL, pool)

    def watch_events(
        self, pool: str, after_seq: int = -1, *, timeout: float | None = None
    ) -> EventStream:
        """A live stream of ``pool``'s events with ``seq > after_seq`` (RPC ``WatchEvents``).

        ``after_seq`` -1 streams only events after the call starts. The stream has
        no deadline unless ``timeout`` is given; stop it with ``.cancel()`` (or use
        it as a context manager), after which iteration ends quietly. Iterating
        raises ``NotFound`` (unknown pool), ``InvalidArgument``, ``Unavailable``, ...
        """
        if self._closed:
            raise client_closed_error(self.address)
        request = WATCH_EVENTS.request(pool, after_seq)
        try:
            metadata = self._credentials.metadata
            call = self._stub.WatchEvents(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from err
        return EventStream(call, self)

    def close(self) -> None:
        """Closes every open session of this client (RPC ``CloseSession``, errors
        ignored), then the channel; ongoing event streams end. Idempotent."""
        if self._closed:
            return
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            try:
                session.close()
            except KvtierError as err:
                log.debug("closing kvtierd session %s: %s", session.session_id, err)
        self._closed = True
        if self._channel is not None:
            self._channel.close()
        self._credentials.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self.address}{' closed' if self._closed else ''}>"


class EventStream(Iterator[pb2.Event]):
    """Iterator over a ``WatchEvents`` stream; ``cancel()`` ends it from any thread."""

    def __init__(self, call: Any, client: Client) -> None:
        self._call = call
        self._client = client
        self._cancelled = False

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> pb2.Event:
        """The next event; blocks until one arrives. Raises a ``KvtierError`` subclass."""
        if self._cancelled:
            raise StopIteration
        try:
            return next(self._call)
        except grpc.RpcError as err:
            if self._cancelled or self._client.closed:
                raise StopIteration from None
            raise from_rpc_error(err, self._client.address) from err

    def cancel(self) -> None:
        """Stops the stream; a blocked ``next()`` returns by ending the iteration."""
        self._cancelled = True
        cancel = getattr(self._call, "cancel", None)
        if cancel is not None:
            cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class Session(_SessionState):
    """A session bound to one pool, returned by ``Client.open_session``.

    ``session_id``, ``region`` (``pb2.Region``: the shared-memory file to map),
    ``pool`` (``pb2.PoolSpec`` as the pool exists) and ``lease_ms``. Keys are
    ``bytes`` (any sequence of them). Keep a reference while you use it: a
    session nobody references stops its keepalive and expires with its lease.

    Every method raises ``NotFound`` once the session is closed, or expired on
    the daemon (then with the message "session expired or closed by the
    daemon"), plus ``Unavailable`` / ``DeadlineExceeded`` when the daemon does not
    answer and ``InvalidArgument`` for malformed keys (empty, over 256 bytes,
    duplicated, too many).
    """

    def __init__(
        self,
        client: Client,
        response: pb2.OpenSessionResponse,
        *,
        keepalive: bool = True,
        queue_completions: bool = False,
        flush_after: float = DEFAULT_FLUSH_AFTER,
    ) -> None:
        super().__init__(client.address, response)
        self.client = client
        self._stop = threading.Event()
        self._keepalive_thread: threading.Thread | None = None
        self.queue_completions = queue_completions
        # Invariant: _queued holds the completions not yet sent, in call order; a
        # call that needs an answer sends them first, in the same Batch, so the
        # daemon applies every call in the order this session made them.
        self._queued: list[pb2.BatchOp] = []
        self._queue_lock = threading.RLock()
        self._deadline = FlushDeadline(
            _weak_flush(weakref.ref(self)), flush_after, f"kvtierd-flush-{self.session_id[:12]}"
        )
        self.deferred_errors: list[KvtierError] = []  # failures of queued ops (last 100)
        self.rpcs = 0  # round trips made by this session's manager calls (not keepalives)
        if keepalive:
            self._start_keepalive()

    # -- plumbing --------------------------------------------------------------------

    def _call(self, op: _Op[_R], *args: Any, timeout: float | None = None, **kwargs: Any) -> _R:
        self._check_usable()
        sent_at = time.monotonic()
        try:
            answer = self.client._call(op, self.session_id, *args, timeout=timeout, **kwargs)
        except NotFound:
            self._mark_gone()
            raise
        self._renewed(sent_at)
        return answer

    def _answer(self, op: _Op[_R], keys: Sequence[bytes], **fields: Any) -> _R:
        """A call that needs its answer: alone, or carrying the queued completions."""
        with self._queue_lock:
            if not self._queued:
                self.rpcs += 1
                return self._call(op, keys, **fields)
            ops = self._take_queued()
            ops.append(self._batch_op(op, keys, **fields))
            results = self._send_batch(ops)
        return self._result(op, results[-1])

    def _complete(self, op: _Op[None], keys: Sequence[bytes], **fields: Any) -> None:
        """A completion: queued when ``queue_completions``, else sent at once."""
        if not self.queue_completions:
            self.rpcs += 1
            self._call(op, keys, **fields)
            return
        self._check_usable()
        batch_op = self._batch_op(op, keys, **fields)
        with self._queue_lock:
            self._queued.append(batch_op)
            if len(self._queued) == 1:
                self._deadline.arm()

    def flush(self) -> None:
        """Sends the queued completions now (one ``Batch``). Errors of queued ops are
        appended to ``deferred_errors`` and logged; transport errors raise."""
        with self._queue_lock:
            ops = self._take_queued()
            if ops:
                self._send_batch(ops)

    def _flush_on_deadline(self) -> None:
        """Run by the flush deadline's thread when no call carried the queue in time."""
        if self._closed or self._gone:
            return
        try:
            self.flush()
        except KvtierError as err:
            log.warning("session %s: sending queued completions failed: %s", self.session_id, err)

    def _take_queued(self) -> list[pb2.BatchOp]:
        ops, self._queued = self._queued, []
        if ops:
            self._deadline.disarm()
        return ops

    @staticmethod
    def _batch_op(op: _Op[Any], keys: Sequence[bytes], **fields: Any) -> pb2.BatchOp:
        request = op.request("", keys, **fields)  # the batch carries the session id
        return pb2.BatchOp(**{_BATCH_FIELD[op.rpc]: request})

    def _send_batch(self, ops: list[pb2.BatchOp], answered: int = 1) -> list[pb2.BatchResult]:
        """One ``Batch`` round trip; failures of the queued ops (all but the last
        ``answered``) are recorded in ``deferred_errors``."""
        self.rpcs += 1
        results = list(self._call(BATCH, ops))
        for result in results[: max(0, len(results) - answered)]:
            if result.code:
                self._record_deferred(result)
        return results

    def _record_deferred(self, result: pb2.BatchResult) -> None:
        err = self._error_of(result)
        log.warning("session %s: a queued completion failed: %s", self.session_id, err)
        self.deferred_errors.append(err)
        del self.deferred_errors[:-100]

    def _error_of(self, result: pb2.BatchResult) -> KvtierError:
        code = _STATUS_BY_VALUE.get(result.code, grpc.StatusCode.UNKNOWN)
        return error_class(code)(result.error, code, self.address)

    def _result(self, op: _Op[_R], result: pb2.BatchResult) -> _R:
        if result.code:
            err = self._error_of(result)
            if isinstance(err, NotFound):
                self._mark_gone()
            raise err
        return op.decode(getattr(result, _BATCH_FIELD[op.rpc]))

    def _mark_gone(self) -> None:
        super()._mark_gone()
        self._stop.set()
        self._deadline.stop()

    def _start_keepalive(self) -> None:
        interval = keepalive_interval(self.lease_ms)
        thread = threading.Thread(
            target=_keepalive_loop,
            args=(weakref.ref(self), self._stop, interval),
            name=f"kvtierd-keepalive-{self.session_id[:12]}",
            daemon=True,
        )
        self._keepalive_thread = thread
        thread.start()

    # -- RPCs ------------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[bytes], request_id: str = "", *, prefix: bool = False
    ) -> list[LookupResult]:
        """One ``LookupResult`` per key (RPC ``Lookup``); never changes recency.

        ``prefix``: ``keys`` are a prefix chain; every key after the first one that is
        neither HIT nor HIT_PENDING answers MISS and starts no promotion from a
        secondary tier (nothing after a miss would be loaded anyway).
        """
        return self._answer(LOOKUP, keys, request_id=request_id, prefix=prefix)

    def lookup_and_pin(
        self, keys: Sequence[bytes], request_id: str = "", *, prefix: bool = False
    ) -> tuple[list[LookupResult], list[int]]:
        """``lookup`` that also pins the keys answered HIT for this session, as
        ``prepare_load`` would (with ``prefix``, the leading HITs only), in the same
        round trip. Returns the results and the block ids, co-indexed with ``keys``
        (-1 where not pinned). Release the pins with ``complete_load``."""
        return self._answer(LOOKUP_AND_PIN, keys, request_id=request_id, prefix=prefix, pin=True)

    def batch(self, calls: Sequence[tuple[str, Sequence[bytes], dict[str, Any]]]) -> list[Any]:
        """Several manager calls in one ``Batch`` round trip, after any queued
        completions; the daemon runs them in order.

        ``calls``: ``(method, keys, options)`` with method one of ``lookup``,
        ``lookup_and_pin``, ``touch``, ``prepare_load``, ``complete_load``,
        ``prepare_store``, ``complete_store`` and options its keyword arguments
        (``request_id``, ``prefix``, ``success``). Returns per call what the method
        returns, or the ``KvtierError`` it failed with (returned, not raised: the
        other calls ran anyway).
        """
        ops = [_BATCH_METHODS[method] for method, _keys, _options in calls]
        carried = [
            self._batch_op(op, keys, **options, **({"pin": True} if op is LOOKUP_AND_PIN else {}))
            for op, (_method, keys, options) in zip(ops, calls, strict=True)
        ]
        with self._queue_lock:
            queued = self._take_queued()
            results = self._send_batch(queued + carried, answered=len(carried))
        out: list[Any] = []
        for op, result in zip(ops, results[len(queued) :], strict=True):
            try:
                out.append(self._result(op, result))
            except KvtierError as err:
                out.append(err)
        return out

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` recently used, the first most recent (RPC ``Touch``; queued
        with ``queue_completions``)."""
        self._complete(TOUCH, keys)

    def prepare_load(self, keys: Sequence[bytes], request_id: str = "") -> list[int]:
        """Pins ``keys`` for reading; returns their block ids, co-indexed (RPC ``PrepareLoad``).

        Raises ``FailedPrecondition`` when a key is not HIT (nothing is pinned then).
        """
        return self._answer(PREPARE_LOAD, keys, request_id=request_id)

    def complete_load(self, keys: Sequence[bytes], *, unused: bool = False) -> None:
        """Releases this session's pins on ``keys`` (RPC ``CompleteLoad``; queued with
        ``queue_completions``). They count as loads in the daemon's statistics unless
        ``unused``: the rows were not read (e.g. lookup pins no load claimed).

        Raises ``FailedPrecondition`` for keys this session did not pin (with
        ``queue_completions`` the error lands in ``deferred_errors`` instead).
        """
        self._complete(COMPLETE_LOAD, keys, unused=unused)

    def prepare_store(self, keys: Sequence[bytes], request_id: str = "") -> StoreResult | None:
        """Reserves rows for the keys not already present (RPC ``PrepareStore``).

        Returns the ``StoreResult`` (rows to write, evicted keys), or None when
        there is no room now (nothing changed).
        """
        return self._answer(PREPARE_STORE, keys, request_id=request_id)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Makes this session's reserved ``keys`` readable, or frees them when not
        ``success`` (RPC ``CompleteStore``; queued with ``queue_completions``);
        ready or absent keys are ignored."""
        self._complete(COMPLETE_STORE, keys, success=success)

    def take_events(self) -> list[pb2.Event]:
        """The pool's events since this session's last take (RPC ``TakeEvents``, one
        call per ~1 MiB of events: the daemon pages its answers)."""
        events: list[pb2.Event] = []
        while True:
            page = self._call(TAKE_EVENTS)
            events.extend(page.events)
            if not page.more:
                return events

    def keep_alive(self) -> int:
        """Renews the lease now and returns its length in ms (RPC ``KeepAlive``)."""
        self.lease_ms = self._call(KEEP_ALIVE)
        return self.lease_ms

    def close(self) -> None:
        """Stops the keepalive and closes the session (RPC ``CloseSession``): the daemon
        releases its pins and aborts its reservations. Idempotent; a session the
        daemon already dropped closes without error. Raises ``Unavailable`` /
        ``DeadlineExceeded`` when the daemon does not answer (the session stays
        closed locally and expires with its lease)."""
        if self._closed:
            return
        usable = not self._gone and not self.client.closed
        if usable:
            try:
                self.flush()  # queued completions reach the daemon before the close
            except KvtierError as err:
                log.warning(
                    "session %s: queued completions lost at close: %s", self.session_id, err
                )
        self._closed = True
        self._end_beacon()  # copiers stop before the daemon aborts the reservations
        self._stop.set()
        self._deadline.stop()
        self.client._forget(self)
        if not usable:
            return
        try:
            self.client._call(CLOSE_SESSION, self.session_id)
        except NotFound:
            self._gone = True

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _weak_flush(ref: weakref.ref[Session]) -> Callable[[], bool]:
    """The flush deadline's callback: flushes the session if it still exists."""

    def flush() -> bool:
        session = ref()
        if session is None:
            return False
        session._flush_on_deadline()
        return True

    return flush


def _keepalive_loop(ref: weakref.ref[Session], stop: threading.Event, interval: float) -> None:
    """Body of a session's keepalive thread; holds the session only while calling."""
    session = ref()
    if session is None:
        return
    streak = _FailureStreak(session.session_id)
    del session
    next_interval: float | None = interval
    while next_interval is not None and not stop.wait(next_interval):
        session = ref()
        if session is None:
            return
        next_interval = _keepalive_once(session, streak, next_interval)
        del session


def _keepalive_once(session: Session, streak: _FailureStreak, interval: float) -> float | None:
    deadline = keepalive_deadline(interval, session.client.timeout)
    outcome: int | KvtierError
    try:
        outcome = session._call(KEEP_ALIVE, timeout=deadline)
        session.lease_ms = outcome
    except KvtierError as err:
        outcome = err
    return after_keepalive(session, streak, outcome, interval)
