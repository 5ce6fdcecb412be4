"""Removing files below one pool directory: evicted, corrupt and orphaned ones.

Every path goes through :class:`~kvtierd.tiers.fs.safefs.PoolDir` (no symlink
followed, never a directory removed). Failures are logged, never raised: a
file that cannot be removed now is met again by the next start's scan.
Thread-safe (no state but a counter for temp names).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import stat

from kvtierd.contract import BlockKey
from kvtierd.tiers.fs import fsformat, safefs
from kvtierd.tiers.fs.fsformat import TEMP_SUFFIX
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry

log = logging.getLogger(__name__)


class PoolFiles:
    """The files of one pool's fs tier, by key or by path relative to ``pool_dir``."""

    def __init__(self, tier_name: str, pool_dir: str) -> None:
        self.tier_name = tier_name
        self.pool_dir = pool_dir
        self._temp_tag = secrets.token_hex(6)  # temp names: tag + counter, no syscall each
        self._temp_counter = itertools.count()

    def path(self, key: BlockKey) -> str:
        """The full path of ``key``'s block file, for messages."""
        return self.full(fsformat.block_rel_path(key))

    def full(self, rel: str) -> str:
        """``rel`` (relative to the pool directory) as a full path, for messages."""
        return os.path.join(self.pool_dir, rel)

    def temp_name(self) -> str:
        """A name no other writer uses: a random tag per tier instance (so not one of
        a crashed run's leftovers) and a counter (``next`` on it is atomic)."""
        return f"{self._temp_tag}-{next(self._temp_counter)}"

    def remove_evicted(self, key: BlockKey) -> None:
        """Renames ``key``'s file aside and unlinks it there (a crash in between
        leaves a temp file, removed at the next start); unlinks it in place when
        it cannot be renamed."""
        rel = fsformat.block_rel_path(key)
        aside = f"{name_of(rel)}.{self.temp_name()}.evicted{TEMP_SUFFIX}"
        try:
            with PoolDir(self.pool_dir) as pool:
                try:
                    pool.rename(rel, aside)
                except FileNotFoundError:
                    return
                except OSError:
                    pool.unlink(rel)  # cannot rename: unlink it where it is
                    return
            self.unlink_quietly(beside(rel, aside))
        except (OSError, UnexpectedEntry) as exc:  # a directory on the way is gone or bad
            log.warning("FS tier %s: cannot evict %s: %s", self.tier_name, self.path(key), exc)

    def remove_bad(self, rel: str, identity: safefs.Identity) -> bool:
        """Unlinks the bad file at ``rel`` if the path still names it; True when the
        path names another file now (rewritten since it was judged)."""
        try:
            with PoolDir(self.pool_dir) as pool:
                current = pool.lstat(rel)
                if current is not None and safefs.identity_of(current) != identity:
                    return True
                pool.unlink_if_same(rel, identity)
        except (OSError, UnexpectedEntry) as exc:
            log.warning("FS tier %s: cannot remove %s: %s", self.tier_name, self.full(rel), exc)
        return False

    def holds_whole(self, rel: str, size: int) -> bool:
        """Whether a regular file of exactly ``size`` bytes is at ``rel`` (no symlink
        followed); False when the path or a directory on the way is missing or bad."""
        try:
            with PoolDir(self.pool_dir) as pool:
                st = pool.lstat(rel)
        except (OSError, UnexpectedEntry):
            return False
        return st is not None and stat.S_ISREG(st.st_mode) and st.st_size == size

    def unlink_quietly(self, rel: str) -> None:
        """Unlinks ``rel`` below the pool directory (not a directory, never through a
        symlink); a failure is logged, not raised."""
        try:
            with PoolDir(self.pool_dir) as pool:
                pool.unlink(rel)
        except FileNotFoundError:
            pass
        except (OSError, UnexpectedEntry) as exc:
            log.warning("FS tier %s: cannot remove %s: %s", self.tier_name, self.full(rel), exc)


def name_of(rel: str) -> str:
    """The last component of a path relative to the pool directory."""
    return rel.rsplit("/", 1)[-1]


def beside(rel: str, name: str) -> str:
    """``name`` in the directory of ``rel`` (both relative to the pool directory)."""
    head, _, _ = rel.rpartition("/")
    return f"{head}/{name}" if head else name
