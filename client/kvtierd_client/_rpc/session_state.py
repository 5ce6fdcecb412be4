"""What a session knows about itself: identity, open/closed/gone, and its lease proof.

:class:`SessionState` is the base of the sync ``Session`` and the asyncio
``AsyncSession``; everything here is the same for both (no I/O). The write fence
(docs/design/leases.md) lives here: the lease deadline a copy must start before,
and the :class:`~kvtierd_client.lease_beacon.LeaseBeacon` that publishes it to
the processes that copy the session's rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtierd_client.errors import NotFound
from kvtierd_client.lease_beacon import LeaseBeacon
from kvtierd_client.wire.proto import pb2

__all__ = ["SESSION_GONE", "SessionState", "fence_margin"]

SESSION_GONE = "session expired or closed by the daemon"


def fence_margin(lease_ms: int) -> float:
    """Seconds the lease deadline keeps short of the proven lease: a tenth of it,
    at most half a second (time between the deadline check and the copy's start)."""
    return min(0.5, lease_ms / 10000.0)


class SessionState:
    """Identity and lifecycle of one session; the sync and async sessions extend it.

    ``session_id``, ``region`` (``pb2.Region``), ``pool`` (``pb2.PoolSpec``) and
    ``lease_ms`` come from the ``OpenSession`` answer (``lease_ms`` follows later
    KeepAlive answers).

    State: *open*, then *closed* (``close()`` was called) or *gone* (the daemon
    answered NOT_FOUND: expired or dropped). Both are final; ``closed`` reads True
    in either. The session's own thread (sync) or loop (async) and its keepalive
    change them; each flag only goes False -> True.
    """

    def __init__(self, address: str, response: pb2.OpenSessionResponse, sent_at: float) -> None:
        """``sent_at``: monotonic time the ``OpenSession`` was sent (the first lease proof)."""
        self.address = address
        self.session_id: str = response.session_id
        self.region: pb2.Region = response.region
        self.pool: pb2.PoolSpec = response.pool
        self.lease_ms: int = int(response.lease_ms)
        # the uid of the daemon that answered over a Unix socket, shown by its socket's
        # placement (kvtierd_client.wire.trust); None over TCP. Set by the client once.
        self.daemon_uid: int | None = None
        self._closed = False  # close() was called
        self._gone = False  # the daemon answered NOT_FOUND for this session
        # The write fence. The daemon renews a lease when a call *arrives*, which is
        # after this client sent it, so the send time of the newest answered call
        # plus the lease is a lower bound of the daemon's expiry. Monotonic seconds
        # (CLOCK_MONOTONIC: one clock for every process of the host).
        # Invariant: only grows; published to _beacon whenever it does.
        self._lease_proven_until = 0.0
        self._beacon: LeaseBeacon | None = None
        # the session's fast lane (kvtierd_client._rpc.fastlane), set by the client right
        # after OpenSession when the daemon offered one and it connected; None: gRPC
        self._lane: Any = None
        self._renewed(sent_at)

    # -- the lease proof -------------------------------------------------------------

    def _renewed(self, sent_at: float) -> None:
        """An answered call sent at ``sent_at`` (monotonic) proved the lease alive.

        A beacon already declared dead stays dead (``LeaseBeacon`` ignores it), so an
        answer that arrives after the session ended never revives the fence."""
        until = sent_at + self.lease_ms / 1000.0
        if until > self._lease_proven_until:
            self._lease_proven_until = until
            if self._beacon is not None:
                self._beacon.publish(until)

    def _tracked_call(self) -> _TrackedCall:
        """The context manager to send one call of this session in: it refuses the call
        once the session is closed or gone, marks the session gone on ``NotFound``,
        and counts an answer as a lease proof from the moment the call was sent.
        Usable around an ``await`` too."""
        self._check_usable()
        return _TrackedCall(self)

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

    # -- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or the daemon dropped the session."""
        return self._closed or self._gone

    @property
    def gone(self) -> bool:
        """True once the daemon answered NOT_FOUND (expired or dropped), not by ``close()``."""
        return self._gone and not self._closed

    def _check_usable(self) -> None:
        if self._gone:
            raise NotFound(f"{SESSION_GONE} (session {self.session_id})", address=self.address)
        if self._closed:
            raise NotFound(f"session {self.session_id} is closed", address=self.address)

    def _mark_gone(self) -> None:
        """The daemon no longer knows this session: copiers must stop now."""
        self._gone = True
        if self._beacon is not None:
            self._beacon.declare_dead()

    def _begin_close(self) -> None:
        """Marks the session closed and removes its beacon: copiers stop before the
        ``CloseSession`` makes the daemon abort the reservations."""
        self._closed = True
        if self._beacon is not None:
            self._beacon.close()

    @property
    def fast_lane(self) -> bool:
        """Whether this session's hot calls go over its fast lane now (else gRPC)."""
        return self._lane is not None and self._lane.usable

    def _close_lane(self) -> None:
        """Closes the fast lane, if any (the daemon closes the session with it)."""
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()

    @contextmanager
    def _closing_call(self) -> Iterator[None]:
        """Wraps the ``CloseSession`` call: NOT_FOUND means the daemon already forgot it."""
        try:
            yield
        except NotFound:
            self._gone = True

    def __repr__(self) -> str:
        state = "gone" if self._gone else "closed" if self._closed else "open"
        return (
            f"<{type(self).__name__} {self.session_id} pool={self.pool.name!r} "
            f"rows={self.region.num_blocks}x{self.region.block_bytes} {state}>"
        )


class _TrackedCall:
    """See :meth:`SessionState._tracked_call` (a class: it is on every call's path)."""

    __slots__ = ("_sent_at", "_state")

    def __init__(self, state: SessionState) -> None:
        self._state = state
        self._sent_at = time.monotonic()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self._state._renewed(self._sent_at)
        elif isinstance(exc, NotFound):
            self._state._mark_gone()
