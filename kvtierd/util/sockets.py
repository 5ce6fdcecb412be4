"""Listening Unix sockets put in place atomically, and removed only while they are
still one's own (docs/operations/upgrades.md).

A process that replaces another one serving the same socket paths (a takeover)
binds each socket at a temporary name in the path's directory, then, once it
serves, renames it over the path: ``rename(2)`` replaces the old name in one
step, so a ``connect()`` to the path always finds a listening socket, the old
process's until that instant and the new one's after it; never ENOENT, never
ECONNREFUSED. A process removes at its stop only the files that are still the
sockets it bound (same device and inode), never the ones that replaced them.

Nothing here knows the daemon: :class:`SocketPlacement` decides where a socket is
bound and remembers what was bound; callers bind, listen and serve.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True, slots=True)
class BoundSocket:
    """A socket file this process bound: its final path, the name it was bound at
    (the same unless it waits to be published) and the file's identity."""

    path: str
    bound_at: str
    dev: int
    ino: int

    def is_at(self, path: str) -> bool:
        """Whether ``path`` is still this socket (not another file put there since)."""
        try:
            info = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == (self.dev, self.ino)


class SocketPlacement:
    """Where one process binds its listening Unix sockets, and their removal.

    ``takeover`` False: each socket is bound at its path. True: at a temporary
    name next to it (``.NAME.takeover-PID``), published over the path by
    :meth:`publish`; a hard link ``.NAME.keep-PID`` to each stays until
    :meth:`forget_links`, so :meth:`restore` can put a socket back at its path if
    the process it replaced removes that name at its exit (a daemon older than
    this module does).

    Invariant: ``bound`` lists every socket file this process bound, in bind
    order; before :meth:`publish` (takeover) none of them is at its path.
    """

    def __init__(self, takeover: bool = False) -> None:
        self.takeover = takeover
        self.bound: list[BoundSocket] = []
        self.published = not takeover

    def bind_name(self, path: str) -> str:
        """The name to bind the socket of ``path`` at. Raises ValueError when the
        temporary name would not fit a socket address."""
        if not self.takeover:
            return path
        name = _beside(path, "takeover")
        if len(os.fsencode(name)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"cannot take over {path}: the temporary name {name} is longer than a Unix "
                f"socket path may be ({MAX_SOCKET_PATH} bytes); use a shorter listen path"
            )
        with contextlib.suppress(FileNotFoundError):
            _remove_socket_file(name)  # a failed takeover's, by a process of this pid
        return name

    def record(self, path: str, bound_at: str) -> BoundSocket:
        """Remembers the socket just bound at ``bound_at`` for ``path``."""
        info = os.lstat(bound_at)
        bound = BoundSocket(path, bound_at, info.st_dev, info.st_ino)
        self.bound.append(bound)
        return bound

    def publish(self) -> None:
        """Takeover: renames each socket over its path (keeping a second name for
        :meth:`restore`). Nothing to do for an ordinary start."""
        if self.published:
            return
        for socket in self.bound:
            keep = _beside(socket.path, "keep")
            with contextlib.suppress(FileNotFoundError):
                _remove_socket_file(keep)
            os.link(socket.bound_at, keep)
            os.rename(socket.bound_at, socket.path)
        self.published = True

    def restore(self) -> list[str]:
        """Puts back at its path each published socket that is no longer there
        (the replaced process removed the name at its exit); returns those paths."""
        restored = []
        for socket in self.bound:
            if socket.bound_at == socket.path or socket.is_at(socket.path):
                continue
            keep = _beside(socket.path, "keep")
            os.link(keep, socket.bound_at)
            os.rename(socket.bound_at, socket.path)
            restored.append(socket.path)
        return restored

    def forget_links(self) -> None:
        """Removes the second names :meth:`publish` kept."""
        for socket in self.bound:
            if socket.bound_at != socket.path:
                with contextlib.suppress(FileNotFoundError):
                    _remove_socket_file(_beside(socket.path, "keep"))

    def remove_own(self) -> None:
        """Removes every socket file of this process still at its path or at its
        temporary name; a file another process put there is left alone."""
        self.forget_links()
        for socket in self.bound:
            for name in {socket.path, socket.bound_at}:
                if socket.is_at(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)


def unlink_if_own(path: str, bound: BoundSocket | None) -> None:
    """Removes ``path`` if it is still the socket ``bound`` (None: nothing)."""
    if bound is not None and bound.is_at(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _beside(path: str, what: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{what}-{os.getpid()}")


def _remove_socket_file(path: str) -> None:
    """Removes ``path`` if it is a socket; anything else is left (never followed)."""
    if stat.S_ISSOCK(os.lstat(path).st_mode):
        os.unlink(path)
