"""What every worker process the daemon starts does first: die with its starter; and
how the daemon stops one (:func:`reap`).

The fs tier's I/O workers (:mod:`kvtierd.tiers.fs.ioworker`) and the warm-restart
hash workers (:mod:`kvtierd.primary.warm.hashworker`) are children of one daemon thread. A
worker outliving a killed daemon would go on touching a region or a tier's files
behind the next daemon's back, so each asks the kernel for SIGKILL when that
thread ends.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def die_with(daemon_pid: int) -> bool:
    """Asks the kernel to SIGKILL this process when the thread that started it ends
    (``PR_SET_PDEATHSIG``). False if the daemon is already gone (this process was
    re-parented before the request took effect). Without ``prctl`` (not Linux) the
    worker still exits at EOF of its channel."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: EOF on the channel ends the worker
    return os.getppid() == daemon_pid


def reap(
    process: subprocess.Popen[bytes], wait_s: float, kill_wait_s: float,
    log: logging.Logger, what: str,
) -> None:  # fmt: skip
    """Waits up to ``wait_s`` for ``process`` to exit (its channel closed: a worker
    exits at EOF), then kills it and waits ``kill_wait_s`` more. Bounded: a process
    that does not even die when killed (stuck in the kernel) is left behind, with a
    WARNING on ``log`` naming ``what`` ("I/O worker fs-io-0")."""
    try:
        process.wait(timeout=max(0.0, wait_s))
        return
    except subprocess.TimeoutExpired:
        process.kill()
    try:
        process.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) does not exit even when killed; leaving it", what, process.pid)
