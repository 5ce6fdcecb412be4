"""Listening Unix sockets put in place atomically, all or none, and removed only
while they are still one's own (docs/operations/upgrades.md).

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

Names an outsider could plant. The socket directory may be sticky and writable
by others (as ``/tmp``): anyone may create a file at a name before the daemon
does, and nobody but its owner (and root) may then remove it. Every name made
here besides the paths themselves (``.NAME.staged-TOKEN``, ``.NAME.keep-TOKEN``)
carries :data:`NAME_TOKEN_BYTES` random bytes, so no name can be planted ahead;
each is created by ``bind(2)`` or ``link(2)``, which fail on an existing name
and never follow a link there; and nothing at a name this process did not create
is ever removed or followed.

All or nothing (:meth:`SocketPlacement.publish`): every path is checked (free, or
a socket of this uid) and every second name linked before the first rename; a
failure there removes what this process created and renames nothing. Each
socket about to be replaced keeps a second name until the renames are done, so
a rename that fails half-way puts the replaced sockets back at their paths: the
process serving them stays reachable.

Nothing here knows the daemon: :class:`SocketPlacement` decides where a socket is
bound and remembers what was bound; callers bind, listen and serve.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from dataclasses import dataclass

from kvtierd.util import filekind

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
NAME_TOKEN_BYTES = 8  # random bytes in a staged or keep name (16 hex digits)


class PublishError(Exception):
    """A socket could not be put at ``path``; the message says why and what to do.
    Raised with every path holding what it held before (all or nothing)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


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
        return _socket_identity(path) == (self.dev, self.ino)


@dataclass(slots=True)
class Move:
    """One socket's publication (:meth:`SocketPlacement.prepare`): ``socket`` goes to
    its path; ``replaced`` is the identity of the socket file there (None: the path
    was free), which has the second name ``replaced_keep`` (made by this process)
    until the renames are done; ``done`` once ``socket`` is at its path."""

    socket: BoundSocket
    replaced: tuple[int, int] | None
    replaced_keep: str | None
    done: bool = False


class SocketPlacement:
    """Where one process binds its listening Unix sockets, and their removal.

    Default: each socket is bound at its path. ``staged`` (the daemon): at a
    temporary name next to it (``.NAME.staged-TOKEN``), put at the path by
    :meth:`publish`. ``takeover`` (implies staged): a daemon still serves the
    paths; :meth:`publish` also keeps a second name ``.NAME.keep-TOKEN`` for each
    socket until :meth:`forget_links`, so :meth:`restore` can put a socket back at
    its path if the process it replaced removes that name at its exit (a daemon
    older than staging does: its gRPC server was bound at the path).

    Invariants: ``bound`` lists every socket file this process bound, in bind
    order; before :meth:`publish` (staged) none of them is at its path.
    ``_keeps`` maps a path to the second name of this process's socket for it:
    names this process created, each a link to that socket (takeover only).
    """

    def __init__(self, *, staged: bool = False, takeover: bool = False) -> None:
        self.takeover = takeover
        self.staged = staged or takeover
        self.bound: list[BoundSocket] = []
        self.published = not self.staged
        self._keeps: dict[str, str] = {}

    def bind_name(self, path: str) -> str:
        """The name to bind the socket of ``path`` at: the path, or (staged) a new
        random name beside it. Raises ValueError when that name would not fit a
        socket address."""
        if not self.staged:
            return path
        name = _beside(path, "staged")
        if len(os.fsencode(name)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"cannot listen on {path}: the temporary name {name} it is bound at first is "
                f"longer than a Unix socket path may be ({MAX_SOCKET_PATH} bytes); use a "
                "shorter listen path"
            )
        return name

    def record(self, path: str, bound_at: str) -> BoundSocket:
        """Remembers the socket just bound at ``bound_at`` for ``path``."""
        info = os.lstat(bound_at)
        bound = BoundSocket(path, bound_at, info.st_dev, info.st_ino)
        self.bound.append(bound)
        return bound

    def publish(self) -> None:
        """Staged: puts every socket at its path, or none (:meth:`prepare`, then
        :meth:`commit`). Raises PublishError, each path then holding what it held
        before. Nothing to do if not staged or already published."""
        if self.published:
            return
        self.commit(self.prepare())

    def prepare(self) -> list[Move]:
        """The first half of :meth:`publish`, which changes no path: checks that each
        path is free or a socket of this uid, and links the second names (the
        replaced sockets', and under a takeover this process's). Raises
        PublishError having removed every name it made."""
        moves: list[Move] = []
        try:
            for socket in self.bound:
                moves.append(self._prepare_one(socket))
        except BaseException:
            _drop_replaced_keeps(moves)
            self.forget_links()
            raise
        return moves

    def commit(self, moves: list[Move]) -> None:
        """The second half of :meth:`publish`: each socket to its path, renamed over
        the socket it replaces (or linked at a free path: never over a file that
        appeared since). A failure puts the replaced sockets back at the paths
        already done and raises PublishError."""
        try:
            for move in moves:
                try:
                    _move(move)
                except OSError as exc:
                    trouble = _put_back(moves)
                    raise PublishError(
                        move.socket.path,
                        f"cannot put the socket {move.socket.bound_at} at {move.socket.path}: "
                        f"{exc.strerror}{trouble}",
                    ) from None
                move.done = True
        finally:
            _drop_replaced_keeps(moves)
        self.published = True

    def restore(self) -> list[str]:
        """Puts back at its path each published socket whose path is now free (the
        replaced process removed the name at its exit); returns those paths. A path
        holding anything else (the socket of a daemon that took this one over) is
        never touched."""
        restored: list[str] = []
        for socket in self.bound:
            keep = self._keeps.get(socket.path)
            if keep is None or socket.is_at(socket.path):
                continue
            try:
                os.link(keep, socket.path, follow_symlinks=False)
            except FileExistsError:
                continue
            except OSError as exc:
                log.warning("cannot put the socket %s back: %s", socket.path, exc.strerror)
                continue
            restored.append(socket.path)
        return restored

    def forget_links(self) -> None:
        """Removes the second names :meth:`publish` kept (each only while it still
        names this process's socket)."""
        for socket in self.bound:
            keep = self._keeps.pop(socket.path, None)
            if keep is not None:
                _unlink_if((socket.dev, socket.ino), keep)

    def remove_own(self) -> None:
        """Removes every socket file of this process still at its path or at its
        temporary name; a file another process put there is left alone."""
        self.forget_links()
        for socket in self.bound:
            for name in {socket.path, socket.bound_at}:
                _unlink_if((socket.dev, socket.ino), name)

    def _prepare_one(self, socket: BoundSocket) -> Move:
        if not socket.is_at(socket.bound_at):
            raise PublishError(
                socket.path, f"{socket.bound_at}, bound by this process, is no longer its socket"
            )
        replaced = _replaceable(socket.path)
        replaced_keep = None
        if replaced is not None:
            replaced_keep = _second_name(socket.path, replaced, socket.path)
        try:
            if self.takeover:
                own = (socket.dev, socket.ino)
                self._keeps[socket.path] = _second_name(socket.bound_at, own, socket.path)
        except BaseException:
            if replaced is not None and replaced_keep is not None:  # both or neither
                _unlink_if(replaced, replaced_keep)
            raise
        return Move(socket, replaced, replaced_keep)


def unlink_if_own(path: str, bound: BoundSocket | None) -> None:
    """Removes ``path`` if it is still the socket ``bound`` (None: nothing)."""
    if bound is not None:
        _unlink_if((bound.dev, bound.ino), path)


def _beside(path: str, what: str) -> str:
    """A new name next to ``path`` nobody can have guessed: ``.NAME.WHAT-TOKEN``."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{what}-{secrets.token_hex(NAME_TOKEN_BYTES)}")


def _socket_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the socket file at ``path`` (no link followed); None when
    there is none (nothing, or another kind of file)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISSOCK(info.st_mode) else None


def _replaceable(path: str) -> tuple[int, int] | None:
    """The identity of the socket at ``path`` that publishing would replace; None
    when the path is free. Raises PublishError for anything else there (a file of
    another kind, a link, another uid's socket): never replaced nor followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PublishError(path, f"cannot inspect {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        kind = filekind.describe(path, info.st_mode)
        raise PublishError(
            path,
            f"{path} is {kind} owned by uid {info.st_uid}, not a socket (remove it or "
            "choose another listen path)",
        )
    if info.st_uid != os.geteuid():
        raise PublishError(
            path,
            f"the socket {path} belongs to uid {info.st_uid}, not to this daemon's uid "
            f"{os.geteuid()} (remove it or choose another listen path)",
        )
    return info.st_dev, info.st_ino


def _second_name(source: str, identity: tuple[int, int], path: str) -> str:
    """A new random name beside ``path`` for the socket ``identity`` now at
    ``source`` (``link(2)``, no link followed). Raises PublishError, leaving no
    name, when that fails or ``source`` is another file by now."""
    keep = _beside(path, "keep")
    try:
        os.link(source, keep, follow_symlinks=False)
    except OSError as exc:
        raise PublishError(path, f"cannot link {keep} to {source}: {exc.strerror}") from None
    if _socket_identity(keep) != identity:  # source replaced since it was looked at
        _unlink_quietly(keep)
        raise PublishError(path, f"{source} was replaced while it was published; try again")
    return keep


def _move(move: Move) -> None:
    """``move``'s socket to its path: renamed over the socket it replaces, or linked
    at the free path then unlinked from its temporary name (link never replaces a
    file that appeared there since the check)."""
    socket = move.socket
    if move.replaced is not None:
        os.rename(socket.bound_at, socket.path)
        return
    os.link(socket.bound_at, socket.path, follow_symlinks=False)
    with contextlib.suppress(OSError):  # published: a name left here goes at the stop
        os.unlink(socket.bound_at)


def _put_back(moves: list[Move]) -> str:
    """Undoes the moves done, last first: each replaced socket renamed back over its
    path (its second name), each free path freed again. Returns what could not be
    undone, for the error (empty when all was)."""
    trouble: list[str] = []
    for move in reversed(moves):
        if not move.done:
            continue
        socket = move.socket
        try:
            if move.replaced is not None and move.replaced_keep is not None:
                os.rename(move.replaced_keep, socket.path)
            else:
                _unlink_if((socket.dev, socket.ino), socket.path)
        except OSError as exc:
            trouble.append(f"{socket.path} ({exc.strerror})")
        move.done = False
    if not trouble:
        return "; the sockets already replaced were put back"
    return f"; could not put back {', '.join(trouble)}"


def _drop_replaced_keeps(moves: list[Move]) -> None:
    for move in moves:
        if move.replaced is not None and move.replaced_keep is not None:
            _unlink_if(move.replaced, move.replaced_keep)


def _unlink_if(identity: tuple[int, int], name: str) -> None:
    """Removes ``name`` if it is the socket ``identity`` (never another file)."""
    if _socket_identity(name) == identity:
        _unlink_quietly(name)


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)
