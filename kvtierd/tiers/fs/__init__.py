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
* :mod:`.blockio`, :mod:`.ioworker`, :mod:`.iowire` -- where block I/O runs (inline, or
  in I/O worker processes the daemon supervises), the worker process's own side, and
  the messages between them.
* :mod:`.writelog` -- rate-limited reports of failed writes.

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
