"""Listening Unix sockets put in place atomically, and removed only while they are
still one's own (docs/operations/upgrades.md).

The daemon binds each socket at a temporary name in the path's directory and,
once it serves, renames it over the path (*staged*). ``rename(2)`` replaces the
old name in one step, so under a takeover a ``connect()`` to the path always
finds a listening socket, the old process's until that instant and the new
one's after it; never ENOENT, never ECONNREFUSED. Staging matters at the other
end too: gRPC core unlinks the Unix socket *name it bound* when its server stops
(whatever socket is there by then); a daemon that bound its gRPC socket at a
temporary name, long renamed, so never removes the socket of the daemon that
took over from it. A process removes at its stop only the files that are still
the sockets it bound (same device and inode), never the ones that replaced them.

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

    Default: each socket is bound at its path. ``staged`` (the daemon): at a
    temporary name next to it (``.NAME.staged-PID``), renamed over the path by
    :meth:`publish`. ``takeover`` (implies staged): a daemon still serves the
    paths; :meth:`publish` also keeps a hard link ``.NAME.keep-PID`` to each
    socket until :meth:`forget_links`, so :meth:`restore` can put a socket back at
    its path if the process it replaced removes that name at its exit (a daemon
    older than this module does: its gRPC server was bound at the path).

    Invariant: ``bound`` lists every socket file this process bound, in bind
    order; before :meth:`publish` (staged) none of them is at its path.
    """

    def __init__(self, *, staged: bool = False, takeover: bool = False) -> None:
        self.takeover = takeover
        self.staged = staged or takeover
        self.bound: list[BoundSocket] = []
        self.published = not self.staged

    def bind_name(self, path: str) -> str:
        """The name to bind the socket of ``path`` at. Raises ValueError when the
        temporary name would not fit a socket address."""
        if not self.staged:
            return path
        name = _beside(path, "staged")
        if len(os.fsencode(name)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"cannot listen on {path}: the temporary name {name} it is bound at first is "
                f"longer than a Unix socket path may be ({MAX_SOCKET_PATH} bytes); use a "
                "shorter listen path"
            )
        with contextlib.suppress(FileNotFoundError):
            _remove_socket_file(name)  # a failed start's, by a process of this pid
        return name

    def record(self, path: str, bound_at: str) -> BoundSocket:
        """Remembers the socket just bound at ``bound_at`` for ``path``."""
        info = os.lstat(bound_at)
        bound = BoundSocket(path, bound_at, info.st_dev, info.st_ino)
        self.bound.append(bound)
        return bound

    def publish(self) -> None:
        """Staged: renames each socket over its path (under a takeover keeping a
        second name for :meth:`restore`). Nothing to do if not staged."""
        if self.published:
            return
        for socket in self.bound:
            if self.takeover:
                keep = _beside(socket.path, "keep")
                with contextlib.suppress(FileNotFoundError):
                    _remove_socket_file(keep)
                os.link(socket.bound_at, keep)
            os.rename(socket.bound_at, socket.path)
        self.published = True

    def restore(self) -> list[str]:
        """Puts back at its path each published socket that is no longer there
        (the replaced process removed the name at its exit); returns those paths."""
        restored: list[str] = []
        if not self.takeover:
            return restored
        for socket in self.bound:
            if socket.is_at(socket.path):
                continue
            keep = _beside(socket.path, "keep")
            os.link(keep, socket.bound_at)
            os.rename(socket.bound_at, socket.path)
            restored.append(socket.path)
        return restored

    def forget_links(self) -> None:
        """Removes the second names :meth:`publish` kept."""
        if not self.takeover:
            return
        for socket in self.bound:
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
