"""The primary tier's block-table protocol: ref counts, eviction and events
(docs/design/semantics.md, "The primary tier"; vLLM's ``CPUOffloadingManager``).

Ownership: the manager owns every row of the pool's region and the state of
the block in it; the eviction policy only orders keys (``kvtierd.primary.policies``).
Who may change a ref count, and when:

* ``prepare_store`` reserves a free row for a new key: ref ``-1`` (write in
  flight, owned by the caller until ``complete_store``);
* ``complete_store(success=True)`` makes it readable: ``-1 -> 0``;
  ``complete_store(success=False)`` drops it and frees its row;
* ``prepare_load`` pins a ready block: ``n -> n + 1`` (``n >= 0``);
  ``complete_load`` releases one pin: ``n -> n - 1`` (``n > 0``);
* only blocks with ref ``0`` are ever evicted (by ``prepare_store`` to make room,
  or by ``evict_all_evictable``);
* ``abort_and_quarantine`` drops writes like a failed ``complete_store`` but keeps
  their rows out of use (neither mapped nor free) until ``release_quarantine``:
  the fence against a writer that lost its lease (docs/design/leases.md).

Every method is synchronous and runs on the daemon's event loop. Each mutator
checks everything before changing anything: if it raises or refuses (returns
``None``), no state changed. Input errors raise; ``assert`` guards only internal
consistency.

The table itself (rows, ref counts, free list, counters, its invariants and
primitive transitions) is :mod:`kvtierd.primary.table`'s :class:`BlockTable`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvtierd.contract import DEFAULT_EVICTION_POLICY, BlockEvent, BlockKey, Medium, StoreGrant
from kvtierd.primary.table import BlockTable


class PrimaryManager(BlockTable):
    """Block table of one pool's primary tier: the operations its callers use.

    Each operation checks everything before changing anything (see the module
    docstring), then changes the table only through :class:`BlockTable`'s row
    transitions, which keep its invariants.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: str = DEFAULT_EVICTION_POLICY,
        on_event: Callable[[BlockEvent], object] | None = None,
    ) -> None:
        """``on_event`` receives every :class:`BlockEvent` synchronously; it must not
        raise (it runs in the middle of ``prepare_store``, see there)."""
        super().__init__(num_blocks, policy)
        self._on_event = on_event

    def adopt(self, blocks: Sequence[tuple[BlockKey, int]], held: Mapping[int, float]) -> None:
        """Takes over the blocks a previous daemon left ready (warm restart), on a
        fresh manager: each (key, row) becomes ready in the given order (the first
        is the least recent). ``held`` (row -> until, on the caller's clock): rows
        the previous daemon's clients may still touch (docs/design/journal.md). An
        adopted block in it holds one pin until then (HIT and loadable, never
        evicted: a copier of an old session may still be loading from it, and its
        pin died with that daemon); any other row in it is kept out of use
        (quarantined) until then. Every other adopted block is evictable at once,
        every other row free, lowest first. Both are released by
        ``release_quarantine``. Emits no event. Raises ValueError (nothing changed)
        on a duplicate key or row, a row out of range, or a manager already in use."""
        if self._allocated or self._block_of:
            raise ValueError("adopt() needs a manager that has handed out no row")
        rows = [row for _, row in blocks]
        taken = set(rows) | set(held)
        if len(set(rows)) != len(rows) or len({key for key, _ in blocks}) != len(blocks):
            raise ValueError("adopt(): a row or key named twice")
        if any(not 0 <= row < self._num_blocks for row in taken):
            raise ValueError("adopt(): a row outside the region")
        for key, row in blocks:
            self._block_of[key] = row
            self._key_of[row] = key
        pinned = [row for row in rows if row in held]
        if rows:
            self._policy.insert_rows(rows)  # non-evictable until marked below
        for row in pinned:
            self._refs[row] = 1
        self._pinned = len(pinned)
        evictable = [row for row in rows if row not in held]
        if evictable:
            self._policy.mark_evictable_rows(evictable)  # in journal order: oldest first
        self._evictable = len(evictable)
        self._adoption_pins.add_each(pinned, held)
        self._quarantine.add_each([row for row in held if self._key_of[row] is None], held)
        self._allocated = self._num_blocks  # every row is mapped, free or quarantined
        self._free = [row for row in range(self._num_blocks - 1, -1, -1) if row not in taken]

    # ----------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pins every key (ref += 1 per occurrence) and returns their rows, co-indexed
        with ``keys``.

        Raises :class:`NotLoadableError` for the first key that is not HIT, before
        changing anything. A key named twice is pinned twice.
        """
        rows = self._loadable_rows(keys)
        refs = self._refs
        first_pins: list[int] = []
        for row in rows:
            ref = refs[row]
            if ref == 0:
                first_pins.append(row)
            refs[row] = ref + 1
        if first_pins:
            # Invariant: ref 0 -> 1 leaves the evictable set.
            self._policy.mark_non_evictable_rows(first_pins)
            self._evictable -= len(first_pins)
            self._pinned += len(first_pins)
        assert self._evictable >= 0
        return rows

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Releases one pin per occurrence of each key (ref -= 1).

        Raises :class:`NotPinnedError` before changing anything if a key is absent
        or holds fewer pins than the call releases. A block whose last pin goes
        becomes evictable again (LRU: at the most recent end).
        """
        self._unpin_rows(self._pinned_rows(keys))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Marks ``keys`` recently used (the first key ends the most recent).

        Absent, pinned and in-flight keys change no LRU order; see the policy.
        """
        self._policy.touch(keys)

    # ----------------------------------------------------------------- stores

    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreGrant | None:
        """Reserves a row (ref -1) for each key not present, evicting ready blocks if
        the free rows do not suffice.

        Keys already present (any ref count) are skipped and never evicted by this
        call; a key named twice is reserved once. No new key -> an empty grant.
        Returns None (nothing changed) if the room cannot be made. Otherwise the
        victims leave first and one removal event for all of them is emitted
        before the new rows are reserved; the grant lists the new keys, their rows
        (co-indexed) and the evicted keys in eviction order.
        """
        new_keys = self._absent(keys)
        if not new_keys:
            return StoreGrant([], [], [])
        return self._make_room_and_reserve(new_keys, set(keys))

    def prepare_promotion(self, keys: Sequence[BlockKey], protected: set[BlockKey]) -> StoreGrant:
        """Reserves rows (ref -1) for as many absent ``keys`` as room can be made
        for, in order, without evicting any key in ``protected``.

        The rows of a promotion: a secondary tier fills them, then the caller
        ends the writes with :meth:`complete_store`. Unlike :meth:`prepare_store`
        this is not all or nothing: the grant lists the keys that got a row (a
        prefix of the absent keys); the others get none and nothing else changes.
        """
        new_keys = self._absent(keys)
        refs = self._refs
        rows = (self._block_of.get(key) for key in protected)
        evictable = self._evictable - sum(1 for row in rows if row is not None and refs[row] == 0)
        fit = min(len(new_keys), self._free_count() + max(0, evictable))
        grant = self._make_room_and_reserve(new_keys[:fit], protected) if fit else None
        if grant is None and fit:  # the policy found fewer victims than counted
            fit = min(fit, self._free_count())
            grant = self._make_room_and_reserve(new_keys[:fit], protected) if fit else None
        return grant if grant is not None else StoreGrant([], [], [])

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> list[BlockKey]:
        """Ends the writes of ``keys`` whose ref is -1; other keys are ignored.

        success: each such block becomes ready (ref 0, evictable, LRU: most recent)
        and one stored event lists them all. Failure: each such block is dropped
        and its row freed, with no event (it was never announced). Returns the keys
        completed (or aborted), in call order.
        """
        if success:
            done = self._finish_writes(keys)
            if done:
                self._emit(BlockEvent(tuple(done), Medium.CPU, removed=False))
        else:
            done = self._abort_writes(keys)
        return done

    def abort_and_quarantine(self, keys: Sequence[BlockKey], until: float) -> list[BlockKey]:
        """Aborts the writes of ``keys`` whose ref is -1 (as ``complete_store(success=
        False)``), but their rows are not free again before ``release_quarantine(now)``
        is called with ``now >= until``.

        For writes whose writer's session ended without completing them: that
        writer may still be copying into the rows (a stopped process resumed, a
        copy in flight when its lease ran out), so handing a row to another key at
        once could let the stale copy overwrite the new key's bytes. ``until`` is
        on the caller's clock; the queue is kept in ``until`` order (the fence of
        an adopted region, :meth:`adopt`, may end after the aborts that follow it).
        """
        done, rows = self._unmap_writes(keys)
        if rows:
            self._quarantine.add(until, rows)
        return done

    def release_quarantine(self, now: float) -> int:
        """Frees the quarantined rows whose time has come (``until <= now``), in the
        order they were quarantined; returns how many. Also releases the adopted
        blocks' pins (:meth:`adopt`) whose time has come."""
        if self._adoption_pins:
            self._unpin_rows(self._adoption_pins.pop_due(now))  # oldest first
        released = self._quarantine.pop_due(now)
        self._free.extend(released)
        return len(released)

    def evict_all_evictable(self) -> list[BlockKey]:
        """Evicts every ready block (ref 0); pinned and in-flight blocks stay.

        The safe flush (vLLM's reset would drop blocks others still use). The
        policy forgets the keys as for a removal (ARC: no ghosts, target kept).
        Emits one removal event if anything left; returns the keys in row order.
        """
        if not self._evictable:
            return []
        refs = self._refs
        key_of = self._key_of
        rows = [row for row in range(self._allocated) if refs[row] == 0 and key_of[row] is not None]
        victims: list[BlockKey] = [key_of[row] for row in rows]  # type: ignore[misc]
        assert len(victims) == self._evictable
        self._policy.remove_rows(rows)
        self._drop_evicted(victims)
        if self.on_rows_reserved is not None:
            self.on_rows_reserved(rows)  # journal: a flushed block must not come back
        self._emit(BlockEvent(tuple(victims), Medium.CPU, removed=True))
        return victims

    # ----------------------------------------------------------------- internals

    def _make_room_and_reserve(
        self, new_keys: list[BlockKey], protected: set[BlockKey]
    ) -> StoreGrant | None:
        """Evicts what ``new_keys`` need beyond the free rows (never a protected
        key), emits one removal event, reserves the rows. None: nothing changed."""
        need = len(new_keys) - self._free_count()
        victims: list[BlockKey] = []
        if need > 0:
            if need > self._evictable:
                return None  # fast refusal: the policy is not even asked
            chosen = self._policy.evict(need, protected)
            if chosen is None:
                return None
            assert len(chosen) == need
            victims = chosen
            self._drop_evicted(victims)
            self._emit(BlockEvent(tuple(victims), Medium.CPU, removed=True))
        rows = self._reserve_rows(new_keys)
        return StoreGrant(new_keys, rows, victims)

    def _emit(self, event: BlockEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
