"""The audit log: one line per session opened, closed or expired, and per denied call.

Lines go to the logger ``kvtierd.audit`` (the daemon's log; filter on that name
or on the leading ``audit``), as ``key=value`` fields, values with spaces or
quotes JSON-quoted::

    audit session-opened session=3f2a... principal=team-a
        peer="unix uid=1001 gid=1001 pid=77" pool=team-a/llama client="vllm worker 0"
    audit session-expired session=3f2a... principal=team-a peer="..." pool=team-a/llama
        reason="lease expired (10s without a call)"
    audit denied method=FlushPool principal=team-b peer="..." pool=team-a/llama
        code=PERMISSION_DENIED reason="..."

(one line each; wrapped here).

Session lines are never suppressed: their number is bounded by the sessions
opened. Denials are rate-limited per (code, principal, method): the first of a
kind is logged, the next ones within ``DENIAL_INTERVAL`` seconds are counted
and reported with the next line of that kind (``RateLimitedLog``), so a client
hammering a refused call cannot flood the log.

Tickets and tokens never appear in a line. Event-loop only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger("kvtierd.audit")

DENIAL_INTERVAL = 10.0  # seconds between two logged denials of one kind
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/:@*")


def render(fields: Mapping[str, object]) -> str:
    """``key=value`` pairs; a value that is not plain text is JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or not set(text) <= _PLAIN:
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class AuditLog:
    """Writes audit lines; ``clock`` is injectable for the denial rate limit."""

    def __init__(
        self, logger: logging.Logger = log, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._denials = RateLimitedLog(logger, DENIAL_INTERVAL, clock=clock)

    def session(
        self, event: str, session_id: str, principal: str, peer: str, pool: str, **extra: object
    ) -> None:
        """``event`` is ``opened``, ``closed`` or ``expired``; ``extra`` adds fields
        (``client``, ``reason``)."""
        fields: dict[str, object] = {
            "session": session_id, "principal": principal or "-", "peer": peer or "-", "pool": pool,
        }  # fmt: skip
        fields.update(extra)
        self._logger.info("audit session-%s %s", event, render(fields))

    def denied(
        self, method: str, code: str, principal: str, peer: str, pool: str, reason: str
    ) -> None:
        """A refused call (PERMISSION_DENIED or UNAUTHENTICATED); rate-limited."""
        fields = {
            "method": method, "principal": principal or "-", "peer": peer or "-",
            "pool": pool or "-", "code": code, "reason": reason,
        }  # fmt: skip
        self._denials.warning((code, principal, method), "audit denied %s", render(fields))
