"""Eviction policies of the primary tier, by name (docs/design/semantics.md, "Eviction policies").

``make_policy`` is the only constructor the rest of the daemon uses; the names
are the values of ``PoolSpec.eviction_policy``, declared once with the client
(:data:`kvtierd.contract.EVICTION_POLICIES`).

- ``base``: the interface (:class:`CachePolicy`) and the manager's callbacks it reads;
- ``lru``: least recently used (vLLM's ``LRUCachePolicy``);
- ``arc``: adaptive replacement (vLLM's ``ARCCachePolicy``).

Invariants: a policy only orders the keys the manager tells it about and, when asked,
names ready blocks (ref count 0) to evict; it never changes a ref count and never
allocates or frees a row. Every method runs on the event loop and never blocks.

May import: ``kvtierd.contract`` and the standard library only.
"""

from __future__ import annotations

from kvtierd.contract import ARC, EVICTION_POLICIES, LRU
from kvtierd.primary.policies.arc import ARCPolicy, ArcStats
from kvtierd.primary.policies.base import CachePolicy, KeyOf, RefCount, RowOf
from kvtierd.primary.policies.lru import LRUPolicy

__all__ = [
    "ARCPolicy",
    "ArcStats",
    "CachePolicy",
    "LRUPolicy",
    "make_policy",
]

_POLICIES: dict[str, type[CachePolicy]] = {LRU: LRUPolicy, ARC: ARCPolicy}
assert tuple(_POLICIES) == EVICTION_POLICIES, "a policy without its class, or the reverse"


def make_policy(
    name: str, capacity: int, ref_count: RefCount, row_of: RowOf, key_of: KeyOf
) -> CachePolicy:
    """A new, empty policy ``name`` for a tier of ``capacity`` rows.

    ``ref_count(key)`` must return the manager's ref count of a resident key;
    ``row_of(key)`` its row in ``[0, capacity)`` (``None`` if not resident) and
    ``key_of(row)`` the key mapped to a row.
    Raises ``ValueError`` naming the supported policies if ``name`` is unknown.
    """
    try:
        cls = _POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction policy {name!r}; supported: {', '.join(EVICTION_POLICIES)}"
        ) from None
    return cls(capacity, ref_count, row_of, key_of)
