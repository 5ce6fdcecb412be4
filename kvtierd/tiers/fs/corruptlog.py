"""How an fs tier logs the block files that failed verification: rate-limited.

Whoever can write the root (on a shared root, every host that mounts it) can
make as many failures as there are keys: files moved between keys, truncated,
forged, or something other than a file put at a block's path. Each failure is
counted all the same (``checksum_failures``, ``integrity_failures``), but the
log gets, per kind of failure, at most one WARNING every
:data:`CORRUPT_LOG_INTERVAL_S` per configured tier (its pools share one
:class:`CorruptFileLog`), and the next line logged says how many were
suppressed meanwhile (:class:`~kvtierd.util.ratelimit.RateLimitedLog`).

The kinds: a file whose header or checksum does not check out (``checksum``),
one not sealed under the tier's integrity keys (``integrity``), and an entry
that is not a regular file (``entry``).

Thread-safe: the load path's I/O threads and the start-up scan's thread share it.
"""

from __future__ import annotations

import logging

from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.safefs import REGULAR
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

CORRUPT_LOG_INTERVAL_S = 10.0


class CorruptFileLog:
    """The lines of tier ``tier``'s block files that failed verification."""

    def __init__(self, tier: str, limited: RateLimitedLog | None = None) -> None:
        self.tier = tier
        self.limited = limited or RateLimitedLog(log, CORRUPT_LOG_INTERVAL_S)

    def dropped(self, path: str, error: CorruptFile) -> None:
        """The block file at ``path`` failed with ``error``; the caller removes it
        (when ``error.identity`` is set) and counts it."""
        if error.kind != REGULAR:
            action = "removing it" if error.identity is not None else "leaving it there"
            self.limited.warning(
                "entry", "FS tier %s: bad block file %s: %s; %s",
                self.tier, path, error.reason, action,
            )  # fmt: skip
            return
        counter = "integrity_failures" if error.integrity else "checksum_failures"
        self.limited.warning(
            "integrity" if error.integrity else "checksum",
            "FS tier %s: removing corrupt block file %s: %s (counted in %s)",
            self.tier, path, error.reason, counter,
        )  # fmt: skip
