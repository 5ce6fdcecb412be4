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

The pieces: requests and answers in ``kvtierd_client._rpc.codec``, the channel in
``kvtierd_client._rpc.connection`` (shared with ``kvtierd_client.aio``), the session
in ``kvtierd_client.session``, its keepalive in ``kvtierd_client._rpc.keepalive``.
This module re-exports the names a user of the sync client needs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import grpc

from kvtierd_client._rpc.codec import EXPLAIN, FLUSH_POOL, GET_STATS, KEEP_ALIVE, OPEN_SESSION, Op
from kvtierd_client._rpc.completion_queue import DEFAULT_FLUSH_AFTER
from kvtierd_client._rpc.connection import (
    DEFAULT_CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT,
    Connection,
    WatchStream,
)
from kvtierd_client._rpc.fastlane import FastLane, offered
from kvtierd_client.errors import KvtierError, UntrustedAddress
from kvtierd_client.session import Session
from kvtierd_client.tls import sync_channel
from kvtierd_client.wire.proto import pb2
from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = [
    "DEFAULT_CHANNEL_OPTIONS",
    "DEFAULT_TIMEOUT",
    "Client",
    "EventStream",
    "LookupResult",
    "Session",
    "StoreResult",
]

R = TypeVar("R")

log = logging.getLogger(__name__)


class Client(Connection):
    """A connection to kvtierd over one gRPC channel (thread-safe).

    Arguments as :class:`kvtierd_client._rpc.connection.Connection`: ``address``,
    ``timeout`` (seconds, every call), ``channel_options``, ``token``, ``stub``,
    ``fast_lane``.
    Raises ``ValueError`` for a malformed address; an unreachable daemon shows up
    as ``Unavailable`` on the first call.
    """

    _open_channel = staticmethod(sync_channel)
    _closed_channel_error = ValueError  # grpc: "Cannot invoke RPC on closed channel!"

    def _call(self, op: Op[R], *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        """Runs ``op`` with a deadline; gRPC failures become ``KvtierError``."""
        method, request, deadline = self._prepare(op, args, kwargs, timeout)
        try:
            response = self._credentials.call(method, request, deadline)
        except (grpc.RpcError, ValueError) as err:
            self._raise_call_error(err)
        return op.decode(response)

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
        timeout: float | None = None,
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

        ``timeout``: this call's deadline; by default the client's timeout, at least
        ``OPEN_SESSION_TIMEOUT`` (120 s): the first session of a pool waits while the
        daemon creates its region (seconds per GiB).

        Raises ``InvalidArgument`` (bad name, block size, policy), ``FailedPrecondition``
        (the pool exists with another block size or layout), ``ResourceExhausted``
        (the memory budget cannot fit the pool), ``Unavailable``, ``DeadlineExceeded``,
        ``Unauthenticated`` / ``PermissionDenied``, ``UntrustedAddress`` (the socket, or a
        path the answer names, could be another user's: ``kvtierd_client.wire.trust``).
        """
        daemon_uid = self._daemon.daemon_uid()
        sent_at = time.monotonic()
        response = self._call(
            OPEN_SESSION, pool, block_bytes, num_blocks, layout, eviction_policy, client_name,
            timeout=self._open_session_timeout(timeout),
        )  # fmt: skip
        self._daemon.check_announced(response, daemon_uid)
        session = Session(
            self,
            response,
            sent_at,
            keepalive=keepalive,
            queue_completions=queue_completions,
            flush_after=flush_after,
        )
        session.daemon_uid = daemon_uid
        if self.fast_lane and offered(response):
            try:
                session._lane = FastLane(response, self.address, self.timeout, daemon_uid)
                self._keep_lane(session._lane)
            except UntrustedAddress:
                with contextlib.suppress(KvtierError):
                    session.close()
                raise
            except KvtierError as err:
                log.warning(
                    "kvtierd session %s: no fast lane, using gRPC: %s", session.session_id, err
                )
        self._register(session)
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
        try:
            call = self._watch(pool, after_seq, timeout)
        except (grpc.RpcError, ValueError) as err:
            self._raise_call_error(err)
        return EventStream(call, self)

    def close(self) -> None:
        """Closes every open session of this client (RPC ``CloseSession``, errors
        ignored), then the channel; ongoing event streams end. Idempotent."""
        for session in self._sessions_to_close():
            with self._closing(session):
                session.close()
        for lane in self._lanes_to_close():
            lane.close()
        channel = self._finish_close()
        if channel is not None:
            channel.close()
        self._credentials.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventStream(WatchStream, Iterator[pb2.Event]):
    """Iterator over a ``WatchEvents`` stream; ``cancel()`` ends it from any thread."""

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> pb2.Event:
        """The next event; blocks until one arrives. Raises a ``KvtierError`` subclass."""
        if self._cancelled:
            raise StopIteration
        try:
            event: pb2.Event = next(self._call)
        except grpc.RpcError as err:
            error = self._error_of(err)
            if error is None:
                raise StopIteration from None
            raise error from None  # the message says it all; __context__ keeps it
        return event

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()
