"""Vocabulary shared by every layer of the daemon (docs/design/architecture.md,
docs/design/semantics.md).

Values of the enums equal the wire enums of ``kvtier.v1`` so the service layer
converts with ``int()`` and nothing else.

Ownership vocabulary used across the package:

* a *block* is one row of a pool's region, named by its *key* (opaque bytes);
* its *ref count* is ``-1`` while a write into the row is in flight, ``0`` when it
  is readable and evictable, ``> 0`` while that many readers (loads, secondary
  tier writes) hold *pins*; only ``0`` blocks are ever evicted;
* a pin or a write reservation always has an owner (a session, or the pool
  itself for tier jobs), and only that owner's completion releases it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The answer of a lookup and the eviction policies' names are defined once, with the
# client (wire values the client speaks too); the daemon already depends on
# kvtierd_client for the stubs.
from kvtierd_client.wire.results import ARC as ARC
from kvtierd_client.wire.results import DEFAULT_EVICTION_POLICY as DEFAULT_EVICTION_POLICY
from kvtierd_client.wire.results import EVICTION_POLICIES as EVICTION_POLICIES
from kvtierd_client.wire.results import LRU as LRU
from kvtierd_client.wire.results import LookupResult as LookupResult

BlockKey = bytes

PRIMARY_TIER = "primary"


class Medium(enum.IntEnum):
    """Where a tier keeps its bytes (wire: ``MEDIUM_*``)."""

    CPU = 1
    STORAGE = 2
    REMOTE = 3


def key_repr(key: BlockKey) -> str:
    """A short printable form of a key for error messages and logs."""
    text = key[:16].hex()
    return text + ("..." if len(key) > 16 else "") + f" ({len(key)} bytes)"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a pool is: fixed at creation; joiners must match name, block size, layout."""

    name: str
    block_bytes: int
    num_blocks: int
    layout: str
    eviction_policy: str


@dataclass(frozen=True, slots=True)
class StoreGrant:
    """Result of an accepted PrepareStore.

    ``block_ids[i]`` is the reserved row for ``keys_to_store[i]``; the rows are
    owned by the caller (ref count -1) until it completes or aborts the store.
    """

    keys_to_store: list[BlockKey]
    block_ids: list[int]
    evicted_keys: list[BlockKey]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Blocks that appeared in (``removed=False``) or left a tier."""

    keys: tuple[BlockKey, ...]
    medium: Medium
    removed: bool
    tier: str = PRIMARY_TIER
