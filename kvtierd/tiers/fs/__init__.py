"""The fs secondary tier: one file per block under a root directory.

Modules, read in this order:

* :mod:`.settings` -- ``FsTierSettings``: every option, its default and its help.
* :mod:`.configured` -- ``ConfiguredFsTier``: one ``[[tiers]]`` entry for the daemon's
  life (root check, shared I/O threads and workers, shared disk budget).
* :mod:`.tier` -- ``FsTier``: one pool's tier, its lifecycle and job flow.
* :mod:`.index` -- ``BlockIndex`` (per-key state and its lock) and ``DiskBudget``.
* :mod:`.startup` -- the start-up probes (root, ``pool.json``, O_DIRECT).
* :mod:`.scan` -- the index rebuild from file headers at start.
* :mod:`.files` -- removing evicted and corrupt files.
* :mod:`.fsck` -- ``kvtierctl fsck``, sharing the scan's header check.
* :mod:`.fsformat`, :mod:`.blockfile`, :mod:`.safefs` -- where block files live (their
  contents: :mod:`kvtierd.tiers.blockformat`), one block file's read, write and header
  check, no-follow opens below a pool directory.
* :mod:`.groups` -- a group of blocks written or read on an I/O thread (its index
  reservations settled on every path).
* :mod:`.blockio`, :mod:`.ioworker`, :mod:`.iowire` -- where block I/O runs (inline, or
  in I/O worker processes the daemon supervises), the worker process's own side, and
  the messages between them.
* :mod:`.permissions` -- who may read the tier's files: modes, owners, the root check.
* :mod:`.rootlock` -- the lock that keeps daemons that must not share a root apart.
* :mod:`.shared`, :mod:`.unserved` -- a shared root (``shared = true``): the files other
  daemons write and remove, and the bytes of the pool directories no pool here serves.
* :mod:`.writelog`, :mod:`.corruptlog` -- rate-limited reports of failed writes and of
  block files that failed verification.

Invariants: a block file is visible only complete (written aside, then renamed); a
block is read back only if its header names its key and its checksum (and, with an
integrity key, its MAC) verifies; nothing below the root is followed through a link or
opened in a way that can block; the bytes the tier charges never exceed ``capacity``
once a job has reported.

May import: ``kvtierd.tiers`` (the contract, failures, integrity, options, the block
format and the I/O threads),
``kvtierd.primary`` (its rows), ``kvtierd.security``, the root vocabulary and
``kvtierd.util``; never ``kvtierd.tiers.redis``.

The names below are imported on first use (PEP 562), so that an I/O worker
process (``python -m kvtierd.tiers.fs.ioworker``) loads only what it runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtierd.tiers.fs.configured import ConfiguredFsTier
    from kvtierd.tiers.fs.index import DiskBudget
    from kvtierd.tiers.fs.settings import FsTierSettings
    from kvtierd.tiers.fs.startup import FsTierError, PoolMismatchError
    from kvtierd.tiers.fs.tier import FsTier

__all__ = [
    "ConfiguredFsTier",
    "DiskBudget",
    "FsTier",
    "FsTierError",
    "FsTierSettings",
    "PoolMismatchError",
]

_HOMES = {
    "ConfiguredFsTier": "kvtierd.tiers.fs.configured",
    "DiskBudget": "kvtierd.tiers.fs.index",
    "FsTier": "kvtierd.tiers.fs.tier",
    "FsTierError": "kvtierd.tiers.fs.startup",
    "FsTierSettings": "kvtierd.tiers.fs.settings",
    "PoolMismatchError": "kvtierd.tiers.fs.startup",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
