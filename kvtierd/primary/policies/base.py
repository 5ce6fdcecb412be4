"""The eviction-policy interface of the primary tier (docs/design/semantics.md,
"Eviction policies").

Division of labour: the :class:`~kvtierd.primary.manager.PrimaryManager` owns every
block (its row, its ref count, its presence); a policy only *orders* the keys
the manager tells it about and, when asked, names which ready blocks to evict.
A policy never changes a ref count and never allocates or frees a row.

Ref-count vocabulary (``kvtierd.contract``): ``-1`` write in flight, ``0`` ready
and evictable, ``> 0`` pinned. The manager calls the hooks on exactly these
transitions, always *after* updating the ref count it reports through the
``ref_count`` callback:

* ``insert``             -- a new key is resident with ref ``-1``;
* ``mark_evictable``     -- ref went ``-1 -> 0`` (store completed) or ``1 -> 0``
  (last pin released);
* ``mark_non_evictable`` -- ref went ``0 -> 1`` (first pin taken);
* ``remove``             -- the key left the primary tier without being chosen by
  :meth:`CachePolicy.evict` (failed store, flush);
* ``evict``              -- the policy chose victims; they leave the policy at once
  and the manager frees their rows.

Keys and rows: the manager maps each resident key to a row in ``[0, capacity)``
and lends the policy read access to that table (``row_of`` / ``key_of``). The
per-key hooks above take keys; the ``*_rows`` hooks are the manager's per-call
fast path and are equivalent to calling the per-key hook for each row in order
(the defaults do exactly that). A row hook is called while its rows are still
mapped to their keys.

Every method runs on the daemon's event loop; none blocks or raises for a
well-formed call sequence. A policy that returns ``None`` from ``evict`` has
changed nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, overload

from kvtierd.contract import BlockKey

RefCount = Callable[[BlockKey], int]
"""``ref_count(key)`` -> the manager's current ref count of a *resident* key."""


class RowOf(Protocol):
    """``row_of(key)`` -> the row of a resident key, ``None`` if it is not resident;
    ``row_of(key, default)`` -> ``default`` instead of ``None`` (``dict.get``'s
    signature: the LRU maps its lookups in C with a default row)."""

    @overload
    def __call__(self, key: BlockKey, /) -> int | None: ...
    @overload
    def __call__(self, key: BlockKey, default: int, /) -> int: ...


KeyOf = Callable[[int], "BlockKey | None"]
"""``key_of(row)`` -> the key mapped to ``row`` (``None`` for a free row)."""


class CachePolicy(ABC):
    """Orders resident keys and picks eviction victims.

    Invariant (every policy): the set of keys the policy holds as resident equals
    the set of keys the manager holds, and a key is only ever returned by
    :meth:`evict` while ``ref_count(key) == 0``.
    """

    def __init__(self, capacity: int, ref_count: RefCount, row_of: RowOf, key_of: KeyOf) -> None:
        """``capacity`` is the number of rows of the tier (rows lie in
        ``[0, capacity)``; it also bounds ARC's ghost lists); ``ref_count`` reads
        the manager's ref count of a resident key; ``row_of`` / ``key_of`` read the
        manager's block table in either direction."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._ref_count = ref_count
        self._row_of = row_of
        self._key_of = key_of

    @property
    def capacity(self) -> int:
        return self._capacity

    @abstractmethod
    def insert(self, key: BlockKey) -> None:
        """A new key became resident.

        Precondition: ``key`` is not resident; its ref count is ``-1`` (write in
        flight), so it is not evictable.
        State change: the key is resident in the policy (ARC: at the MRU end of T1,
        dropped from the ghost lists).
        """

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """Forget a resident key that left outside :meth:`evict`.

        Precondition: ``key`` is resident (any ref count; the manager drops it right
        after this call).
        State change: the key is no longer resident. ARC: the ghost lists are not
        changed (a failed store leaves no ghost).
        """

    @abstractmethod
    def mark_evictable(self, key: BlockKey) -> None:
        """The ref count of resident ``key`` became ``0`` (from ``-1`` or ``1``).

        State change: LRU appends the key at the MRU end of the evictable order
        (completing a store or the last load counts as a use). ARC: nothing.
        """

    @abstractmethod
    def mark_non_evictable(self, key: BlockKey) -> None:
        """The ref count of resident ``key`` went ``0 -> 1`` (first pin).

        State change: LRU drops the key from the evictable order. ARC: nothing.
        """

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` recently used; the first key ends the most recent.

        Precondition: none; keys that are not resident are ignored (ARC: a key in a
        ghost list adapts the T1 target).
        State change: recency order only; never residency or ref counts.
        """

    @abstractmethod
    def evict(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        """Choose exactly ``n`` victims among resident keys with ref count ``0``
        that are not in ``protected``.

        Precondition: ``n >= 0``.
        State change (all-or-nothing): on success the victims are no longer
        resident (ARC: they move to the ghost lists, which are trimmed to
        ``capacity``) and are returned in eviction order; ``n == 0`` returns ``[]``.
        If ``n`` victims cannot be found, returns ``None`` and changes nothing.
        """

    # ----------------------------------------------------------------- per call

    def insert_rows(self, rows: Sequence[int]) -> None:
        """:meth:`insert` of the key of each row, in order."""
        key_of = self._key_of
        for row in rows:
            self.insert(key_of(row))  # type: ignore[arg-type]

    def remove_rows(self, rows: Iterable[int]) -> None:
        """:meth:`remove` of the key of each row, in order."""
        key_of = self._key_of
        for row in rows:
            self.remove(key_of(row))  # type: ignore[arg-type]

    def mark_evictable_rows(self, rows: Iterable[int]) -> None:
        """:meth:`mark_evictable` of the key of each row, in order."""
        key_of = self._key_of
        for row in rows:
            self.mark_evictable(key_of(row))  # type: ignore[arg-type]

    def mark_non_evictable_rows(self, rows: Iterable[int]) -> None:
        """:meth:`mark_non_evictable` of the key of each row, in order."""
        key_of = self._key_of
        for row in rows:
            self.mark_non_evictable(key_of(row))  # type: ignore[arg-type]

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, ghosts and adaptive state included."""

    @abstractmethod
    def check_invariants(self, resident: Collection[BlockKey], evictable: int) -> None:
        """Asserts the policy's own structure against the manager's table:
        ``resident`` its mapped keys, ``evictable`` how many of them have ref 0
        (the manager's ``check_invariants``; tests, debugging)."""
