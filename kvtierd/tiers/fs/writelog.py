"""Operator-facing reports of a tier's failed block writes (ENOSPC, EROFS, EIO, ...).

A full or read-only disk fails every cascade write, thousands a second: each
one is counted in the tier's statistics, but the log gets at most one WARNING
line per tier per :data:`REPORT_EVERY_S` seconds (errno name, strerror, path,
and how many lines were suppressed since the previous one:
:class:`kvtierd.util.ratelimit.RateLimitedLog`), and once writes work again, one line
saying so with the number of failures in between.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

from kvtierd.util.ratelimit import RateLimitedLog

REPORT_EVERY_S = 10.0


class WriteFailureLog:
    """The write-failure reports of one configured tier (shared by its pools).

    Loop thread only (job completions call it). Invariant: ``failures`` counts
    the failures since the last success (0: writes work).
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
        self._limited = RateLimitedLog(logger, every_s, max_keys=1, clock=clock)
        self.failures = 0

    def failed(self, error: OSError, path: str) -> None:
        """One block write failed with ``error`` (``path``: where, if the error does
        not name it). Logs a WARNING unless one was logged in the last interval."""
        self.failures += 1
        code = errno.errorcode.get(error.errno or 0, f"errno {error.errno}")
        self._limited.warning(
            self.tier,
            "tier %s: block write failed: %s (%s) at %s; writes to this tier fail, "
            "the primary tier keeps serving",
            self.tier, code, error.strerror or error, error.filename or path,
        )  # fmt: skip

    def succeeded(self) -> None:
        """A block write succeeded; after failures, says once that writes work again."""
        if not self.failures:
            return
        self._log.warning(
            "tier %s: writes succeed again after %d failures", self.tier, self.failures
        )
        self.failures = 0
        self._limited.forget(self.tier)
