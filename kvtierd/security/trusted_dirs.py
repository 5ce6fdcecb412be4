"""Directories the daemon writes KV bytes into must be its own (issue #18, item 3).

Whoever may write a directory can swap, replace or plant what the daemon puts
there: a region file in ``memory.shm_dir`` (clients would map the attacker's
bytes), a pool directory under an fs tier root (a symlink there made a root
daemon write block files into a root-only directory). So, at start:

* :func:`require_trusted_dir` checks ``memory.shm_dir`` and every tier root,
  and each directory above them (the resolved path, ``/`` included): each must
  be owned by the daemon's effective uid or by root, and must not be writable
  by group or others unless the sticky bit is set (``/dev/shm``, ``/tmp``: then
  nobody can rename or remove what the daemon created there).
* :func:`require_own_entry` checks one path component the daemon creates below
  such a directory (a pool directory, a region file): never a symlink, and
  owned by the daemon's uid (in a sticky, world-writable directory another
  user may have created it first). :func:`require_own_entries` refuses, at
  start, a symlink planted at any of the names the daemon creates -- in a
  private directory; in a sticky one anyone may plant it, so it is reported
  (a WARNING) and left: refusing the start would hand every local user a way
  to keep the daemon down.

Each refusal is :class:`UntrustedPath`, whose message names the path, its owner
and what to fix; the daemon turns it into exit code 2 naming the option.
Nothing here changes a file; these are pure checks (``lstat``/``fstat`` only).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from kvtierd_client.wire.trust import user_name as owner_name  # ``name (uid N)``

GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
TRUSTED_OWNERS_DOC = "the daemon's user or root"


class UntrustedPath(Exception):
    """``path`` may not hold the daemon's files; the message says why and what to fix."""

    def __init__(self, path: str, st: os.stat_result, problem: str, fix: str) -> None:
        super().__init__(
            f"{path} (owner {owner_name(st.st_uid)}, mode {stat.filemode(st.st_mode)}) "
            f"{problem}; {fix}"
        )
        self.path = path
        self.owner_uid = st.st_uid


def require_trusted_dir(path: str) -> None:
    """Raises UntrustedPath unless ``path`` and every directory above it (after
    resolving symlinks: those were the operator's choice) are owned by this
    process's euid or root and writable by nobody else unless sticky.

    Raises FileNotFoundError when ``path`` does not exist.
    """
    real = os.path.realpath(path)
    euid = os.geteuid()
    for directory in _self_and_ancestors(real):
        st = os.lstat(directory)
        shown = directory if directory == real or real == path else f"{directory} (of {path})"
        if st.st_uid not in (euid, 0):
            raise UntrustedPath(
                shown,
                st,
                f"is owned by another user, not by {TRUSTED_OWNERS_DOC} ({owner_name(euid)})",
                f"chown it to {owner_name(euid)} or use a directory the daemon's user owns",
            )
        if st.st_mode & GROUP_OR_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
            raise UntrustedPath(
                shown,
                st,
                "is writable by other users and has no sticky bit, so they could swap "
                "or plant the daemon's files",
                f"chmod go-w {directory} (or chmod +t {directory})",
            )


def require_own_entry(path: str, st: os.stat_result) -> None:
    """Raises UntrustedPath unless ``st`` (an ``lstat``/``fstat`` of ``path``, a
    component the daemon creates) is no symlink and is owned by this process's euid."""
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(
            path, st, "is a symlink where the daemon creates its own entry (never followed)",
            "remove it; the daemon creates this entry itself",
        )  # fmt: skip
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UntrustedPath(
            path, st, f"was created by another user, not by the daemon ({owner_name(euid)})",
            "remove it; the daemon creates this entry itself",
        )  # fmt: skip


def require_own_entries(
    directory: str, is_ours: Callable[[str], bool], *, shared: bool = False
) -> list[UntrustedPath]:
    """:func:`require_own_entry` for every entry of ``directory`` whose name
    ``is_ours`` (a name the daemon creates there) that is a symlink; entries
    with other names are not looked at.

    ``shared``: ``directory`` is one others may write in (sticky, as /dev/shm):
    such an entry is returned instead of raised. Anyone may plant one there, and
    refusing the start for it let any local user keep the daemon from starting
    (or restarting); the daemon never follows it, and the pool whose file it
    would be is refused when it is created."""
    with os.scandir(directory) as entries:
        names = sorted(entry.name for entry in entries if is_ours(entry.name))
    planted: list[UntrustedPath] = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            try:
                require_own_entry(path, st)
            except UntrustedPath as exc:
                if not shared:
                    raise
                planted.append(exc)
    return planted


def _self_and_ancestors(real: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]`` (an absolute, resolved path)."""
    parts = [part for part in real.split("/") if part]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
