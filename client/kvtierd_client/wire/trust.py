"""Whether a path or a peer can be the daemon's: the client's defence against a local
user impersonating kvtierd (docs/security.md, "Who can be the daemon").

A client finds the daemon by a path (its Unix socket) and the daemon then names more
paths (the region file, the descriptor and lane sockets). Any of them in a directory
another user may write could be theirs: a fake daemon announcing a region file its
author owns would read the engine's prompts and feed it bytes of its choosing as HITs.
So no path is used until :func:`placed_entry` shows that every component of it was put
there by someone the client trusts, walking down from ``/``:

* ``/`` and every directory on the way must not be writable by group or others
  unless it is sticky (``/tmp``, ``/dev/shm``): a non-sticky one lets anyone rename
  or replace what lies in it.
* An entry of a directory only its owner may write was put there by that owner, so
  its owner is *placed*: whoever ``root`` gave ``/run/kvtierd`` or ``/home/alice`` is
  who the path names (delegation; nothing to configure for the systemd layout).
* An entry of a sticky directory others may write (``/tmp/kvtierd-vllm``) could have
  been made by anyone: it counts only when its owner is *trusted* (root, this
  process's user, the users of ``$KVTIERD_DAEMON_USER`` or of the client's
  ``daemon_user``) or owns the sticky directory.
* A symlink counts as an entry (its placement is checked) and its target is walked
  the same way; at most :data:`MAX_SYMLINKS` of them.

The daemon's uid is then the owner of its socket (:func:`daemon_uid`), and everything
else it announces must be owned by that uid (:func:`require_owned_by`) and, for a
socket, served by it (:func:`require_peer`: ``SO_PEERCRED``, which nobody can forge).
A path that passes cannot be swapped afterwards by anyone untrusted: every directory
on it is writable only by placed owners (or sticky, where only the entry's owner
may rename it).

Shared by the daemon (``kvtierctl``) and the client: standard library only.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from collections.abc import Iterable

DAEMON_USER_ENV = "KVTIERD_DAEMON_USER"
MAX_SYMLINKS = 16
GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class UntrustedDaemon(PermissionError):
    """A path or a peer that cannot be trusted to be kvtierd's; the message names
    it, says why and what to fix. Nothing was sent to it."""


def user_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a passwd entry."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def parse_daemon_users(text: str, source: str = DAEMON_USER_ENV) -> frozenset[int]:
    """The uids of ``text``: user names or numeric uids, separated by commas.
    Raises ValueError naming ``source`` for an unknown user."""
    uids: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"{source}: no user named {item!r} on this host") from None
    return frozenset(uids)


def trusted_uids(daemon_user: Iterable[int | str] | int | str | None = None) -> frozenset[int]:
    """The uids this process trusts to run its daemon: root, its own effective uid,
    those of ``$KVTIERD_DAEMON_USER`` and ``daemon_user`` (names or uids)."""
    uids = {0, os.geteuid()}
    uids |= parse_daemon_users(os.environ.get(DAEMON_USER_ENV, ""))
    if daemon_user is None:
        return frozenset(uids)
    items = [daemon_user] if isinstance(daemon_user, (int, str)) else list(daemon_user)
    for item in items:
        if isinstance(item, int):
            uids.add(item)
        else:
            uids |= parse_daemon_users(item, "daemon_user")
    return frozenset(uids)


def placed_entry(path: str, trusted: frozenset[int], what: str) -> os.stat_result:
    """The ``lstat`` of what ``path`` names (symlinks followed), once every component
    of it has been shown to be placed by a trusted or delegated owner (module doc).

    ``what`` names the path in messages ("the daemon's socket"). Raises
    UntrustedDaemon, FileNotFoundError (a component is missing), PermissionError
    (a directory on the way cannot be searched) and OSError."""
    return _walk(path, trusted, what, 0)


def daemon_uid(socket_path: str, trusted: frozenset[int]) -> int:
    """The uid of the daemon serving ``socket_path``: the owner of that socket, once
    placed (:func:`placed_entry`). Raises UntrustedDaemon (also for something that is
    not a socket), FileNotFoundError when nothing is there (not started yet)."""
    info = placed_entry(socket_path, trusted, "the daemon's socket")
    if not stat.S_ISSOCK(info.st_mode):
        raise UntrustedDaemon(f"{socket_path} is not a socket; it cannot be kvtierd's")
    return info.st_uid


def require_owned_by(path: str, uid: int, trusted: frozenset[int], what: str) -> os.stat_result:
    """The ``lstat`` of ``path``, which the daemon of ``uid`` announced as ``what``: it
    must be placed (``uid`` counts as trusted here) and owned by ``uid``. Raises
    UntrustedDaemon, and OSError as :func:`placed_entry`."""
    info = placed_entry(path, trusted | {uid}, what)
    if info.st_uid != uid:
        raise UntrustedDaemon(
            f"{what} {path} is owned by {user_name(info.st_uid)}, not by the daemon's user "
            f"{user_name(uid)}: another user made it. Not using it"
        )
    return info


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the connected Unix socket ``sock``
    (``SO_PEERCRED``: set by the kernel, unforgeable)."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(uid)


def require_peer(sock: socket.socket, uid: int, path: str, what: str) -> None:
    """Raises UntrustedDaemon unless the process serving ``sock`` (connected to
    ``path``) runs as ``uid``, the daemon's user."""
    served_by = peer_uid(sock)
    if served_by != uid:
        raise UntrustedDaemon(
            f"{what} {path} is served by {user_name(served_by)}, not by the daemon's user "
            f"{user_name(uid)}: another user's process answers there. Not using it"
        )


def _walk(path: str, trusted: frozenset[int], what: str, links: int) -> os.stat_result:
    if not path.startswith("/"):
        raise UntrustedDaemon(f"{what} {path} is not an absolute path")
    current = "/"
    parent = os.lstat("/")
    _check_root(parent, what)
    names = [name for name in path.split("/") if name and name != "."]
    for index, name in enumerate(names):
        if name == "..":
            current = os.path.dirname(current)  # ``current`` is a real path: no link to undo
            parent = os.lstat(current)
            continue
        entry = os.path.join(current, name)
        info = os.lstat(entry)
        _check_placed(entry, info, current, parent, trusted, what, path)
        if stat.S_ISLNK(info.st_mode):
            if links >= MAX_SYMLINKS:
                raise UntrustedDaemon(f"{what} {path}: more than {MAX_SYMLINKS} symlinks")
            target = os.path.join(current, os.readlink(entry), *names[index + 1 :])
            return _walk(target, trusted, what, links + 1)
        current, parent = entry, info
    return parent


def _check_root(info: os.stat_result, what: str) -> None:
    if info.st_uid != 0 or (info.st_mode & GROUP_OR_OTHER_WRITE and not _sticky(info)):
        raise UntrustedDaemon(
            f"/ is owned by {user_name(info.st_uid)} with mode {stat.filemode(info.st_mode)}: "
            f"no path on this host can be trusted to hold {what}"
        )


def _check_placed(
    entry: str,
    info: os.stat_result,
    directory: str,
    directory_info: os.stat_result,
    trusted: frozenset[int],
    what: str,
    path: str,
) -> None:
    """Raises UntrustedDaemon unless ``entry`` (in ``directory``) can only have been put
    there by a placed owner (module doc)."""
    of = "" if entry == path else f" (on the way to {what} {path})"
    if not directory_info.st_mode & GROUP_OR_OTHER_WRITE:
        return  # only the directory's (placed) owner can have put it there
    if not _sticky(directory_info):
        raise UntrustedDaemon(
            f"{directory}{of} is writable by other users ({stat.filemode(directory_info.st_mode)}) "
            f"and not sticky: anyone could replace {entry}. Use a directory only the "
            f"daemon's user may write (chmod go-w {directory})"
        )
    if info.st_uid in trusted or info.st_uid == directory_info.st_uid:
        return
    raise UntrustedDaemon(
        f"{entry}{of} is owned by {user_name(info.st_uid)} in {directory}, a directory "
        "anyone may create names in: anyone could have made it, and this process does "
        f"not trust {user_name(info.st_uid)} to run kvtierd. If that user runs your "
        f"daemon, say so: {DAEMON_USER_ENV}={_login(info.st_uid)} (or the client's "
        "daemon_user=); otherwise use a private socket directory (the default one is)"
    )


def _login(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _sticky(info: os.stat_result) -> bool:
    return bool(info.st_mode & stat.S_ISVTX)
