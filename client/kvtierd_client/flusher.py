"""The deadline that sends a session's queued completions when no call carries them.

A session with ``queue_completions`` keeps ``CompleteStore`` / ``CompleteLoad`` /
``Touch`` in a queue until the next call that needs an answer carries them in one
``Batch``. When no such call comes, they must still leave within ``after``
seconds of the oldest one being queued. That deadline used to be a
``threading.Timer`` per non-empty queue: a new thread per engine step, and
``Thread.start`` blocks until the new thread has run, which on a loaded machine
costs the caller a scheduling slice (milliseconds) on its critical path.

:class:`FlushDeadline` keeps one thread per session instead. Its thread sleeps
until the oldest queued completion is ``after`` old, flushes if the queue is
still non-empty, and exits after :data:`IDLE_EXIT` seconds with nothing
queued (the next queued completion starts a new one). In the steady state,
where each step's call carries the previous step's completions, nobody starts a
thread and nobody wakes the flusher: :meth:`FlushDeadline.arm` only notifies a
flusher that sleeps with no deadline.

Invariants:

* ``arm`` is called when the queue goes from empty to non-empty and ``disarm``
  when it is emptied, both under the session's queue lock. Lock order: the
  session's queue lock, then the deadline's condition lock. The flusher calls
  ``flush`` holding neither.
* the flusher holds the session only through ``flush`` (a callable that holds a
  weak reference), so a session nobody references can be collected.
* ``flush`` may find the queue already taken by a call (it then sends nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvtierd_client")

IDLE_EXIT = 1.0  # seconds a flusher with nothing queued waits before its thread exits


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
        self._thread: threading.Thread | None = None  # _cond: the running flusher
        self._idle = False  # _cond: the flusher waits with no deadline
        self._stopped = False  # _cond

    def arm(self) -> None:
        """The queue went from empty to non-empty: flush by ``now + after``."""
        with self._cond:
            if self._stopped:
                return
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    def disarm(self) -> None:
        """The queue was emptied (a call carried the completions, or a flush sent them)."""
        with self._cond:
            self._since = None

    def stop(self) -> None:
        """No more flushes; the flusher exits (at once if it sleeps). Idempotent."""
        with self._cond:
            self._stopped = True
            self._since = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            try:
                self._loop()
            finally:
                self._thread = None

    def _loop(self) -> None:
        """The flusher's body; runs holding ``_cond`` except while flushing."""
        while not self._stopped:
            if self._since is None:
                if not self._wait_idle():
                    return
                continue
            remaining = self._since + self._after - time.monotonic()
            if remaining > 0:
                self._cond.wait(remaining)
                continue
            self._since = None
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

    def _wait_idle(self) -> bool:
        """Waits (holding ``_cond``) for ``arm``; False when idle too long (exit).

        Woken by ``arm``, the queue may be empty again by the time this thread
        runs (a call carried it): that is not idleness, so only a timeout is."""
        self._idle = True
        try:
            woken = self._cond.wait(IDLE_EXIT)
        finally:
            self._idle = False
        return woken or self._since is not None or self._stopped
