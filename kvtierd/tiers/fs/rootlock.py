"""The guard that keeps daemons that must not share an fs root off each other's root.

Every daemon with an fs tier holds ``flock`` on ``<root>/.kvtierd-root.lock`` for
its whole life (the descriptor is closed, and the lock dropped, by
:meth:`RootGuard.release` or by the process ending, a crash included):

* ``shared = false`` (the default): ``LOCK_EX``. A second daemon on that root --
  shared or not -- is refused at start with a message naming the root.
* ``shared = true``: ``LOCK_SH``. Any number of shared daemons hold it together;
  a non-shared daemon on that root is refused (and a shared one is refused while a
  non-shared one runs there).

The lock file is opened without following a symlink and without blocking
(``O_NOFOLLOW | O_NONBLOCK``) and must be a regular file of the daemon's uid: in a
sticky root another user could create it first and, as its owner, unlink it and
create a fresh one that a second daemon locks too. On NFS, Linux maps
``flock`` to byte-range locks the server arbitrates (NFSv4, or NFSv3 with lockd):
the guard then holds across hosts; a mount with ``nolock``/``local_lock`` makes it
per host only (docs/guides/fleet.md, "Shared fs root").
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from kvtierd.security.trusted_dirs import UntrustedPath, require_own_entry

LOCK_NAME = ".kvtierd-root.lock"
LOCK_MODE = 0o640
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RootInUse(Exception):
    """Another daemon holds the root in a way this one cannot share; the message
    says what to change."""


class RootGuard:
    """The lock one configured fs tier holds on its root (module docstring).

    Owned by the configured tier; :meth:`acquire` once at daemon start (the
    event loop, before any pool starts: one ``open`` + ``flock`` without
    blocking), :meth:`release` at shutdown. Not thread-safe (one owner)."""

    def __init__(self, tier_name: str, root: str, *, shared: bool) -> None:
        self.tier_name = tier_name
        self.root = root
        self.shared = shared
        self.path = os.path.join(root, LOCK_NAME)
        self._fd = -1  # holds the flock while >= 0

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Takes the lock (shared or exclusive); RootInUse when another daemon's lock
        conflicts, OSError when the lock file cannot be opened."""
        if self.held:
            return
        try:
            fd = os.open(self.path, _OPEN_FLAGS, LOCK_MODE)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                message = f"{self.path} is a symlink: not followed; remove it"
                raise OSError(exc.errno, message) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{self.path} is not a regular file; remove it")
            try:  # another user's file: it may unlink it (sticky root) and defeat the lock
                require_own_entry(self.path, st)
            except UntrustedPath as exc:
                raise OSError(errno.EPERM, str(exc)) from None
            mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RootInUse(self._conflict(fd)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _conflict(self, fd: int) -> str:
        """What to tell the operator: who holds the root, judged by whether a shared
        lock would be granted (then only shared daemons hold it)."""
        others_shared = False
        if not self.shared:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                others_shared = True
                fcntl.flock(fd, fcntl.LOCK_UN)
        where = f"fs tier {self.tier_name}: root {self.root}"
        if self.shared:
            return (
                f"{where} is in use by a daemon with shared = false (lock {self.path}); "
                "set shared = true on every daemon of this root, or give this one another root"
            )
        if others_shared:
            return (
                f"{where} is in use by daemons with shared = true (lock {self.path}); "
                "set shared = true on this tier too, or give it another root"
            )
        return (
            f"{where} is in use by another kvtierd (lock {self.path}); two daemons share a "
            "root only with shared = true on both; stop the other or give this one another root"
        )

    def release(self) -> None:
        """Drops the lock (closing the descriptor). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
