"""The sync client's session: manager calls of one pool, its keepalive and its queue.

A :class:`Session` is returned by ``Client.open_session``. Its calls go through
the client's channel; with ``queue_completions`` the completions wait in a
:class:`~kvtierd_client._rpc.completion_queue.CompletionQueue` for the next call that
needs an answer (one ``Batch``), and a
:class:`~kvtierd_client._rpc.keepalive.KeepaliveThread` renews the lease.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvtierd_client._rpc.codec import (
    BATCH,
    BATCH_METHODS,
    CLOSE_SESSION,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    KEEP_ALIVE,
    LOOKUP,
    LOOKUP_AND_PIN,
    PREPARE_LOAD,
    PREPARE_STORE,
    TAKE_EVENTS,
    TOUCH,
    EventPages,
    Op,
    batch_answer,
    batch_error,
    batch_op,
)
from kvtierd_client._rpc.completion_queue import DEFAULT_FLUSH_AFTER, CompletionQueue
from kvtierd_client._rpc.flusher import FlushStatistics
from kvtierd_client._rpc.keepalive import KeepaliveThread
from kvtierd_client._rpc.session_state import SessionState
from kvtierd_client.errors import KvtierError, NotFound
from kvtierd_client.wire.descriptions import BlockDescription, description_problem
from kvtierd_client.wire.lane_frames import LANE_METHODS
from kvtierd_client.wire.proto import pb2
from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = ["Session", "SessionOwner"]

log = logging.getLogger(__name__)

R = TypeVar("R")


class SessionOwner(Protocol):
    """What a :class:`Session` uses of the client that opened it
    (:class:`kvtierd_client.client.Client`): its address, its deadline and its calls."""

    address: str
    timeout: float

    @property
    def closed(self) -> bool: ...

    def _call(self, op: Op[R], *args: Any, timeout: float | None = None, **kwargs: Any) -> R: ...

    def _lane_request(
        self, op: Op[Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> tuple[Any, float]: ...

    def _forget(self, session: SessionState) -> None: ...


class Session(SessionState):
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

    ``keepalive``: the thread renewing the lease (None without keepalive);
    ``rpcs``: round trips made by this session's manager calls (not keepalives),
    which its owner may reset; ``deferred_errors``: failures of queued ops.
    """

    def __init__(
        self,
        client: SessionOwner,
        response: pb2.OpenSessionResponse,
        sent_at: float,
        *,
        keepalive: bool = True,
        queue_completions: bool = False,
        flush_after: float = DEFAULT_FLUSH_AFTER,
    ) -> None:
        super().__init__(client.address, response, sent_at)
        self.client = client
        self.queue_completions = queue_completions
        self._queue = CompletionQueue(self.session_id, _weak_flush(weakref.ref(self)), flush_after)
        self.rpcs = 0
        self.keepalive: KeepaliveThread | None = None
        if keepalive:
            self.keepalive = KeepaliveThread(self, lambda: client.timeout)

    @property
    def deferred_errors(self) -> list[KvtierError]:
        """Failures of queued ops, most recent last (the last 100)."""
        return self._queue.deferred_errors

    def flush_statistics(self) -> FlushStatistics:
        """How the queue's flush deadline has worked so far (``queue_completions``)."""
        return self._queue.statistics()

    # -- plumbing --------------------------------------------------------------------

    def _call(self, op: Op[R], *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        with self._tracked_call():
            lane = self._lane
            if lane is not None and op.rpc in LANE_METHODS and lane.usable:
                # Client._lane_call inlined (the lane's per-call path): the same checks
                request, deadline = self.client._lane_request(
                    op, (self.session_id, *args), kwargs, timeout
                )
                return op.decode(lane.call(op.rpc, request, deadline))
            return self.client._call(op, self.session_id, *args, timeout=timeout, **kwargs)

    def _answer(self, op: Op[R], keys: Sequence[bytes], **fields: Any) -> R:
        """A call that needs its answer: alone, or carrying the queued completions."""
        with self._queue.lock:
            if not self._queue:
                self.rpcs += 1
                return self._call(op, keys, **fields)
            ops = self._queue.take()
            ops.append(batch_op(op, keys, **fields))
            results = self._send_batch(ops)
        return self._result(op, results[-1])

    def _complete(self, op: Op[None], keys: Sequence[bytes], **fields: Any) -> None:
        """A completion: queued when ``queue_completions``, else sent at once."""
        if not self.queue_completions:
            self.rpcs += 1
            self._call(op, keys, **fields)
            return
        self._check_usable()
        self._queue.put(batch_op(op, keys, **fields))

    def flush(self) -> None:
        """Sends the queued completions now (one ``Batch``). Errors of queued ops are
        appended to ``deferred_errors`` and logged; transport errors raise."""
        with self._queue.lock:
            ops = self._queue.take()
            if ops:
                self._send_batch(ops)

    def _flush_on_deadline(self) -> None:
        """Run by the flush deadline's thread when no call carried the queue in time."""
        if self.closed:
            return
        try:
            self.flush()
        except KvtierError as err:
            log.warning("session %s: sending queued completions failed: %s", self.session_id, err)

    def _send_batch(self, ops: list[pb2.BatchOp], answered: int = 1) -> list[pb2.BatchResult]:
        """One ``Batch`` round trip; failures of the queued ops (all but the last
        ``answered``) are recorded in ``deferred_errors``."""
        self.rpcs += 1
        results = list(self._call(BATCH, ops))
        for result in results[: max(0, len(results) - answered)]:
            if result.code:
                self._queue.record_failure(batch_error(result, self.address))
        return results

    def _result(self, op: Op[R], result: pb2.BatchResult) -> R:
        try:
            return batch_answer(op, result, self.address)
        except NotFound:
            self._mark_gone()
            raise

    def _mark_gone(self) -> None:
        super()._mark_gone()
        self._stop_background()

    def _stop_background(self) -> None:
        """Stops the keepalive thread and the queue's flush deadline (not joined);
        closes the fast lane of a session the daemon dropped."""
        if self._gone:
            self._close_lane()
        if self.keepalive is not None:
            self.keepalive.stop()
        self._queue.stop()

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
        ops = [BATCH_METHODS[method] for method, _keys, _options in calls]
        carried = [
            batch_op(op, keys, **options, **({"pin": True} if op is LOOKUP_AND_PIN else {}))
            for op, (_method, keys, options) in zip(ops, calls, strict=True)
        ]
        with self._queue.lock:
            queued = self._queue.take()
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

    def complete_store(
        self,
        keys: Sequence[bytes],
        success: bool = True,
        descriptions: Sequence[BlockDescription | None] | None = None,
    ) -> None:
        """Makes this session's reserved ``keys`` readable, or frees them when not
        ``success`` (RPC ``CompleteStore``; queued with ``queue_completions``);
        ready or absent keys are ignored.

        ``descriptions``: None, or one per key (None for a key left undescribed):
        the blocks as the engine hashes them, which a daemon publishing KV events
        needs to announce the key to routers (a key without one is announced to
        none). Raises ValueError, before anything is sent, for a bad one."""
        if descriptions is None:
            self._complete(COMPLETE_STORE, keys, success=success)
            return
        wire = describe_on_wire(keys, descriptions)
        self._complete(COMPLETE_STORE, keys, success=success, descriptions=wire)

    def take_events(self) -> list[pb2.Event]:
        """The pool's events since this session's last take (RPC ``TakeEvents``, one
        call per ~1 MiB of events: the daemon pages its answers)."""
        pages = EventPages()
        while pages.more:
            pages.add(self._call(TAKE_EVENTS))
        return pages.events

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
        self._begin_close()
        self._stop_background()
        self.client._forget(self)
        try:
            if usable:
                with self._closing_call():
                    self.client._call(CLOSE_SESSION, self.session_id)
        finally:
            self._close_lane()  # after CloseSession: the close is answered, not implied

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
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


def describe_on_wire(
    keys: Sequence[bytes], descriptions: Sequence[BlockDescription | None]
) -> list[pb2.BlockDescription]:
    """``descriptions`` as ``CompleteStoreRequest.descriptions`` (co-indexed with
    ``keys``; None becomes an empty entry). ValueError names the first bad one."""
    if len(descriptions) != len(keys):
        raise ValueError(f"{len(descriptions)} descriptions for {len(keys)} keys; give one a key")
    wire = []
    for index, described in enumerate(descriptions):
        if described is None:
            wire.append(pb2.BlockDescription())
            continue
        problem = description_problem(
            described.block_hashes,
            described.parent_block_hash,
            described.token_ids,
            described.block_size,
        )
        if problem is not None:
            raise ValueError(f"descriptions[{index}] {problem}")
        wire.append(
            pb2.BlockDescription(
                block_hashes=described.block_hashes,
                parent_block_hash=described.parent_block_hash,
                token_ids=described.token_ids,
                block_size=described.block_size,
                lora_name=described.lora_name,
                group_idx=described.group_idx,
            )
        )
    return wire
