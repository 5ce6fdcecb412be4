"""The manager's step-local cache of lookup answers and the lookup pins behind them.

vLLM calls ``lookup`` key by key in prefix order; the manager asks the daemon
about the key *and* the request's following keys in one ``Lookup`` (a prefix
chain, which pins the leading HITs), and keeps the answers here for the rest of
the scheduler step. A HIT is only ever answered for a key whose pin is held
here, until ``prepare_load`` claims it in the same step or the step ends (the
manager then releases it unused).

Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import LookupResult

__all__ = ["LOOKUP_BATCH", "StepCache"]

LOOKUP_BATCH = 256
"""At most this many keys per Lookup RPC (the asked key and the request's next keys)."""


class StepCache:
    """Answers and unclaimed lookup pins of the current scheduler step.

    Invariants: every key in ``_pins`` (count > 0) has its row in ``_rows``; a key
    answered HIT is a key that was pinned in this step. ``clear`` (step end, new
    generation) empties everything; the pins it drops are the caller's to release.
    """

    def __init__(self) -> None:
        self._results: dict[bytes, LookupResult] = {}
        self._pins: Counter[bytes] = Counter()  # lookup pins not yet claimed
        self._rows: dict[bytes, int] = {}  # row of every key in _pins

    def get(self, key: bytes) -> LookupResult | None:
        """This step's answer for ``key`` (None: not asked yet, or dropped)."""
        return self._results.get(key)

    def record(
        self, keys: Sequence[bytes], results: Sequence[LookupResult], rows: Sequence[int]
    ) -> LookupResult:
        """Keeps one prefix ``Lookup``'s answers; returns the first key's answer.

        The daemon pinned the leading run of HITs (-1 from the first key that is not
        HIT on). vLLM's prefix scan stops at the first MISS and defers on HIT_PENDING
        / RETRY; a HIT after those is not pinned, hence neither answered HIT nor
        cached (a later lookup of it pins it then). Keys after the first key that is
        neither HIT nor HIT_PENDING answer MISS (the daemon looked no further): they
        are cached too, so the scan stops there instead of asking from that key on.
        """
        first: LookupResult | None = None
        for i, (key, result, row) in enumerate(zip(keys, results, rows, strict=True)):
            answer: LookupResult | None = result
            if row >= 0:
                self._pins[key] += 1  # lookup pin n -> n + 1
                self._rows[key] = row
            elif result is LookupResult.HIT:
                answer = None  # not pinned: never answered HIT, not cached
            if answer is not None:
                self._results[key] = answer
            if i == 0:
                first = answer
        return first or LookupResult.MISS

    def claim(self, keys: Iterable[bytes]) -> dict[bytes, int]:
        """Claims one lookup pin of each of ``keys`` that has one (for a load);
        returns their rows, in the order of ``keys``. The claimed pins become the
        caller's load pins."""
        rows: dict[bytes, int] = {}
        for key in keys:
            if self._pins[key] > 0 and key not in rows:
                self._pins[key] -= 1  # lookup pin n -> n - 1, now a load pin
                rows[key] = self._rows[key]
        return rows

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drops the answers for ``keys`` (stored, completed or evicted since asked)."""
        for key in keys:
            self._results.pop(key, None)

    def unclaimed(self) -> list[bytes]:
        """The lookup pins nobody claimed, one entry per pin."""
        return [k for k, n in self._pins.items() for _ in range(n)]

    def clear(self) -> None:
        """Forgets the step: answers, pins and rows (release ``unclaimed()`` first)."""
        self._results.clear()
        self._pins.clear()
        self._rows.clear()

    def following_keys(self, key: bytes, positions: dict[bytes, int] | None) -> list[bytes]:
        """The request's next keys of ``key``'s KV group, in prefix order, up to the
        first one already answered this step (the lookup is a prefix chain: a gap
        would make the daemon pin and promote past a key it was not asked about).
        ``positions``: vLLM's per-request key positions, when present."""
        if not positions or key not in positions:
            return []
        start, group = positions[key], key[-4:]
        later = sorted((pos, k) for k, pos in positions.items() if pos > start and k[-4:] == group)
        chain: list[bytes] = []
        for _, k in later[: LOOKUP_BATCH - 1]:
            if k in self._results:
                break
            chain.append(k)
        return chain
