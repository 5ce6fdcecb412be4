"""The deadline that sends a session's queued completions when no call carries them.

A session with ``queue_completions`` keeps ``CompleteStore`` / ``CompleteLoad`` /
``Touch`` in a queue until the next call that needs an answer carries them in one
``Batch``. When no such call comes, they must still leave within ``after``
seconds of the oldest one being queued. That deadline used to be a
``threading.Timer`` per non-empty queue: a new thread per engine step, and
``Thread.start`` blocks until the new thread has run, which on a loaded machine
costs the caller a scheduling slice (milliseconds) on its critical path.

:class:`FlushDeadline` keeps one thread per session instead. While the
session is active (something was queued in the last :data:`IDLE_EXIT` seconds),
the thread wakes every ``after`` seconds on its own (a *tick*; at most
:data:`IDLE_EXIT`), and flushes a queue whose oldest entry is ``after`` old. A
completion queued during a tick has its deadline after that tick ends, so
:meth:`FlushDeadline.arm` wakes nobody: it records the time and returns. It
notifies only a thread that sleeps past the new deadline (``after`` below
:data:`MIN_TICK`). In the steady state, where each step's call carries the
previous step's completions, no step starts a thread or signals one; the flusher
costs one wakeup per tick. After :data:`IDLE_EXIT` seconds with nothing queued
the thread exits, and the next queued completion starts a new one.

Invariants:

* ``arm`` is called when the queue goes from empty to non-empty and ``disarm``
  when it is emptied, both under the session's queue lock. Lock order: the
  session's queue lock, then the deadline's condition lock. The flusher calls
  ``flush`` holding neither.
* ``_wake_at`` is the time the sleeping flusher wakes by itself, 0 while it is
  awake (then it reads ``_since`` before it sleeps again); ``arm`` notifies iff
  ``_wake_at`` is later than the new deadline. So no deadline is ever missed.
* the flusher holds the session only through ``flush`` (a callable that holds a
  weak reference), so a session nobody references can be collected.
* ``flush`` may find the queue already taken by a call (it then sends nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

IDLE_EXIT = 1.0  # seconds a flusher with nothing queued ticks before its thread exits
MIN_TICK = 0.001  # seconds; the shortest tick (a shorter ``after`` is met by notifying)


@dataclass(frozen=True)
class FlushStatistics:
    """A snapshot of one :class:`FlushDeadline`.

    ``notifications``: times ``arm`` or ``stop`` woke the flusher (0 in the steady state);
    ``ticks``: times the flusher woke up by itself or was woken; ``flushes``: calls
    of ``flush``; ``running``: a flusher thread exists now; ``armed``: something is
    queued and not yet flushed.
    """

    notifications: int
    ticks: int
    flushes: int
    running: bool
    armed: bool


class FlushDeadline:
    """Calls ``flush()`` once the oldest queued completion is ``after`` seconds old.

    ``flush`` returns False when the session is gone (the flusher then stops).
    """

    def __init__(self, flush: Callable[[], bool], after: float, name: str) -> None:
        self._flush = flush
        self._after = after
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._since: float | None = None  # _cond: when the queue last became non-empty
        self._last_arm = 0.0  # _cond: when arm was last called (idleness is measured from it)
        self._wake_at = 0.0  # _cond: when the sleeping flusher wakes by itself; 0: awake
        self._thread: threading.Thread | None = None  # _cond: the running flusher
        self._stopped = False  # _cond
        # counts behind statistics(), only ever incremented (under _cond)
        self._notifications = 0
        self._ticks = 0
        self._flushes = 0

    def arm(self) -> None:
        """The queue went from empty to non-empty: flush by ``now + after``."""
        with self._cond:
            if self._stopped:
                return
            now = time.monotonic()
            self._since = self._last_arm = now
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._wake_at > now + self._after:
                self._wake()

    def disarm(self) -> None:
        """The queue was emptied (a call carried the completions, or a flush sent them)."""
        with self._cond:
            self._since = None

    def stop(self) -> None:
        """No more flushes; the flusher exits (at once if it sleeps). Idempotent."""
        with self._cond:
            self._stopped = True
            self._since = None
            self._wake()

    def _wake(self) -> None:
        """Wakes the sleeping flusher (holding ``_cond``); every wake-up goes through here."""
        self._notifications += 1
        self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            try:
                self._loop()
            finally:
                self._thread = None

    def _loop(self) -> None:
        """The flusher's body; runs holding ``_cond`` except while flushing."""
        # A tick no longer than ``after``: a deadline armed during it falls after it ends
        # (no notify needed); no longer than IDLE_EXIT: an idle thread exits on time.
        tick = min(max(self._after, MIN_TICK), IDLE_EXIT)
        while not self._stopped:
            now = time.monotonic()
            if self._since is None:
                if now - self._last_arm >= IDLE_EXIT:
                    return
                self._sleep_until(now + tick)
                continue
            deadline = self._since + self._after
            if deadline > now:
                # at most a tick: a disarm does not notify, and an emptied queue
                # must not keep an idle thread until a long deadline
                self._sleep_until(min(deadline, now + tick))
                continue
            self._since = None
            self._flushes += 1
            self._cond.release()
            try:
                alive = self._flush_quietly()
            finally:
                self._cond.acquire()
            if not alive:
                self._stopped = True

    def _flush_quietly(self) -> bool:
        try:
            return self._flush()
        except Exception:  # a flush that failed must not end the flusher
            log.exception("%s: flushing queued completions failed", self._name)
            return True

    def _sleep_until(self, wake_at: float) -> None:
        """Sleeps (releasing ``_cond``) until ``wake_at``, ``arm`` or ``stop``."""
        self._wake_at = wake_at
        try:
            self._cond.wait(max(0.0, wake_at - time.monotonic()))
        finally:
            self._wake_at = 0.0
            self._ticks += 1

    def statistics(self) -> FlushStatistics:
        with self._cond:
            return FlushStatistics(
                notifications=self._notifications,
                ticks=self._ticks,
                flushes=self._flushes,
                running=self._thread is not None,
                armed=self._since is not None,
            )
