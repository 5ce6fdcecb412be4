"""Operator-facing reports of a tier's failed block writes (ENOSPC, EROFS, EIO, ...).

A full or read-only disk fails every cascade write, thousands a second: each
one is counted in the tier's statistics, but the log gets at most one WARNING
line per tier per :data:`REPORT_EVERY_S` seconds (errno name, strerror, path,
and how many failures the previous interval suppressed), and once writes work
again, one line saying so with the number of failures in between.

Kept deliberately tiny; a generic rate-limited logger may replace it.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

REPORT_EVERY_S = 10.0


class WriteFailureLog:
    """The write-failure reports of one configured tier (shared by its pools).

    Loop thread only (job completions call it), so no lock.

    Invariants: ``_failures`` counts failures since the last success (0: writes
    work); ``_suppressed`` counts failures not reported since the last WARNING
    line; ``_suppressed <= _failures``.
    """

    def __init__(
        self,
        tier: str,
        logger: logging.Logger,
        *,
        every_s: float = REPORT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self._log = logger
        self._every_s = every_s
        self._clock = clock
        self._failures = 0
        self._suppressed = 0
        self._last_report = -float("inf")

    @property
    def failures(self) -> int:
        """Write failures since the last successful write."""
        return self._failures

    def failed(self, error: OSError, path: str) -> None:
        """One block write failed with ``error`` (``path``: where, if the error does
        not name it). Logs a WARNING unless one was logged in the last interval."""
        self._failures += 1
        now = self._clock()
        if now - self._last_report < self._every_s:
            self._suppressed += 1
            return
        code = errno.errorcode.get(error.errno or 0, f"errno {error.errno}")
        more = (
            f" ({self._suppressed} more failed writes since the last report)"
            if self._suppressed
            else ""
        )
        self._log.warning(
            "tier %s: block write failed: %s (%s) at %s%s; writes to this tier fail, "
            "the primary tier keeps serving",
            self.tier, code, error.strerror or error, error.filename or path, more,
        )  # fmt: skip
        self._suppressed = 0
        self._last_report = now
        assert self._suppressed <= self._failures

    def succeeded(self) -> None:
        """A block write succeeded; after failures, says once that writes work again."""
        if not self._failures:
            return
        self._log.warning(
            "tier %s: writes succeed again after %d failures", self.tier, self._failures
        )
        self._failures = 0
        self._suppressed = 0
        self._last_report = -float("inf")
