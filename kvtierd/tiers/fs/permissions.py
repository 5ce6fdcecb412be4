"""Who may read an fs tier's files: modes, ownership and the start-up root check.

Block files hold the users' prompts in another form, so (issue #18, item 3):

* Block files and ``pool.json`` are created :data:`FILE_MODE` (0640), pool
  directories and their ``<hh>`` fan-out folders :data:`DIR_MODE` (0750); the
  umask can only make them tighter. Nothing the tier creates grants anything
  to others.
* Looser modes left by an older daemon are tightened, never widened: the pool
  directory when the pool opens (:func:`claim_pool_dir`; others then cannot
  even reach what is below it) and each block file as the start-up scan meets
  it (:func:`tighten`).
* At daemon start :func:`check_root` refuses (exit 2) a root that another user
  owns or may write without the sticky bit, and a symlink or foreign-owned
  directory directly below it, where the daemon creates its pool directories.
  When a pool opens, :func:`claim_pool_dir` refuses a pool directory that
  another user created in the meantime (possible in a sticky root).
"""

from __future__ import annotations

import logging
import os
import stat

from kvtierd.security.trusted_dirs import require_own_entry, require_trusted_dir

log = logging.getLogger(__name__)

FILE_MODE = 0o640  # block files and pool.json
DIR_MODE = 0o750  # pool directories and their <hh> folders
LOOSE_BITS = 0o027  # beyond FILE_MODE / DIR_MODE: group write and anything for others

_DIR_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def tighten(fd: int, st: os.stat_result) -> bool:
    """Drops :data:`LOOSE_BITS` from the open file or directory ``fd`` (``st`` is its
    fstat) when it has any and this process owns it; whether it changed the mode."""
    mode = stat.S_IMODE(st.st_mode)
    if not mode & LOOSE_BITS or st.st_uid != os.geteuid():
        return False
    os.fchmod(fd, mode & ~LOOSE_BITS)
    return True


def claim_pool_dir(fd: int, path: str) -> None:
    """The pool directory ``fd`` (opened without following a link) must be this
    process's own; looser modes are tightened. Raises UntrustedPath."""
    st = os.fstat(fd)
    require_own_entry(path, st)
    if tighten(fd, st):
        log.warning(
            "pool directory %s was mode %s; tightened to %s (no access for others)",
            path, stat.filemode(st.st_mode), stat.filemode(st.st_mode & ~LOOSE_BITS),
        )  # fmt: skip


def check_root(root: str) -> int:
    """Raises UntrustedPath unless ``root`` is a trusted directory
    (:func:`~kvtierd.security.trusted_dirs.require_trusted_dir`) whose directory
    entries are no symlinks and whose subdirectories are this process's own.
    Tightens those subdirectories (the pool directories); returns how many it tightened.
    """
    require_trusted_dir(root)
    tightened = 0
    with os.scandir(root) as entries:
        names = [entry.name for entry in entries]
    for name in sorted(names):
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
            require_own_entry(path, st)
        if stat.S_ISDIR(st.st_mode):
            tightened += _tighten_dir(path)
    if tightened:
        log.warning("fs root %s: %d pool directories had modes open to others; tightened",
                    root, tightened)  # fmt: skip
    return tightened


def _tighten_dir(path: str) -> int:
    try:
        fd = os.open(path, _DIR_OPEN_FLAGS)
    except OSError:  # raced into something else: the pool's own open reports it
        return 0
    try:
        return int(tighten(fd, os.fstat(fd)))
    finally:
        os.close(fd)
