"""Least-recently-used eviction (docs/design/semantics.md, "LRU"; vLLM's ``LRUCachePolicy``).

Only ready blocks (ref count ``0``) are ordered; pinned and in-flight blocks
are outside the order and re-enter it at the MRU end when they become ready
again. A "use" is: a completed store, the last completed load, or a touch.

Representation: an intrusive, circular, doubly-linked list threaded through
two ``array('i')`` (``_prev`` / ``_next``) indexed by the manager's row number,
with one sentinel slot at index ``capacity`` (``_next[S]`` is the LRU end,
``_prev[S]`` the MRU end) and one never-linked dummy slot at ``capacity + 1``
(the row :meth:`LRUPolicy.touch` looks up for an absent key).
``_next[row] == -1`` marks a row outside the list.
The order costs 8 bytes per row and no hash table; keys are reached through
the manager's ``row_of`` / ``key_of``.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Sequence
from itertools import compress, count, islice, repeat
from operator import itemgetter, ne

from kvtierd.contract import BlockKey
from kvtierd.primary.policies.base import CachePolicy, KeyOf, RefCount, RowOf

_OUT = -1  # _next[row] of a row that is not in the list


class LRUPolicy(CachePolicy):
    """LRU over the evictable keys.

    Invariant: a row is in the list iff it is mapped and its ref count is ``0``;
    the list runs least recently used first from ``_next[S]`` to ``_prev[S]``;
    ``_len`` is its length. Rows that are free, pinned (ref ``> 0``) or in flight
    (ref ``-1``) have ``_next[row] == -1`` (their ``_prev`` is stale, never read).
    """

    def __init__(self, capacity: int, ref_count: RefCount, row_of: RowOf, key_of: KeyOf) -> None:
        super().__init__(capacity, ref_count, row_of, key_of)
        self._sentinel = capacity
        self._dummy = capacity + 1  # _next[_dummy] stays _OUT
        self.clear()

    # ----------------------------------------------------------------- per key

    def insert(self, key: BlockKey) -> None:
        # A new block is a write in flight (ref -1): not evictable yet.
        return

    def remove(self, key: BlockKey) -> None:
        row = self._row_of(key)
        if row is not None and self._next[row] != _OUT:
            self._unlink(row)

    def mark_evictable(self, key: BlockKey) -> None:
        # Precondition (manager): the row is not in the list; a second call would
        # corrupt it. Checked by PrimaryManager.check_invariants, not per call.
        self.mark_evictable_rows((self._row_of(key),))  # type: ignore[arg-type]

    def mark_non_evictable(self, key: BlockKey) -> None:
        self._unlink(self._row_of(key))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- per call

    def insert_rows(self, rows: Sequence[int]) -> None:
        return

    def remove_rows(self, rows: Iterable[int]) -> None:
        nxt = self._next
        for row in rows:
            if nxt[row] != _OUT:
                self._unlink(row)

    def mark_evictable_rows(self, rows: Iterable[int]) -> None:
        """Appends ``rows`` (not in the list) at the MRU end, in order."""
        nxt = self._next
        prv = self._prev
        s = self._sentinel
        tail = prv[s]
        count = 0
        for row in rows:
            nxt[tail] = row
            prv[row] = tail
            tail = row
            count += 1
        nxt[tail] = s
        prv[s] = tail
        self._len += count

    def mark_non_evictable_rows(self, rows: Iterable[int]) -> None:
        """Unlinks ``rows`` (all in the list, each once)."""
        nxt = self._next
        prv = self._prev
        count = 0
        for row in rows:
            p = prv[row]
            n = nxt[row]
            nxt[p] = n
            prv[n] = p
            nxt[row] = _OUT
            count += 1
        self._len -= count

    def _move_chain(self, first: int, last: int, anchor: int) -> None:
        """Unlinks the linked run ``first`` (LRU end) .. ``last`` (MRU end) and
        relinks it just before ``anchor``. Order inside the run is kept."""
        nxt, prv = self._next, self._prev
        p, n = prv[first], nxt[last]
        nxt[p] = n
        prv[n] = p
        t = prv[anchor]
        nxt[t] = first
        prv[first] = t
        nxt[last] = anchor
        prv[anchor] = last

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Moves the evictable rows of ``keys`` to the MRU end, as if each key were
        moved there in reverse call order (the first key ends the most recent;
        prefix heads are worth more than their tails).

        Equivalently: the touched evictable rows, deduplicated keeping the first
        occurrence, become the MRU suffix of the list in reverse call order. Work
        per key is kept low: the lookups and link reads run in C; rows already in
        the wanted order (a prefix touched before) move as whole blocks; rows that
        follow each other in call order (a batch stored together) leave the list
        as one run; only scattered rows cost a Python loop step each.
        """
        if not keys:
            return
        nxt = self._next
        s = self._sentinel
        rows = list(map(self._row_of, keys, repeat(self._dummy)))
        nexts = list(itemgetter(*rows)(nxt)) if len(rows) > 1 else [nxt[rows[0]]]
        # Already in place: key 0 is the MRU row and each key precedes the one
        # before it (a chain implies all evictable and no duplicates).
        if nexts[0] == s and nexts[1:] == rows[:-1]:
            return
        if _OUT in nexts:  # absent, pinned or in-flight keys: they do not move
            flags = list(map(ne, nexts, repeat(_OUT)))
            rows = list(compress(rows, flags))
            nexts = list(compress(nexts, flags))
            if not rows:
                return
        prv = self._prev
        m = len(rows)
        if nexts[1:] == rows[:-1]:
            # One block already in the wanted order (a prefix touched before, now
            # behind newer rows): move it whole to the MRU end.
            self._move_chain(rows[-1], rows[0], s)
            return
        if nexts[:-1] == rows[1:]:
            # One run in call order (a batch stored together, untouched since):
            # unlink it by its ends, relink it reversed.
            p = prv[rows[0]]
            n = nxt[rows[-1]]
            nxt[p] = n
            prv[n] = p
            self._link_before(s, reversed(rows))
            return
        if len(set(rows)) != m:
            self._touch_with_duplicates(rows)
            return
        # Blocks: maximal runs of the call whose rows already lie in the list in
        # the wanted (reverse call) order, e.g. a prefix touched before. A block
        # moves as a whole: its inner links stay.
        block_starts = [0, *compress(count(1), map(ne, islice(nexts, 1, None), rows))]
        if 2 * len(block_starts) <= m:
            self._touch_blocks(rows, block_starts)
            return
        self._touch_runs(rows, nexts)

    def _touch_with_duplicates(self, rows: list[int]) -> None:
        """``touch`` of rows some of which repeat: unlink row by row, first occurrence
        only (an unlinked row reads _OUT), then relink the moved rows at the MRU end,
        last key first."""
        nxt, prv = self._next, self._prev
        moved: list[int] = []
        keep = moved.append
        for row in rows:
            n = nxt[row]
            if n == _OUT:
                continue
            p = prv[row]
            nxt[p] = n
            prv[n] = p
            nxt[row] = _OUT
            keep(row)
        self._link_before(self._sentinel, reversed(moved))

    def _touch_blocks(self, rows: list[int], block_starts: list[int]) -> None:
        """``touch`` where ``rows`` fall into few blocks already in the wanted order
        (``block_starts``: where each begins): each block moves whole."""
        anchor = self._sentinel
        block_ends = [*block_starts[1:], len(rows)]
        for a, b in zip(block_starts, block_ends, strict=True):
            first = rows[b - 1]  # the block's LRU row; rows[a] is its MRU row
            self._move_chain(first, rows[a], anchor)
            anchor = first

    def _touch_runs(self, rows: list[int], nexts: list[int]) -> None:
        """``touch`` of scattered rows: unlink runs of rows that follow each other in
        the list in call order (e.g. a batch stored together and not touched since)
        by their ends (``nexts``, each row's successor, is still valid inside a run),
        then relink row by row."""
        nxt, prv = self._next, self._prev
        start = 0
        for end in compress(count(), map(ne, nexts, islice(rows, 1, None))):
            p = prv[rows[start]]
            n = nxt[rows[end]]
            nxt[p] = n
            prv[n] = p
            start = end + 1
        if start < len(rows):
            p = prv[rows[start]]
            n = nxt[rows[-1]]
            nxt[p] = n
            prv[n] = p
        self._link_before(self._sentinel, reversed(rows))

    def evict(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        assert n >= 0
        if n == 0:
            return []
        if n > self._len:
            return None
        nxt = self._next
        key_of = self._key_of
        s = self._sentinel
        victims: list[BlockKey] = []
        append = victims.append
        row = nxt[s]
        rows: list[int] = []
        take = rows.append
        skipped = False
        while row != s:
            key = key_of(row)
            if key in protected:
                skipped = True
            else:
                take(row)
                append(key)  # type: ignore[arg-type]
                if len(rows) == n:
                    break
            row = nxt[row]
        else:
            return None
        if skipped:
            self.mark_non_evictable_rows(rows)
            return victims
        # The n least recent rows: cut the prefix off in one splice.
        row = nxt[row]
        for victim in rows:
            nxt[victim] = _OUT
        nxt[s] = row
        self._prev[row] = s
        self._len -= n
        return victims

    def clear(self) -> None:
        s = self._sentinel
        self._next = array("i", [_OUT]) * (s + 2)
        self._prev = array("i", [_OUT]) * (s + 2)
        self._next[s] = self._prev[s] = s
        self._len = 0

    # ----------------------------------------------------------------- helpers

    def _link_before(self, anchor: int, rows: Iterable[int]) -> None:
        """Links ``rows`` (outside the list), in order, just before ``anchor``."""
        nxt = self._next
        prv = self._prev
        tail = prv[anchor]
        for row in rows:
            nxt[tail] = row
            prv[row] = tail
            tail = row
        nxt[tail] = anchor
        prv[anchor] = tail

    def _unlink(self, row: int) -> None:
        nxt = self._next
        prv = self._prev
        p = prv[row]
        n = nxt[row]
        nxt[p] = n
        prv[n] = p
        nxt[row] = _OUT
        self._len -= 1

    # ----------------------------------------------------------------- read-only

    def evictable_rows(self) -> list[int]:
        """The rows in the list, least recently used first (a copy; for tests)."""
        nxt = self._next
        s = self._sentinel
        out: list[int] = []
        row = nxt[s]
        while row != s:
            out.append(row)
            row = nxt[row]
            assert len(out) <= self._len, "cycle in the LRU list"
        return out

    def evictable_order(self) -> list[BlockKey]:
        """The evictable keys, least recently used first (a copy; for tests)."""
        key_of = self._key_of
        return [key_of(row) for row in self.evictable_rows()]  # type: ignore[misc]

    def is_evictable_row(self, row: int) -> bool:
        """Whether ``row`` is in the list (for invariant checks)."""
        return self._next[row] != _OUT

    def __len__(self) -> int:
        """Number of evictable keys."""
        return self._len

    def check_invariants(self, resident: Collection[BlockKey], evictable: int) -> None:
        """The list holds exactly the ``evictable`` resident rows whose ref is 0, and
        every row's link says whether it is in the list."""
        order = self.evictable_rows()
        assert len(order) == len(self) == evictable
        keys = [self._key_of(row) for row in order]
        assert all(key is not None and self._ref_count(key) == 0 for key in keys)
        in_list = set(order)
        for row in range(self._capacity):
            assert self.is_evictable_row(row) == (row in in_list), "LRU link out of sync"
