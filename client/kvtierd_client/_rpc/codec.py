"""The wire codec of kvtierd's manager RPCs: request building and response decoding.

Pure functions and tables, shared by the sync client (``kvtierd_client.client``)
and the asyncio client (``kvtierd_client.aio``) so both speak the wire the same
way. Nothing here opens a channel, holds state or blocks.

* one :class:`Op` per RPC (``LOOKUP``, ``PREPARE_STORE``, ...): the stub method
  name, the request encoder and the response decoder;
* ``Batch`` support: which ``BatchOp`` / ``BatchResult`` field carries each call
  (:data:`BATCH_FIELD`), :func:`batch_op` to wrap one call, :func:`batch_answer`
  to decode one result or turn its status into the ``KvtierError`` it stands for;
* :class:`EventPages`, the accumulator of a paged ``TakeEvents`` answer.

Malformed arguments raise ``InvalidArgument`` from :meth:`Op.request` (before any
I/O); an answer the client cannot decode raises ``Internal``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from kvtierd_client.errors import Internal, InvalidArgument, KvtierError, error_class
from kvtierd_client.wire.proto import pb2
from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = [
    "BATCH",
    "BATCH_FIELD",
    "BATCH_METHODS",
    "CLOSE_SESSION",
    "COMPLETE_LOAD",
    "COMPLETE_STORE",
    "EXPLAIN",
    "FLUSH_POOL",
    "GET_STATS",
    "KEEP_ALIVE",
    "LOOKUP",
    "LOOKUP_AND_PIN",
    "OPEN_SESSION",
    "PREPARE_LOAD",
    "PREPARE_STORE",
    "TAKE_EVENTS",
    "TOUCH",
    "WATCH_EVENTS",
    "EventPages",
    "Op",
    "auth_metadata",
    "batch_answer",
    "batch_op",
    "client_closed_error",
]

log = logging.getLogger(__name__)

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)  # an Op's answer type

_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


@dataclass(frozen=True)
class Op(Generic[R_co]):
    """One RPC: its stub method name, request encoder and response decoder."""

    rpc: str
    encode: Callable[..., Any]
    decode: Callable[[Any], R_co]

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


# -- encoders ----------------------------------------------------------------------------


def _key_list(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list of ``bytes`` (bytearray and memoryview are copied)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of bytes, not a single bytes or str value")
    return [bytes(k) if isinstance(k, (bytearray, memoryview)) else k for k in keys]


def _keys_request(request_type: Any) -> Callable[..., Any]:
    def encode(session_id: str, keys: Sequence[bytes], **fields: Any) -> Any:
        if isinstance(keys, (bytes, bytearray, str)):
            raise TypeError("keys must be a sequence of bytes, not a single bytes or str value")
        try:  # the usual case, all bytes: protobuf checks each key's type itself
            return request_type(session_id=session_id, keys=keys, **fields)
        except TypeError:  # bytearray / memoryview keys are copied; others raise
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


# -- decoders ----------------------------------------------------------------------------

_LOOKUP_RESULTS = {int(r): r for r in LookupResult}
_LOOKUP_RESULT_OF = _LOOKUP_RESULTS.__getitem__


def _decode_lookup(response: pb2.LookupResponse) -> list[LookupResult]:
    try:
        return list(map(_LOOKUP_RESULT_OF, response.results))
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


# -- the RPCs ----------------------------------------------------------------------------

OPEN_SESSION: Op[pb2.OpenSessionResponse] = Op("OpenSession", _encode_open_session, _same)
KEEP_ALIVE: Op[int] = Op(
    "KeepAlive", lambda sid: pb2.KeepAliveRequest(session_id=sid), _decode_lease
)
CLOSE_SESSION: Op[None] = Op(
    "CloseSession", lambda sid: pb2.CloseSessionRequest(session_id=sid), _nothing
)
LOOKUP: Op[list[LookupResult]] = Op("Lookup", _keys_request(pb2.LookupRequest), _decode_lookup)
LOOKUP_AND_PIN: Op[tuple[list[LookupResult], list[int]]] = Op(
    "Lookup",
    _keys_request(pb2.LookupRequest),
    lambda r: (_decode_lookup(r), list(r.block_ids)),
)
TOUCH: Op[None] = Op("Touch", _keys_request(pb2.TouchRequest), _nothing)
PREPARE_LOAD: Op[list[int]] = Op(
    "PrepareLoad", _keys_request(pb2.PrepareLoadRequest), _decode_block_ids
)
COMPLETE_LOAD: Op[None] = Op("CompleteLoad", _keys_request(pb2.CompleteLoadRequest), _nothing)
PREPARE_STORE: Op[StoreResult | None] = Op(
    "PrepareStore", _keys_request(pb2.PrepareStoreRequest), _decode_store
)
COMPLETE_STORE: Op[None] = Op("CompleteStore", _keys_request(pb2.CompleteStoreRequest), _nothing)
TAKE_EVENTS: Op[pb2.TakeEventsResponse] = Op(
    "TakeEvents", lambda sid: pb2.TakeEventsRequest(session_id=sid), _decode_events
)
GET_STATS: Op[pb2.GetStatsResponse] = Op(
    "GetStats", lambda pool: pb2.GetStatsRequest(pool=pool), _same
)
FLUSH_POOL: Op[int] = Op(
    "FlushPool", lambda pool: pb2.FlushPoolRequest(pool=pool), lambda r: r.evicted_blocks
)
BATCH: Op[Sequence[pb2.BatchResult]] = Op(
    "Batch", lambda sid, ops: pb2.BatchRequest(session_id=sid, ops=ops), lambda r: r.results
)
EXPLAIN: Op[pb2.ExplainResponse] = Op(
    "Explain", lambda pool, key: pb2.ExplainRequest(pool=pool, key=key), _same
)
WATCH_EVENTS: Op[Any] = Op(
    "WatchEvents", lambda pool, after: pb2.WatchEventsRequest(pool=pool, after_seq=after), _same
)

# -- Batch -------------------------------------------------------------------------------

BATCH_FIELD = {
    "Lookup": "lookup",
    "Touch": "touch",
    "PrepareLoad": "prepare_load",
    "CompleteLoad": "complete_load",
    "PrepareStore": "prepare_store",
    "CompleteStore": "complete_store",
}
"""The ``BatchOp`` / ``BatchResult`` field of each call that a ``Batch`` can carry."""

BATCH_METHODS: dict[str, Op[Any]] = {
    "lookup": LOOKUP,
    "lookup_and_pin": LOOKUP_AND_PIN,
    "touch": TOUCH,
    "prepare_load": PREPARE_LOAD,
    "complete_load": COMPLETE_LOAD,
    "prepare_store": PREPARE_STORE,
    "complete_store": COMPLETE_STORE,
}
"""``Session.batch`` method names -> the op each stands for."""


def batch_op(op: Op[Any], keys: Sequence[bytes], **fields: Any) -> pb2.BatchOp:
    """``op`` on ``keys`` as one op of a ``Batch`` (the batch carries the session id).

    Malformed arguments raise ``InvalidArgument``, as :meth:`Op.request`.
    """
    request = op.request("", keys, **fields)
    return pb2.BatchOp(**{BATCH_FIELD[op.rpc]: request})


def batch_error(result: pb2.BatchResult, address: str) -> KvtierError:
    """The ``KvtierError`` a failed ``BatchResult`` (``result.code`` != 0) stands for."""
    code = _STATUS_BY_VALUE.get(result.code, grpc.StatusCode.UNKNOWN)
    return error_class(code)(result.error, code, address)


def batch_answer(op: Op[R], result: pb2.BatchResult, address: str) -> R:
    """``op``'s decoded answer from its ``BatchResult``; raises the error it carries."""
    if result.code:
        raise batch_error(result, address)
    return op.decode(getattr(result, BATCH_FIELD[op.rpc]))


# -- helpers -----------------------------------------------------------------------------


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` as a bearer token (None without a token)."""
    return None if token is None else (("authorization", f"Bearer {token}"),)


def client_closed_error(address: str) -> KvtierError:
    """What a call on a closed client raises."""
    return KvtierError("the client is closed", grpc.StatusCode.CANCELLED, address)


@dataclass
class EventPages:
    """The events of a paged ``TakeEvents`` answer (the daemon pages at ~1 MiB).

    Invariant: ``more`` is True until a page said the session has no further events.
    """

    events: list[pb2.Event] = field(default_factory=list)
    more: bool = True

    def add(self, page: pb2.TakeEventsResponse) -> None:
        self.events.extend(page.events)
        self.more = page.more
