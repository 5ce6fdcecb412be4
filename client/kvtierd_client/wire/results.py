"""Values that cross the wire, shared by the client and the daemon.

This module is the one definition of the answers both sides speak about, and of
the eviction policies a pool may be opened with (:data:`EVICTION_POLICIES`), so the
daemon's ``kvtierd.contract`` imports them from here instead of declaring its own
(the daemon already depends on ``kvtierd_client`` for the gRPC stubs; the client
never imports ``kvtierd``, so it stays usable without the daemon's package). Enum
values equal the wire enums of ``kvtier.v1``: both sides convert with ``int()`` and
nothing else.

Nothing here does I/O or imports gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ARC",
    "DEFAULT_EVICTION_POLICY",
    "EVICTION_POLICIES",
    "LRU",
    "LookupResult",
    "StoreResult",
]


class LookupResult(enum.IntEnum):
    """Answer of a lookup for one key (wire: ``LOOKUP_RESULT_*``)."""

    MISS = 1  # in no tier
    HIT = 2  # readable in the primary tier now
    HIT_PENDING = 3  # a write into the primary is in flight; ask again
    RETRY = 4  # a tier cannot answer yet; ask again


LRU = "lru"  # least recently used
ARC = "arc"  # adaptive replacement cache
EVICTION_POLICIES: tuple[str, ...] = (LRU, ARC)
"""The primary tier's eviction policies, by the name a pool is opened with (wire:
``PoolSpec.eviction_policy``, a string); every list of them is this one."""
DEFAULT_EVICTION_POLICY = LRU
"""What an empty ``eviction_policy`` asks for."""


@dataclass(frozen=True)
class StoreResult:
    """An accepted PrepareStore: ``block_ids[i]`` is the reserved row for ``keys_to_store[i]``.

    The rows belong to the session until it calls ``complete_store`` (or closes);
    ``evicted_keys`` left the primary tier to make room.
    """

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]
