"""Keepalive of a session's lease, for the sync and the asyncio client alike.

:class:`KeepaliveSchedule` is the whole logic and does no I/O: when the next
``KeepAlive`` is due (a third of the lease), the deadline of that call (never
longer than the interval), what its outcome means (a new lease length, one
warning per failure streak, stop once the session is closed or gone) and the
counts behind :meth:`KeepaliveSchedule.statistics`. Two thin drivers run it:

* :class:`KeepaliveThread`: a daemon thread, for ``kvtierd_client.client.Session``;
* :class:`KeepaliveTask`: an asyncio task, for ``kvtierd_client.aio.AsyncSession``.

Invariant: a driver holds its session only through a weak reference, except
during one call (a :class:`Beat`), so a session nobody references is collected
and its keepalive ends at the next beat; the lease then expires on the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtierd_client._rpc.codec import KEEP_ALIVE
from kvtierd_client._rpc.session_state import SESSION_GONE, SessionState
from kvtierd_client.errors import KvtierError, NotFound

__all__ = [
    "Beat",
    "KeepaliveSchedule",
    "KeepaliveStatistics",
    "KeepaliveTask",
    "KeepaliveThread",
    "keepalive_deadline",
    "keepalive_interval",
]

log = logging.getLogger(__name__)

MIN_KEEPALIVE_DEADLINE = 0.1  # seconds: the shortest deadline of a background KeepAlive

S = TypeVar("S", bound=SessionState)


def keepalive_interval(lease_ms: int) -> float:
    """Seconds between two KeepAlive calls for a lease of ``lease_ms``: a third of it."""
    return max(lease_ms, 1) / 3000.0


def keepalive_deadline(interval: float, timeout: float) -> float:
    """Deadline of one background KeepAlive: never longer than the interval."""
    return max(min(timeout, interval), MIN_KEEPALIVE_DEADLINE)


@dataclass(frozen=True)
class KeepaliveStatistics:
    """A snapshot of one session's keepalive.

    ``renewals`` / ``failures``: KeepAlive calls answered / failed so far;
    ``failing``: the last one failed (a failure streak is on); ``running``: the
    thread or task is alive; ``interval_s``: seconds between calls now, None once
    the schedule has stopped (session closed, gone or collected).
    """

    renewals: int
    failures: int
    failing: bool
    running: bool
    interval_s: float | None


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


class Beat(Generic[S]):
    """One due KeepAlive: the session to renew (None when it was collected: the
    keepalive ends) and the call's ``deadline`` in seconds. The driver sends the
    call and reports the lease it got with :meth:`answered`."""

    def __init__(self, session: S | None, deadline: float) -> None:
        self.session = session
        self.deadline = deadline
        self.lease_ms: int | None = None

    def answered(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms


class KeepaliveSchedule(Generic[S]):
    """When to renew ``session``'s lease and what each outcome means (no I/O).

    ``timeout``: the client's call deadline (read at each beat). Owned by one
    driver; only its thread or task touches it, so it needs no lock.

    Invariant: ``interval`` is None once the schedule stopped, and then stays None.
    """

    def __init__(self, session: S, timeout: Callable[[], float]) -> None:
        self._ref = weakref.ref(session)
        self._timeout = timeout
        self._streak = _FailureStreak(session.session_id)
        self.interval: float | None = keepalive_interval(session.lease_ms)
        self.renewals = 0
        self.failures = 0

    @contextmanager
    def beat(self) -> Iterator[Beat[S]]:
        """One KeepAlive, sent by the caller inside the block. A ``KvtierError``
        raised there is its outcome (logged, not raised); so is the lease passed to
        ``Beat.answered``. Updates ``interval`` from that outcome on the way out and
        drops the beat's reference to the session."""
        assert self.interval is not None, "beat() after the schedule stopped"
        beat = Beat(self._ref(), keepalive_deadline(self.interval, self._timeout()))
        try:
            yield beat
        except KvtierError as err:
            self._record(beat.session, err)
        else:
            self._record(beat.session, beat.lease_ms)
        finally:
            beat.session = None

    def _record(self, session: S | None, outcome: int | KvtierError | None) -> None:
        if session is None or outcome is None:
            self.interval = None  # collected: nobody uses the session any more
            return
        if isinstance(outcome, KvtierError):
            self.failures += 1
        else:
            self.renewals += 1
            session.lease_ms = outcome
        self.interval = self._next_interval(session, outcome)

    def _next_interval(self, session: S, outcome: int | KvtierError) -> float | None:
        """The next interval after one KeepAlive ``outcome``, or None to stop."""
        assert self.interval is not None
        if session.closed:
            if isinstance(outcome, NotFound) and session.gone:
                log.warning("kvtierd session %s: %s; its pins and reservations are released",
                            session.session_id, SESSION_GONE)  # fmt: skip
            return None
        if isinstance(outcome, KvtierError):
            self._streak.failed(outcome, self.interval)
            return self.interval
        self._streak.succeeded()
        return keepalive_interval(outcome)

    def stopped(self) -> None:
        """The driver ended (told to stop, or the schedule said so): no more beats."""
        self.interval = None

    def statistics(self, running: bool) -> KeepaliveStatistics:
        return KeepaliveStatistics(
            renewals=self.renewals,
            failures=self.failures,
            failing=self._streak.failing,
            running=running,
            interval_s=self.interval,
        )


class KeepaliveThread:
    """Renews a sync session's lease from a daemon thread (started here) until
    :meth:`stop`, the session ends, or nobody references the session."""

    def __init__(self, session: Any, timeout: Callable[[], float]) -> None:
        self._schedule: KeepaliveSchedule[Any] = KeepaliveSchedule(session, timeout)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvtierd-keepalive-{session.session_id[:12]}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        schedule = self._schedule
        try:
            while schedule.interval is not None and not self._stop.wait(schedule.interval):
                with schedule.beat() as beat:
                    if beat.session is not None:
                        beat.answered(beat.session._call(KEEP_ALIVE, timeout=beat.deadline))
        finally:
            schedule.stopped()

    def stop(self) -> None:
        """No more KeepAlives; the thread exits at once if it waits (not joined)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds for the thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def daemon(self) -> bool:
        """True: the thread never keeps the interpreter from exiting."""
        return self._thread.daemon

    def statistics(self) -> KeepaliveStatistics:
        return self._schedule.statistics(running=self._thread.is_alive())


class KeepaliveTask:
    """Renews an asyncio session's lease from a task of the running loop (created
    here) until :meth:`stop`, the session ends, or nobody references the session."""

    def __init__(self, session: Any, timeout: Callable[[], float]) -> None:
        self._schedule: KeepaliveSchedule[Any] = KeepaliveSchedule(session, timeout)
        self._task: asyncio.Task[None] = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvtierd-keepalive-{session.session_id[:12]}"
        )

    async def _run(self) -> None:
        schedule = self._schedule
        try:
            while schedule.interval is not None:
                await asyncio.sleep(schedule.interval)
                with schedule.beat() as beat:
                    if beat.session is not None:
                        beat.answered(await beat.session._call(KEEP_ALIVE, timeout=beat.deadline))
        finally:
            schedule.stopped()

    def stop(self) -> asyncio.Task[None] | None:
        """Cancels the task, unless it is the caller (a keepalive that learnt the
        session is gone: its schedule stops by itself). Returns the cancelled task,
        for the caller to await."""
        if self._task.done() or self._task is asyncio.current_task():
            return None
        self._task.cancel()
        return self._task

    async def wait_stopped(self) -> None:
        """Returns once the task has ended (stopped, session ended or collected)."""
        await asyncio.wait([self._task])

    def statistics(self) -> KeepaliveStatistics:
        return self._schedule.statistics(running=not self._task.done())
