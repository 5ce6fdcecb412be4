"""A logger wrapper that logs at most one line per key per interval.

For conditions that can repeat many times a second (a client cancelling a
burst of calls, a full disk failing every write): the first line of a key is
logged, the following ones inside the interval are only counted, and the next
line logged for that key says how many were suppressed since the last one.

Thread-safe: the event loop and I/O threads may share one instance.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

DEFAULT_INTERVAL = 10.0
DEFAULT_MAX_KEYS = 256


@dataclass
class _KeyState:
    last_logged: float  # clock time of the last line logged for this key
    suppressed: int = 0  # lines not logged since then


@dataclass(frozen=True)
class RateLimitStatistics:
    """A snapshot of a :class:`RateLimitedLog` (:meth:`RateLimitedLog.statistics`)."""

    keys_tracked: int  # keys remembered now: at most max_keys
    # per tracked key: lines suppressed since its last logged line (read-only)
    suppressed_by_key: Mapping[Hashable, int]


class RateLimitedLog:
    """Logs through ``logger`` at most once per ``interval`` seconds per key.

    Keys name a kind of event (``("cancelled", method)``, ``("ENOSPC", tier)``),
    not an occurrence: use a small set. At most ``max_keys`` keys are tracked
    (bounded memory); past that the least recently logged key is forgotten,
    together with its suppressed count.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = DEFAULT_INTERVAL,
        *,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0 or max_keys < 1:
            raise ValueError("interval must be > 0 and max_keys >= 1")
        self.logger = logger
        self.interval = interval
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # Invariant: insertion order is the order of the last logged line per key
        # (a logged key moves to the end), so the first key is the one to forget.
        self._keys: dict[Hashable, _KeyState] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Logs ``msg % args`` at ``level`` unless ``key`` logged a line less than
        ``interval`` seconds ago; returns whether it was logged. A logged line
        ends with the number of lines of that key suppressed since the last one."""
        if not self.logger.isEnabledFor(level):
            return False
        suppressed = self._admit(key)
        if suppressed is None:
            return False
        if suppressed:
            msg = f"{msg} (%d similar lines suppressed since the previous one)"
            args = (*args, suppressed)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """``log(logging.WARNING, ...)``."""
        return self.log(logging.WARNING, key, msg, *args)

    def forget(self, key: Hashable) -> None:
        """The condition ``key`` names ended: its next line is logged at once, and
        the lines suppressed so far are dropped (the caller reported the end)."""
        with self._lock:
            self._keys.pop(key, None)

    def statistics(self) -> RateLimitStatistics:
        """The keys tracked now and the lines each has suppressed since its last
        logged line, taken under the lock (one consistent snapshot)."""
        with self._lock:
            suppressed = {key: state.suppressed for key, state in self._keys.items()}
        return RateLimitStatistics(
            keys_tracked=len(suppressed), suppressed_by_key=MappingProxyType(suppressed)
        )

    def _admit(self, key: Hashable) -> int | None:
        """None: suppress this line (counted). Otherwise log it; the value is the
        count suppressed since the key's previous line (which is reset)."""
        now = self._clock()
        with self._lock:
            state = self._keys.get(key)
            if state is not None and now - state.last_logged < self.interval:
                state.suppressed += 1
                return None
            suppressed = 0 if state is None else state.suppressed
            self._keys.pop(key, None)
            if len(self._keys) >= self._max_keys:
                del self._keys[next(iter(self._keys))]
            self._keys[key] = _KeyState(last_logged=now)
            return suppressed
