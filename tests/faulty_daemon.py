"""Runs the real kvtierd with faults injected where nothing real can cause them.

TEST-ONLY FAULT INJECTION. Nothing of it is in the daemon: this script patches the
faults into the daemon's own process, then runs ``python -m kvtierd`` there as
usual. A test gets it through ``start_daemon``'s ``command_prefix``::

    start_daemon(..., command_prefix=faulty_daemon.prefix("tier-shutdown"))

The faults (each named on the command line, comma-separated):

- ``tier-shutdown``: every fs tier's ``shutdown()`` raises OSError(EIO) before it does
  anything. Its real steps close descriptors, join threads and reap worker
  processes, none of which another process can make fail;
- ``tickets-close``: the peer tickets' ``close()`` raises RuntimeError before it
  closes anything (its one failure is an assertion about its own bookkeeping).
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path
from typing import NoReturn

FAULTS = ("tier-shutdown", "tickets-close")
# the messages the faults raise, for the tests to find in the log
TIER_SHUTDOWN_MESSAGE = "injected fault: the fs tier's shutdown"
TICKETS_CLOSE_MESSAGE = "injected fault: closing the peer tickets"


def prefix(*faults: str) -> list[str]:
    """The command prefix that runs the daemon's command with ``faults``."""
    unknown = set(faults) - set(FAULTS)
    assert not unknown, f"unknown faults {unknown}; known: {FAULTS}"
    return [sys.executable, str(Path(__file__).resolve()), ",".join(faults), "--"]


def _inject(fault: str) -> None:
    if fault == "tier-shutdown":
        from kvtierd.tiers.fs.configured import ConfiguredFsTier

        def failing_tier_shutdown(self: ConfiguredFsTier) -> None:
            raise OSError(errno.EIO, TIER_SHUTDOWN_MESSAGE)

        ConfiguredFsTier.shutdown = failing_tier_shutdown  # type: ignore[method-assign]
    elif fault == "tickets-close":
        from kvtierd.security.tickets import TicketOffice

        async def failing_tickets_close(self: TicketOffice) -> None:
            raise RuntimeError(TICKETS_CLOSE_MESSAGE)

        TicketOffice.close = failing_tickets_close  # type: ignore[method-assign]
    else:
        raise SystemExit(f"faulty_daemon: unknown fault {fault!r}; known: {FAULTS}")


def main(argv: list[str]) -> NoReturn:
    """``FAULTS -- PYTHON -m kvtierd ARGS...``: the faults patched in, then kvtierd's
    own ``__main__`` with ``ARGS``."""
    faults, separator, python, flag, module, *args = argv
    if (separator, flag, module) != ("--", "-m", "kvtierd"):
        raise SystemExit(f"faulty_daemon: expected FAULTS -- PYTHON -m kvtierd ..., got {argv}")
    for fault in faults.split(","):
        _inject(fault)
    sys.argv = [python, *args]
    sys.path[0] = os.getcwd()  # as ``python -m`` has it: not this script's directory
    runpy.run_module("kvtierd", run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # kvtierd's __main__ always exits itself


if __name__ == "__main__":
    main(sys.argv[1:])
