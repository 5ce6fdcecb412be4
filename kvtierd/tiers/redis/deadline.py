"""A deadline per Redis call, over redis-py's per-``recv`` socket timeout.

redis-py's ``socket_timeout`` bounds each ``recv``, not a call: a node (or a
middlebox) that sends one byte of its answer every second never trips it, so a
call lasts as long as its answer has bytes -- while the cascade it serves holds
its primary block pinned (an attack test: 88 % of an engine's stores refused).
:class:`CallDeadlines` is a watchdog: a call registers its connection
(:meth:`CallDeadlines.watch`); past its deadline the watchdog shuts the
connection's socket down, the blocked ``recv`` returns, and the call's
:class:`Watched` says it ``expired`` (the caller then raises a
``redis.TimeoutError``, so the node is skipped as for any timeout).

A new connection's handshake (``CLIENT SETINFO``, ``AUTH``), run by redis-py
inside ``get_connection``, is watched too: :func:`deadline_connection_class`
makes the connection class the link's clients use.

Threads: the I/O threads register and unregister calls; one watchdog thread per
:class:`CallDeadlines` (started at the first call, a daemon thread) shuts down
overdue sockets. ``_lock`` guards ``_calls`` and ``_closed``; no socket call is
made under it except ``shutdown`` (non-blocking).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis


class Watched:
    """One call under watch; ``expired`` is set (once) by the watchdog."""

    __slots__ = ("expired",)

    def __init__(self) -> None:
        self.expired = False


class CallDeadlines:
    """Shuts down the socket of every watched call still running ``seconds`` after
    it started (module doc)."""

    def __init__(
        self, seconds: float, name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock``: monotonic seconds, the watched calls' start and the watchdog's
        now. The watchdog waits for real between its passes; a test on a fake clock
        makes a pass of its own (:meth:`cut_overdue`)."""
        self.seconds = seconds
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._calls: dict[int, tuple[float, Any, Watched]] = {}  # id -> (deadline, conn, call)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.expired = 0  # calls cut so far (guarded by _lock)

    @contextlib.contextmanager
    def watch(self, connection: Any) -> Iterator[Watched]:
        """Watches the call made on ``connection`` (a redis-py ``Connection``) within
        the block."""
        call = Watched()
        call_id = next(self._ids)
        with self._lock:
            self._calls[call_id] = (self._clock() + self.seconds, connection, call)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name=f"kvtierd-redis-deadline-{self._name}", daemon=True
                )
                self._thread.start()
        try:
            yield call
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def cut_overdue(self) -> int:
        """One watchdog pass now: every watched call past its deadline is cut (its
        socket shut down, its :class:`Watched` marked expired); returns how many."""
        with self._lock:
            return self._cut_overdue(self._clock())

    def _run(self) -> None:
        with self._wake:
            while not self._closed:
                now = self._clock()
                self._cut_overdue(now)
                soonest = min((d for d, _, _ in self._calls.values()), default=now + self.seconds)
                self._wake.wait(max(0.01, soonest - now))

    def _cut_overdue(self, now: float) -> int:
        """Under ``_lock``."""
        overdue = [key for key, (deadline, _, _) in self._calls.items() if deadline <= now]
        for key in overdue:
            _, connection, call = self._calls.pop(key)
            call.expired = True
            self.expired += 1
            sock = getattr(connection, "_sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # the blocked recv returns
        return len(overdue)


def deadline_connection_class(
    deadlines: CallDeadlines, tls: bool = False
) -> type[redis.Connection]:
    """A connection class (TCP, or TLS with ``tls``: redis-py's SSLConnection) whose
    Redis handshake (``AUTH``, ``CLIENT SETINFO``) runs under ``deadlines``: a
    handshake the watchdog cut raises ``redis.TimeoutError``. (The TLS handshake
    itself is bounded by the connect timeout.)"""
    base: type[redis.Connection] = redis.SSLConnection if tls else redis.Connection

    def watched(handshake: Any, connection: redis.Connection, *args: Any, **kwargs: Any) -> None:
        call = Watched()
        try:
            with deadlines.watch(connection) as call:
                handshake(connection, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if call.expired:
                raise redis.TimeoutError(
                    f"no handshake within {deadlines.seconds:g}s: the connection was cut"
                ) from exc
            raise

    class DeadlineConnection(base):  # type: ignore[valid-type,misc]
        # redis-py >= 6 connects through on_connect_check_health, older ones on_connect
        if hasattr(redis.Connection, "on_connect_check_health"):

            def on_connect_check_health(self, *args: Any, **kwargs: Any) -> None:
                watched(base.on_connect_check_health, self, *args, **kwargs)

        else:  # pragma: no cover - redis-py 5

            def on_connect(self) -> None:
                watched(base.on_connect, self)

    return DeadlineConnection
