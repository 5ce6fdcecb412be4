"""One log line per kind of failure and period, for a data path that never raises.

SGLang's controller threads call the backend hundreds of times a second; a daemon
that is down would otherwise log on every call. :class:`QuietLog` logs the first
failure of a kind at once, then at most one line of that kind per ``interval``
seconds, saying how many it left out in between. Thread-safe (one lock, held for
a dict update).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["QuietLog"]


class QuietLog:
    """Rate-limited logging by kind (``"unavailable"``, ``"refused"``, ``"copy"``...).

    ``clock``: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> (monotonic time of its last line, lines left out since)
        self._last: dict[str, tuple[float, int]] = {}

    def log(
        self, level: int, kind: str, message: str, *args: object, exc_info: bool = False
    ) -> bool:
        """Logs ``message % args`` unless a line of ``kind`` went out less than
        ``interval`` seconds ago; returns whether it did. ``exc_info``: with the
        exception being handled (its traceback)."""
        now = self._clock()
        with self._lock:
            last, skipped = self._last.get(kind, (None, 0))
            if last is not None and now - last < self._interval:
                self._last[kind] = (last, skipped + 1)
                return False
            self._last[kind] = (now, 0)
        if skipped:
            message += " (%d more like this in the last %.0fs)"
            args = (*args, skipped, now - last if last is not None else 0.0)
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True

    def forget(self, kind: str) -> None:
        """The next failure of ``kind`` logs at once (its condition ended)."""
        with self._lock:
            self._last.pop(kind, None)
