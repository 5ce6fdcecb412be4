"""What each session holds in one pool: one record of its pins and reservations.

* a *pin* (ref count +1) taken for a session by PrepareLoad or a pinning Lookup
  is released only by that session's CompleteLoad, or by the pool when the
  session ends (closed, lease expired);
* a *reservation* (ref count -1) made for a session by PrepareStore is completed
  or aborted only by that session's CompleteStore, or aborted by the pool when
  the session ends.

This module is bookkeeping only: it never changes a ref count. The pool changes
the primary's ref counts and the claims in the same call, after validating both
(:class:`kvtierd.core.pool.Pool`), and checks them against each other in
:meth:`kvtierd.core.pool.Pool.check_invariants`.

Invariants (of the records; the pool adds the ref-count ones):

* every count in ``SessionClaims.pins`` is >= 1 (a key whose last pin goes
  leaves the Counter);
* no key is in the ``reserved`` set of two sessions (a reservation is made for
  a key absent from the primary, so no other session can hold one for it).

Event-loop only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtierd.contract import BlockKey


@dataclass(slots=True, eq=False)
class SessionClaims:
    """The pins and reservations one session holds in one pool."""

    # key -> pins this session holds on it (>= 1 each)
    pins: Counter[BlockKey] = field(default_factory=Counter)
    # keys this session reserved and has not completed (each ref -1 in the primary)
    reserved: set[BlockKey] = field(default_factory=set)

    def first_unpinned(self, keys: Sequence[BlockKey]) -> BlockKey | None:
        """The first key of ``keys`` this session holds fewer pins on than ``keys``
        names it; None when it holds every pin ``keys`` would release."""
        pins = self.pins
        for key, count in Counter(keys).items():
            if pins[key] < count:
                return key
        return None

    def pin(self, keys: Sequence[BlockKey]) -> None:
        """Records one more pin per occurrence of each key (pin n -> n+1)."""
        self.pins.update(keys)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Forgets one pin per occurrence; the caller checked :meth:`first_unpinned`."""
        pins = self.pins
        for key in keys:
            left = pins[key] - 1  # pin n -> n-1
            assert left >= 0, f"released a pin on {key!r} this session does not hold"
            if left:
                pins[key] = left
            else:
                pins.pop(key)  # dict's C pop: Counter's __delitem__ is Python (hot path)

    def reserve(self, keys: Sequence[BlockKey]) -> None:
        """Records the reservations the primary just granted (ref -1 each)."""
        self.reserved.update(keys)

    def take_reserved(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Forgets and returns the keys of ``keys`` this session reserved (in call
        order); keys reserved by another session, or by nobody, are left alone."""
        reserved = self.reserved
        mine = [key for key in keys if key in reserved]
        reserved.difference_update(mine)
        return mine

    def pin_list(self) -> list[BlockKey]:
        """Every pin as one key occurrence (a key pinned twice appears twice)."""
        return list(self.pins.elements())


class ClaimTable:
    """The claims of every session attached to one pool (owned by the pool)."""

    def __init__(self) -> None:
        # Invariant: a session is in here from Pool.attach to Pool.release_session.
        self._of: dict[str, SessionClaims] = {}

    def __len__(self) -> int:
        return len(self._of)

    def __iter__(self) -> Iterator[tuple[str, SessionClaims]]:
        return iter(self._of.items())

    def attach(self, session_id: str) -> SessionClaims:
        assert session_id not in self._of, f"session {session_id} attached twice"
        claims = self._of[session_id] = SessionClaims()
        return claims

    def of(self, session_id: str) -> SessionClaims:
        """The claims of an attached session (a session the table does not know is
        a bug of the caller: the session table resolves ids first)."""
        return self._of[session_id]

    def detach(self, session_id: str) -> SessionClaims:
        """Removes the session and returns what it still held (empty if unknown)."""
        return self._of.pop(session_id, None) or SessionClaims()

    def pins(self) -> Counter[BlockKey]:
        """key -> pins every session together holds on it."""
        total: Counter[BlockKey] = Counter()
        for claims in self._of.values():
            total.update(claims.pins)
        return total

    def reservations(self) -> list[BlockKey]:
        """Every session's reserved keys (a key twice if two sessions reserved it,
        which the invariants forbid)."""
        return [key for claims in self._of.values() for key in claims.reserved]
