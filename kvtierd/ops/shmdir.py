"""``memory.shm_dir``: where the daemon keeps its region files and warm-restart
journals (docs/security.md, "A shared shm_dir and files other users plant there").

:func:`prepare_shm_dir` runs once at start. A directory that does not exist yet
is created (its parent must exist), owned by the daemon, mode 0750 with the
regions' group (clients of the socket group map the region files by path; they
may list them, not create or remove anything), or 0700 when principals are
configured (other uids then get descriptors, never paths). That is how the
shipped configurations get a **private** directory under a shared tmpfs
(``/dev/shm/kvtierd``): nobody else can create a file at any of the daemon's
names there. A shared, sticky ``shm_dir`` (``/dev/shm`` itself) still works: the
daemon's files are opened so that a file another user planted is reported, never
followed (:mod:`kvtierd.primary.warm.journalfiles`, :mod:`kvtierd.primary.region`).

Then the directory must be the daemon's own (``security.trusted_dirs``): a
directory at that path created by another user first refuses the start with
one line (exit code 2) naming its owner.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile

from kvtierd.errors import ConfigError
from kvtierd.primary.region import is_region_file_name
from kvtierd.security.own_dirs import PRIVATE_MODE, SHARED_MODE, ParentMissing, create_own_dir
from kvtierd.security.trusted_dirs import UntrustedPath, require_own_entries, require_trusted_dir

log = logging.getLogger(__name__)


def prepare_shm_dir(path: str, gid: int | None, *, private: bool) -> None:
    """Creates ``path`` if it is missing (mode :data:`SHARED_MODE` and group ``gid``,
    or :data:`PRIVATE_MODE` when ``private``), then checks it is the daemon's own,
    with no symlink at a region file's name (in a sticky directory, where anyone may
    plant one, a WARNING each), and that files can be created there (permission
    bits alone lie for root). Raises ConfigError (exit code 2) naming the option."""
    if not os.path.lexists(path):
        _create(path, gid, PRIVATE_MODE if private else SHARED_MODE)
    if not os.path.isdir(path):
        raise ConfigError("memory.shm_dir", f"{path} is not a directory")
    try:
        require_trusted_dir(path)
        shared = bool(os.stat(path).st_mode & stat.S_ISVTX)  # others may write there
        for planted in require_own_entries(path, is_region_file_name, shared=shared):
            log.warning("memory.shm_dir: %s (ignored: never followed)", planted)
    except UntrustedPath as exc:
        raise ConfigError("memory.shm_dir", str(exc)) from None
    try:
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".kvtierd-probe-")  # noqa: SIM115
        probe.close()
    except OSError as exc:
        raise ConfigError(
            "memory.shm_dir", f"cannot create files in {path}: {exc.strerror}"
        ) from None


def _create(path: str, gid: int | None, mode: int) -> None:
    try:
        created = create_own_dir(path, gid, mode)
    except ParentMissing:
        parent = os.path.dirname(os.path.normpath(path))
        raise ConfigError(
            "memory.shm_dir", f"{path} is not a directory (nor is {parent}, where it would be made)"
        ) from None
    except OSError as exc:
        raise ConfigError("memory.shm_dir", f"cannot create {path}: {exc.strerror}") from None
    if created:
        log.info("memory.shm_dir %s created: mode %o, the daemon's own", path, mode)
