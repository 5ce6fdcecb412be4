"""systemd's notify protocol (sd_notify(3)) without a dependency.

With ``Type=notify`` systemd sets ``NOTIFY_SOCKET``; the daemon sends ``READY=1``
once it listens, ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` when the unit sets
``WatchdogSec``, and ``STOPPING=1`` when shutdown begins. Outside systemd every
call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Sends one notification; returns False when not running under systemd."""
    path = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", path, exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the configured timeout), or None."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # the watchdog is meant for another process
    return int(usec) / 2e6
