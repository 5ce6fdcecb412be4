"""How one pool's redis tier logs what failed: once, rate-limited, saying what to fix.

* a node that fails or hangs is logged once by the link (:mod:`.nodefaults`); the
  tier's calls it fails are DEBUG lines here;
* any other error of the server is a WARNING at most every
  :data:`FAULT_LOG_INTERVAL_S` per kind, saying what the server refused and which
  option fixes it (:func:`~kvtierd.tiers.redis.access.explain`);
* a region a client truncated fails the block whose row is gone: one rate-limited
  WARNING naming the pool and the region;
* a value that failed verification: at most one WARNING every
  :data:`FAULT_LOG_INTERVAL_S` per kind (its header or checksum; not sealed under the
  tier's integrity keys), the next one saying how many were suppressed: anyone who
  can write the server can make one per key (values moved between keys).

It logs only: the tier counts the fault and decides what it means for the keys.
"""

from __future__ import annotations

import logging

import redis

from kvtierd.contract import BlockKey
from kvtierd.primary.rows import RegionCutShort, RowIoUnavailable
from kvtierd.tiers.redis.access import explain
from kvtierd.tiers.redis.blockio import BlockCorrupt
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.nodefaults import NodeFaults
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

FAULT_LOG_INTERVAL_S = 10.0


class TierFaultLog:
    """The fault lines of tier ``name`` (pool ``pool_name``) over ``link``.
    ``limited``: the rate limit its WARNINGs share (with the tier's I/O threads, and
    with the other pools of its configured tier when given)."""

    def __init__(
        self, name: str, pool_name: str, link: RedisLink, limited: RateLimitedLog | None
    ) -> None:
        self.name = name
        self.pool_name = pool_name
        self.limited = limited or RateLimitedLog(log, FAULT_LOG_INTERVAL_S)
        self._link = link

    def fault(self, kind: str, error: BaseException | None) -> None:
        """A ``kind`` of call (``store``, ``load``, ``probe``, ...) failed with ``error``."""
        if isinstance(error, (RegionCutShort, RowIoUnavailable)):
            # a client truncated the region: this block only; the message names row and region
            what = "store" if kind == "store" else "promotion"
            self.limited.warning(
                ("region", what, self.name),
                "redis tier %s: pool %s: %s failed, block not %s: %s",
                self.name, self.pool_name, what,
                "stored" if what == "store" else "promoted", error,
            )  # fmt: skip
        elif NodeFaults.node_down(error):  # the link logged the node's fault, once
            log.debug("redis tier %s: %s failed: %s: %s", self.name, kind,
                      type(error).__name__, error)  # fmt: skip
        elif isinstance(error, redis.RedisError):  # what the server refused, and the fix
            self.limited.warning(
                (kind, self.name), "redis tier %s: %s failed: %s",
                self.name, kind, explain(error, self._link.settings),
            )  # fmt: skip
        else:
            log.debug("redis tier %s: %s failed: %s", self.name, kind, error)

    def refused(self, key: BlockKey, error: BlockCorrupt) -> None:
        """``key``'s value failed verification (the I/O thread deleted it): counted by
        the tier, logged here at most every :data:`FAULT_LOG_INTERVAL_S` per kind."""
        if error.integrity:
            self.limited.warning(
                ("integrity", self.name),
                "redis tier %s: value of block %s refused and deleted: %s (counted in "
                "integrity_failures)", self.name, key.hex(), error,
            )  # fmt: skip
        else:
            self.limited.warning(
                ("checksum", self.name),
                "redis tier %s: block %s dropped: %s (counted in checksum_failures)",
                self.name, key.hex(), error,
            )  # fmt: skip
