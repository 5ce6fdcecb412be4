"""grpc's own log lines about calls a client or the transport ended: one
rate-limited WARNING instead of an ERROR traceback per call.

grpc.aio logs through the ``grpc._cython.cygrpc`` logger. When a client goes
away while the daemon is sending its answer (it cancelled, its deadline passed,
it closed its channel or died), the send fails in grpc core; if grpc has not yet
seen the call's close event (a race inside grpc core that a busy machine loses
often), it logs ``ExecuteBatchError raised in core by servicer method [M]`` at
ERROR with a traceback of its own internals, once per call: a burst of 200
cancelled WatchEvents streams wrote up to 185 tracebacks. The same record comes
from an answer over ``grpc.max_send_message_length`` (the client gets
RESOURCE_EXHAUSTED). Either way the traceback says nothing useful, so those
records are replaced by one WARNING on ``kvtierd.api.server`` per ``INTERVAL``
seconds (``ratelimit.RateLimitedLog``), which counts the others.

Every other grpc record passes unchanged: a servicer bug still logs its
traceback (``Unexpected [...] raised by servicer method``).
"""

from __future__ import annotations

import logging
import re

from kvtierd.util.ratelimit import RateLimitedLog

GRPC_LOGGER = "grpc._cython.cygrpc"
INTERVAL = 10.0

_TRANSPORT_ENDED = "ExecuteBatchError raised in core by servicer method"
_METHOD = re.compile(r"\[([^\]]*)\]")


class TransportNoiseFilter(logging.Filter):
    """Drops grpc's per-call records about calls that ended under it, logging a
    rate-limited WARNING instead (the first method named as an example)."""

    def __init__(self, limited: RateLimitedLog) -> None:
        super().__init__()
        self._limited = limited

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        if not isinstance(message, str):
            return True
        if message.startswith(_TRANSPORT_ENDED):
            self._limited.warning(
                "transport-ended",
                "a call ended before its answer could be sent, e.g. %s: its client cancelled "
                "it, its deadline passed or its connection closed (or the answer exceeded "
                "the message size limit)",
                _method(record.getMessage()),
            )
            return False
        return True


def install(interval: float = INTERVAL) -> TransportNoiseFilter:
    """Adds the filter to grpc's logger once per process; returns the one in use."""
    logger = logging.getLogger(GRPC_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, TransportNoiseFilter):
            return existing
    noise = TransportNoiseFilter(RateLimitedLog(logging.getLogger(__name__), interval))
    logger.addFilter(noise)
    return noise


def _method(message: str) -> str:
    found = _METHOD.search(message)
    return found.group(1) if found else "an unknown method"
