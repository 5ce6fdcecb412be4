"""The primary tier's block table: which key is in which row, and each row's state.

Owns the representation of one pool's block table and the invariants that tie
its parts together; :class:`~kvtierd.primary.manager.PrimaryManager` builds the
protocol on it (who may change a ref count and when, making room, events,
fences: docs/design/semantics.md, "The primary tier"). Everything here is a
query or a primitive row transition: each primitive keeps every invariant of
:class:`BlockTable` (counters, free list, policy, journal hooks) but checks no
input; the manager checks before it calls one.

Every row is in exactly one state: never used (at or above the high-water mark
``_allocated``), free (on ``_free``), quarantined (``_quarantine``: kept from
writers until a time), or holding one key's block with a ref count: ``-1``
write in flight, ``0`` ready (evictable), ``n > 0`` pinned n times
(docs/design/invariants.md, "The block table").

Slots are handed out as vLLM does: never-used rows first in ascending order (a
high-water mark), then freed rows last-freed-first (freed rows are appended in
eviction / abort order and popped from the end).

Memory: no Python object per block beyond the key (shared with the caller, not
copied) and its row number in ``_block_of`` (an int object for rows >= 257);
ref counts live in an ``array('i')`` indexed by row. The LRU policy threads its
order through two more ``array('i')`` indexed by row (8 bytes per block, no
hash table); ARC keeps its own ordered dicts of keys.

The policy reads the block table through ``row_of`` (``_block_of.get``) and
``key_of`` (``_key_of.__getitem__``), and the table drives it per call through
the ``*_rows`` hooks (one call per manager call, not per key).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.contract import DEFAULT_EVICTION_POLICY, BlockKey, LookupResult
from kvtierd.primary.errors import NotLoadableError, NotPinnedError
from kvtierd.primary.fences import TimedRows
from kvtierd.primary.policies import CachePolicy, make_policy

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING

_PENDING = -1  # ref count of a row whose write is in flight


@dataclass(frozen=True, slots=True)
class PrimaryStats:
    """A snapshot of the primary tier.

    ``used_blocks == evictable_blocks + pinned_blocks + pending_blocks`` and
    ``used_blocks + free_blocks + quarantined_blocks == num_blocks``.
    ``evictions``, ``stored_blocks`` and ``failed_stores`` are cumulative.
    """

    num_blocks: int
    used_blocks: int  # rows holding a key (any ref count)
    evictable_blocks: int  # ref 0
    pinned_blocks: int  # ref > 0
    pending_blocks: int  # ref -1
    free_blocks: int
    evictions: int  # blocks evicted (to make room, or flushed)
    stored_blocks: int  # stores completed
    failed_stores: int  # reserved blocks aborted
    quarantined_blocks: int = 0  # rows of aborted writes not yet reusable (see quarantine)


class BlockTable:
    """The block table of one pool's primary tier (the manager's base).

    Invariants (checked in full by :meth:`check_invariants`):

    * ``_block_of[key] == row`` <=> ``_key_of[row] is key``, for rows below the
      high-water mark ``_allocated`` that are not on the free list;
    * every row below ``_allocated`` is either mapped or on ``_free`` (exactly
      once); rows at or above ``_allocated`` were never used;
    * ``_evictable`` / ``_pinned`` / ``_pending`` count the mapped rows whose ref is
      ``0`` / ``> 0`` / ``-1``, and their sum is ``len(_block_of)``;
    * the policy holds exactly the mapped keys; LRU: a row is in its list iff it
      is mapped and its ref count is ``0``;
    * a quarantined row is neither mapped nor free; a row in ``_adoption_pins``
      is mapped and holds at least the one pin its adoption gave it.
    """

    def __init__(self, num_blocks: int, policy: str = DEFAULT_EVICTION_POLICY) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        # Never rebound: the policy holds views of both (row_of / key_of).
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._policy = make_policy(
            policy, num_blocks, self._ref_of, self._block_of.get, self._key_of.__getitem__
        )
        self._policy_name = policy
        self._refs = array("i", [0]) * num_blocks
        self._allocated = 0  # high-water mark: rows [0, _allocated) were handed out once
        self._free: list[int] = []  # freed rows; the last one is reused first
        # Rows of writes aborted because their writer's session ended (lease
        # expired, closed): a writer that lost its lease may still be copying into
        # them, so they are neither mapped nor free until ``release_quarantine``
        # passes their time.
        self._quarantine = TimedRows()
        # Warm restart: adopted blocks the previous daemon's clients may still be
        # loading from hold one pin each, released by ``release_quarantine`` at
        # their time (:meth:`~kvtierd.primary.manager.PrimaryManager.adopt`).
        self._adoption_pins = TimedRows()
        self._evictable = 0
        self._pinned = 0
        self._pending = 0
        self._evictions = 0
        self._stored = 0
        self._failed = 0
        # Warm restart journal hooks (kvtierd.primary.warm.journal): rows whose journaled block
        # is void from now on (about to be handed to a writer, or flushed), called
        # before the call returns; rows whose write completed.
        self.on_rows_reserved: Callable[[list[int]], object] | None = None
        self.on_rows_ready: Callable[[list[BlockKey], list[int]], object] | None = None

    # ----------------------------------------------------------------- read-only

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def policy(self) -> CachePolicy:
        """The eviction policy (read it; never call its mutators directly)."""
        return self._policy

    @property
    def policy_name(self) -> str:
        return self._policy_name

    def __len__(self) -> int:
        """Number of keys present (any ref count)."""
        return len(self._block_of)

    def __contains__(self, key: object) -> bool:
        return key in self._block_of

    def ref_count(self, key: BlockKey) -> int | None:
        """Ref count of ``key`` (-1 in flight, 0 ready, n pinned), None if absent."""
        row = self._block_of.get(key)
        return None if row is None else self._refs[row]

    def block_id(self, key: BlockKey) -> int | None:
        """Row of ``key`` in the region, None if absent."""
        return self._block_of.get(key)

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        """MISS / HIT_PENDING (write in flight) / HIT per key; changes no recency."""
        get = self._block_of.get
        refs = self._refs
        out: list[LookupResult] = []
        append = out.append
        for key in keys:
            row = get(key)
            if row is None:
                append(_MISS)
            elif refs[row] < 0:
                append(_HIT_PENDING)
            else:
                append(_HIT)
        return out

    def statistics(self) -> PrimaryStats:
        used = len(self._block_of)
        return PrimaryStats(
            num_blocks=self._num_blocks,
            used_blocks=used,
            evictable_blocks=self._evictable,
            pinned_blocks=self._pinned,
            pending_blocks=self._pending,
            free_blocks=self._num_blocks - used - self._quarantine.count,
            quarantined_blocks=self._quarantine.count,
            evictions=self._evictions,
            stored_blocks=self._stored,
            failed_stores=self._failed,
        )

    @property
    def next_quarantine_release(self) -> float | None:
        """The earliest ``until`` still quarantined, None when nothing is."""
        return self._quarantine.next_until

    def held_rows(self) -> dict[int, float]:
        """row -> until (the caller's clock) of every row kept from writers for a
        client that may still touch it: the quarantined rows and the adopted
        blocks still pinned for the previous daemon's clients (what a graceful
        stop journals, docs/design/journal.md)."""
        held = self._quarantine.until_of_rows()
        for row, until in self._adoption_pins.until_of_rows().items():
            held[row] = max(until, held.get(row, until))
        return held

    @property
    def adoption_pins(self) -> int:
        """Adopted blocks still pinned for the previous daemon's clients."""
        return self._adoption_pins.count

    # ----------------------------------------------------------------- transitions
    # (primitives: no input checks; each keeps every invariant above)

    def _absent(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Keys not in the table, in order, each once."""
        block_of = self._block_of
        new_keys = [key for key in keys if key not in block_of]
        if len(set(new_keys)) != len(new_keys):
            new_keys = list(dict.fromkeys(new_keys))
        return new_keys

    def _ref_of(self, key: BlockKey) -> int:
        """The policy's view of a resident key's ref count."""
        return self._refs[self._block_of[key]]

    def _free_count(self) -> int:
        return self._num_blocks - self._allocated + len(self._free)

    def _loadable_rows(self, keys: Sequence[BlockKey]) -> list[int]:
        """Rows of ``keys``; raises NotLoadableError unless every key is HIT."""
        get = self._block_of.get
        refs = self._refs
        rows: list[int] = []
        for key in keys:
            row = get(key)
            if row is None:
                raise NotLoadableError(key, _MISS)
            if refs[row] < 0:
                raise NotLoadableError(key, _HIT_PENDING)
            rows.append(row)
        return rows

    def _pinned_rows(self, keys: Sequence[BlockKey]) -> list[int]:
        """Rows of ``keys``; raises NotPinnedError unless each key holds at least as
        many pins as it occurs in ``keys``."""
        get = self._block_of.get
        refs = self._refs
        rows: list[int] = []
        for key in keys:
            row = get(key)
            if row is None or refs[row] <= 0:
                raise NotPinnedError(key)
            rows.append(row)
        if len(set(rows)) != len(rows):
            for key, count in Counter(keys).items():
                if refs[get(key)] < count:  # type: ignore[index]  # rows checked above
                    raise NotPinnedError(key)
        return rows

    def _unpin_rows(self, rows: list[int]) -> None:
        """Releases one pin per row (each holds one more); a block whose last pin
        goes becomes evictable (LRU: at the most recent end, in call order)."""
        refs = self._refs
        released: list[int] = []
        for row in rows:
            ref = refs[row] - 1
            assert ref >= 0
            refs[row] = ref
            if ref == 0:
                released.append(row)
        if released:
            # Invariant: ref 1 -> 0 enters the evictable set (in call order).
            self._pinned -= len(released)
            self._evictable += len(released)
            self._policy.mark_evictable_rows(released)

    def _drop_evicted(self, victims: list[BlockKey]) -> None:
        """Unmaps ready victims (already gone from the policy) and frees their rows
        in victim order."""
        block_of = self._block_of
        key_of = self._key_of
        free = self._free
        for key in victims:
            row = block_of.pop(key)
            assert self._refs[row] == 0, "evicted a block that is not ready"
            key_of[row] = None
            free.append(row)
        self._evictable -= len(victims)
        self._evictions += len(victims)
        assert self._evictable >= 0

    def _reserve_rows(self, new_keys: list[BlockKey]) -> list[int]:
        """Maps each new key to a row with ref -1 and tells the policy."""
        n = len(new_keys)
        fresh = min(n, self._num_blocks - self._allocated)
        rows = list(range(self._allocated, self._allocated + fresh))
        self._allocated += fresh
        reused = n - fresh
        if reused:
            free = self._free
            assert len(free) >= reused
            rows.extend(reversed(free[-reused:]))  # same order as n pops from the end
            del free[-reused:]
        block_of = self._block_of
        key_of = self._key_of
        refs = self._refs
        for key, row in zip(new_keys, rows, strict=True):
            block_of[key] = row
            key_of[row] = key
            refs[row] = _PENDING
        self._policy.insert_rows(rows)
        self._pending += n
        if self.on_rows_reserved is not None:
            self.on_rows_reserved(rows)  # journal: freed(row) before the row is handed out
        return rows

    def _finish_writes(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Makes the in-flight writes among ``keys`` ready. The keys it returns (and
        hands to the journal, the events and the tiers) are the table's own objects,
        not the caller's equal ones: whatever keeps them shares the table's copy
        instead of keeping a second one alive (304 heap bytes a 256-byte key)."""
        get = self._block_of.get
        key_of = self._key_of
        refs = self._refs
        done: list[BlockKey] = []
        rows: list[int] = []
        for key in keys:
            row = get(key)
            if row is not None and refs[row] == _PENDING:
                refs[row] = 0
                rows.append(row)
                done.append(key_of[row])  # type: ignore[arg-type]  # mapped: not None
        if rows:
            # Invariant: ref -1 -> 0 enters the evictable set (in call order).
            self._policy.mark_evictable_rows(rows)
            if self.on_rows_ready is not None:
                self.on_rows_ready(done, rows)  # journal: checksum, then ready(key, row)
        self._pending -= len(done)
        self._evictable += len(done)
        self._stored += len(done)
        return done

    def _abort_writes(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        done, rows = self._unmap_writes(keys)
        self._free.extend(rows)
        return done

    def _unmap_writes(self, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[int]]:
        """Drops the in-flight writes among ``keys``; returns them and their rows,
        which the caller puts on the free list or into quarantine."""
        block_of = self._block_of
        key_of = self._key_of
        refs = self._refs
        remove = self._policy.remove
        done: list[BlockKey] = []
        rows: list[int] = []
        for key in keys:
            row = block_of.get(key)
            if row is not None and refs[row] == _PENDING:
                remove(key)
                del block_of[key]
                key_of[row] = None
                refs[row] = 0
                rows.append(row)
                done.append(key)
        self._pending -= len(done)
        self._failed += len(done)
        return done, rows

    # ----------------------------------------------------------------- debugging

    def check_invariants(self) -> None:
        """Verifies every invariant of the table (O(num_blocks); tests, debugging)."""
        refs = self._refs
        free = set(self._free)
        assert len(free) == len(self._free), "a row is on the free list twice"
        assert all(row < self._allocated for row in free), "never-used row on the free list"
        held = self._quarantine.rows()
        assert not free.intersection(held), "a quarantined row is on the free list"
        self._quarantine.check_invariants()
        self._adoption_pins.check_invariants()
        pins = self._adoption_pins.rows()
        assert all(self._key_of[row] is not None and refs[row] > 0 for row in pins)
        assert len(self._block_of) + len(free) + len(held) == self._allocated
        counts = {0: 0, 1: 0, -1: 0}
        for key, row in self._block_of.items():
            assert row not in free, "mapped row on the free list"
            assert self._key_of[row] is key, "block table out of sync"
            ref = refs[row]
            assert ref >= -1
            counts[min(ref, 1)] += 1
        for row in (*free, *held):
            assert self._key_of[row] is None
        for row in range(self._allocated, self._num_blocks):
            assert self._key_of[row] is None
        assert counts[0] == self._evictable
        assert counts[1] == self._pinned
        assert counts[-1] == self._pending
        self._policy.check_invariants(self._block_of, self._evictable)
