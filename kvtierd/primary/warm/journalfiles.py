"""The warm-restart journal's files in ``memory.shm_dir``, a directory other local
users may be able to write (``/dev/shm`` is sticky and world-writable;
docs/security.md, "A shared shm_dir and files other users plant there").

Anyone who can create files there can create one at a name the daemon uses
before the daemon does. In a sticky directory the daemon can neither remove nor
rename over another user's file (EPERM), so every operation here is written for
such a plant:

* :func:`planted` tells whether something that is not this daemon's regular file
  sits at the journal's path (``lstat``: never followed), in words for the one
  line that reports it;
* :func:`open_temporary` creates the temporary file a journal is written to
  before it is renamed over the journal: a new, unpredictable name created with
  ``O_EXCL | O_NOFOLLOW`` each time, so no file planted at a fixed name can
  block or redirect the write;
* :func:`remove_journal` removes the journal and the temporary files this daemon
  left (a crash during a rewrite), and only files of this uid; it never raises:
  what it cannot or must not remove is returned, described.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from kvtierd.security.trusted_dirs import owner_name
from kvtierd.util import filekind

TEMP_MARK = ".tmp-"  # a temporary file is the journal's name + TEMP_MARK + 16 hex digits
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
_CREATE_ATTEMPTS = 8  # EEXIST with 64 random bits: someone is listing and racing us


def planted(path: str) -> str | None:
    """None if ``path`` is absent or this uid's regular file; else what is there, as
    the reason warm restart cannot use that name (never followed, never changed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror or exc})"
    euid = os.geteuid()
    if stat.S_ISREG(st.st_mode) and st.st_uid == euid:
        return None
    return (
        f"{path} is {filekind.describe(path, st.st_mode)} owned by {owner_name(st.st_uid)}, "
        f"not a journal of this kvtierd ({owner_name(euid)}): remove it, or give "
        "memory.shm_dir a directory only kvtierd can write"
    )


def open_temporary(path: str) -> tuple[int, str]:
    """A new, empty file next to ``path`` at an unpredictable name: (its descriptor,
    readable and appending, mode 0600; its path). Raises OSError."""
    for _ in range(_CREATE_ATTEMPTS):
        temporary = f"{path}{TEMP_MARK}{secrets.token_hex(8)}"
        try:
            return os.open(temporary, _CREATE, 0o600), temporary
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free temporary name next to {path}")


def unlink_own(path: str) -> None:
    """Removes ``path`` if it is this uid's (never another user's file); quiet."""
    try:
        if os.lstat(path).st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass  # gone already, or not ours to remove


def remove_journal(path: str, *, temporaries: bool = True) -> str | None:
    """Removes the journal at ``path`` (a cold start, or warm restart off) and, with
    ``temporaries``, the temporary files of it this uid left (one listing of the
    directory: off the event loop). Never raises: returns :func:`planted`'s
    description of an entry at ``path`` that is not this daemon's (left alone),
    or of a failure to remove it; None when ``path`` is gone."""
    if temporaries:
        remove_temporaries(path)
    found = planted(path)
    if found is not None:
        return found
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"{path} cannot be removed ({exc.strerror or exc})"
    return None


def remove_temporaries(path: str) -> None:
    """Unlinks this uid's ``<path>.tmp-*`` files (a daemon killed during a rewrite
    leaves one; ``<path>.tmp``: an older kvtierd's fixed name). One listing of the
    directory (a worker thread's, never the loop's)."""
    directory, name = os.path.split(path)
    prefix = name + ".tmp"
    try:
        with os.scandir(directory or ".") as entries:
            found = [entry.path for entry in entries if entry.name.startswith(prefix)]
    except OSError:
        return
    for temporary in found:
        unlink_own(temporary)
