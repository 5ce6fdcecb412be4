"""Directories the daemon makes for itself: ``memory.shm_dir`` and the directory of a
Unix listen socket, when missing (docs/security.md, "Files and directories the
daemon writes").

:func:`create_own_dir` makes exactly one directory, never a chain (its parent must
exist: a typo in a path must not leave three directories behind), without following
a symlink planted at its name, and gives it its mode exactly (the umask neither
weakens nor widens it) and the regions' and sockets' group. Whether an existing
directory may be used is :mod:`kvtierd.security.trusted_dirs`'s question, asked
after this for both.
"""

from __future__ import annotations

import contextlib
import os

SHARED_MODE = 0o750  # the socket group reaches the sockets and maps the regions by path
PRIVATE_MODE = 0o700  # with principals: other uids get descriptors, never paths


class ParentMissing(FileNotFoundError):
    """The directory above the one to make does not exist; nothing was made."""


def create_own_dir(path: str, gid: int | None, mode: int) -> bool:
    """Makes ``path`` (mode ``mode``, group ``gid`` when given) if nothing is there;
    returns whether this call made it (False: something appeared there meanwhile,
    to be checked like any existing entry).

    Raises ParentMissing when ``path``'s parent is no directory, and OSError when
    it cannot be made or given its mode and group (then it is removed again)."""
    parent = os.path.dirname(os.path.normpath(path))
    if not os.path.isdir(parent):
        raise ParentMissing(f"{parent}, where {path} would be made, is not a directory")
    try:
        os.mkdir(path, 0o700)  # never follows: a symlink planted there is EEXIST
    except FileExistsError:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)  # exactly: the umask neither weakens nor widens it
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return True


def remove_if_empty(path: str) -> bool:
    """Removes the directory ``path`` if it is empty (one this process made, at its
    stop); returns whether it did. Anything in it (a socket of a daemon that took
    over) keeps it."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True
