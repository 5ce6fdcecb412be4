"""Who holds a file's ``flock``: the kernel's table of locks, ``/proc/locks``.

A region file's flock says "a live kvtierd owns this" (``kvtierd.primary.region``);
when one is refused, the message names that process, so the operator knows which
daemon to wait for or stop (after a takeover: the replaced one, still exiting).
"""

from __future__ import annotations

import os

LOCKS = "/proc/locks"
MAX_LOCK_LINES = 100_000  # lines read at most: the table is one line per lock held


def flock_holder(fd: int, locks: str = LOCKS) -> int | None:
    """The pid that took the ``flock`` held on the file of ``fd`` (its
    ``FLOCK`` line in ``/proc/locks``, matched by device and inode); None when no
    line names it (no flock, a pid outside this pid namespace, or no /proc)."""
    info = os.fstat(fd)
    file_id = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open(locks, encoding="ascii", errors="replace") as table:
            for number, line in enumerate(table):
                if number >= MAX_LOCK_LINES:
                    break
                holder = _flock_pid(line, file_id)
                if holder is not None:
                    return holder
    except OSError:
        pass
    return None


def _flock_pid(line: str, file_id: str) -> int | None:
    """The pid of ``line`` (``1: FLOCK  ADVISORY  WRITE 4242 00:1b:77 0 EOF``) when
    it is a held flock of ``file_id``; waiters (``1: -> FLOCK ...``) are not."""
    fields = line.split()
    if len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != file_id:
        return None
    try:
        pid = int(fields[4])
    except ValueError:
        return None
    return pid if pid > 0 else None
