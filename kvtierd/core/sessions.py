"""Sessions and their leases.

A session is one connected client bound to one pool. Any call on a session, and
KeepAlive, renews its lease: the servicer calls :meth:`SessionTable.renew` once
it has validated the call (:meth:`SessionTable.get` only finds the session). A
session whose lease ran out is closed by the reaper, which releases its pins
and aborts its reservations through the pool (``Pool.release_session``). The rows of those
aborted reservations stay quarantined for ``write_quarantine`` seconds, so a
writer that lost its lease cannot overwrite a block another session stored in
the same row (docs/design/leases.md). Session ids are random 128-bit hex
strings, so a restarted daemon never mistakes an old client for a live one.

Leases measure the clients, not the daemon: when the daemon's own event loop
did not run for a while (a stall), :meth:`SessionTable.credit_stall` moves every
lease forward by that time, so no session expires because the daemon was busy.

Each session's ``TakeEvents`` cursor is owned here and moved only by
:meth:`SessionTable.take_events`. A session belongs to the principal that opened
it (``Session.principal``; docs/security.md, "Principals and per-pool authorization"):
``get`` and ``close`` given another principal refuse with ``AccessDenied``.

Event-loop only. ``clock`` is injectable for tests.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtierd.core.pool import Pool
from kvtierd.errors import ResourceExhausted, SessionNotFound
from kvtierd.records.events import LoggedEvent
from kvtierd.security.access import session_not_owned

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Session:
    """One open session. Its fields change only through its :class:`SessionTable`."""

    id: str
    pool: Pool
    client_name: str
    peer: str
    opened_at: float
    expires_at: float  # on the table's clock; moved by renew() and credit_stall()
    events_cursor: int  # last event seq this session has taken; moved by take_events()
    principal: str = "*"  # who opened it; only this principal may use it (security)

    @property
    def pool_name(self) -> str:
        return self.pool.spec.name


@dataclass(frozen=True, slots=True)
class TakenEvents:
    """One TakeEvents answer: the events after the session's cursor, how many of
    those the bounded log dropped before they were taken, and whether more follow
    (the answer was cut at its byte limit)."""

    events: list[tuple[int, LoggedEvent]]  # (seq, event), oldest first
    dropped: int
    more: bool


class SessionTable:
    def __init__(
        self,
        lease_seconds: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
        write_quarantine: float | None = None,
    ) -> None:
        """``write_quarantine``: seconds the rows of reservations aborted by a
        session's end stay unusable (default: one lease)."""
        self.lease_seconds = lease_seconds
        self.write_quarantine = lease_seconds if write_quarantine is None else write_quarantine
        # how long after a grant its client may still touch the rows it holds: the
        # lease it proves, then the write fence (Pool.cover_leases)
        self.client_fence_seconds = self.lease_seconds + self.write_quarantine
        self.stalls_credited = 0.0  # seconds of daemon stalls added to every lease
        self._max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        # (event "opened" / "closed" / "expired", session, reason); set by the daemon (audit)
        self.observe_session: Callable[[str, Session, str], None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    @property
    def lease_ms(self) -> int:
        return int(self.lease_seconds * 1000)

    def open(self, pool: Pool, client_name: str, peer: str, principal: str = "*") -> Session:
        if len(self._sessions) >= self._max_sessions:
            raise ResourceExhausted(
                f"{len(self._sessions)} sessions are open, the limit is {self._max_sessions} "
                "(sessions.max_sessions); close sessions you no longer use"
            )
        now = self._clock()
        session = Session(
            id=secrets.token_hex(16),
            pool=pool,
            client_name=client_name,
            peer=peer,
            opened_at=now,
            expires_at=now + self.lease_seconds,
            events_cursor=pool.events.last_seq,
            principal=principal,
        )
        pool.cover_leases(self.client_fence_seconds)  # before the lease is granted
        self._sessions[session.id] = session
        pool.attach(session.id)
        log.info(
            "session %s opened: pool %s, client %r, peer %s",
            session.id, pool.spec.name, client_name, peer,
        )  # fmt: skip
        if self.observe_session is not None:
            self.observe_session("opened", session, "")
        return session

    def get(self, session_id: str, principal: str | None = None) -> Session:
        """The live session; changes nothing (its lease included). With
        ``principal``, a session another principal opened is refused
        (``AccessDenied``).

        Raises :class:`SessionNotFound` if it is unknown, closed or expired."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(
                f"session {session_id[:64]!r} is unknown, closed or expired; open a new session"
            )
        _check_owner(session, principal)
        return session

    def renew(self, session: Session) -> None:
        """Moves the session's lease to one lease from now: a call from its client
        is proof of life. The servicer calls it for every validated call. The
        pool's journal learns first how far the lease may reach (its horizon:
        what a crash holds, docs/design/journal.md)."""
        session.pool.cover_leases(self.client_fence_seconds)
        session.expires_at = self._clock() + self.lease_seconds

    def take_events(self, session: Session, max_bytes: int) -> TakenEvents:
        """The pool's events after the session's cursor, at most ``max_bytes`` of them
        (at least one: a reader always moves on); moves the cursor past them.

        Invariant: every event with seq <= ``events_cursor`` was either taken by
        this session or dropped by the log before it was (and counted in some
        answer's ``dropped``)."""
        log = session.pool.events
        events, dropped = log.since(session.events_cursor, max_bytes)
        session.events_cursor = events[-1][0] if events else log.last_seq
        return TakenEvents(events, dropped, more=session.events_cursor < log.last_seq)

    def credit_stall(self, seconds: float) -> None:
        """Moves every lease ``seconds`` forward: the daemon's loop did not run for
        that long, so no client could be heard (their calls waited in the sockets)."""
        if seconds <= 0:
            return
        for session in self._sessions.values():
            session.expires_at += seconds
        self.stalls_credited += seconds

    def close(
        self,
        session_id: str,
        reason: str = "closed by client",
        principal: str | None = None,
    ) -> None:
        """Closes a live session; with ``principal``, as ``get`` refuses another's."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id[:64]!r} is unknown, closed or expired")
        _check_owner(session, principal)
        del self._sessions[session_id]
        self._release(session, reason, "closed")

    def expire(self) -> int:
        """Closes every session whose lease ran out; returns how many."""
        now = self._clock()
        expired = [s for s in self._sessions.values() if s.expires_at <= now]
        for session in expired:
            del self._sessions[session.id]
            self._release(
                session, f"lease expired ({self.lease_seconds:g}s without a call)", "expired"
            )
        return len(expired)

    def close_all(self, reason: str) -> None:
        """Closes every session: the daemon stops. Their clients learn it only when
        their leases run out, so each session's rows are held until then, plus
        ``write_quarantine`` (``Pool.hold_for_stop``: the journal's stop records),
        its aborted reservations' rows included."""
        now = self._clock()
        while self._sessions:
            _, session = self._sessions.popitem()
            # the client proves at most one lease from its last answered call
            until = now + min(max(0.0, session.expires_at - now), self.lease_seconds)
            until += self.write_quarantine
            session.pool.hold_for_stop(session.id, until)
            self._release(session, reason, "closed", quarantine_until=until)

    def _release(
        self, session: Session, reason: str, event: str, quarantine_until: float | None = None
    ) -> None:
        if quarantine_until is None:
            quarantine_until = self._clock() + self.write_quarantine
        pins, reservations = session.pool.release_session(session.id, quarantine_until)
        log.info(
            "session %s (%r, pool %s) %s: released %d pins, aborted %d reservations",
            session.id, session.client_name, session.pool.spec.name, reason, pins,
            reservations,
        )  # fmt: skip
        if self.observe_session is not None:
            self.observe_session(event, session, reason)


def _check_owner(session: Session, principal: str | None) -> None:
    """Raises ``AccessDenied`` when ``principal`` (None: no check) did not open ``session``."""
    if principal is not None and principal != session.principal:
        raise session_not_owned(session.id, session.pool.spec.name, session.principal, principal)
