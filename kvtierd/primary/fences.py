"""Rows kept from writers until a time: the primary manager's fences
(docs/design/leases.md, the write fence; docs/design/journal.md, adoption).

Two of the manager's sets are rows held until a time each: the *quarantine* (rows
of writes aborted because their writer's session ended: neither mapped nor free
until their time) and the *adoption pins* (adopted blocks the previous daemon's
clients may still be loading from: pinned until their time). Both are a
:class:`TimedRows`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping


class TimedRows:
    """Groups of rows, each held until its time, released in time order.

    Invariants: the groups are in ``until`` order (a group added later but due
    sooner is inserted before the later ones: a lane-ended session's rows are
    held through its lease, a plain one's only ``write_quarantine``); ``count``
    is the number of rows in all groups. The caller never puts a row in twice.
    """

    def __init__(self) -> None:
        self._groups: deque[tuple[float, list[int]]] = deque()
        self.count = 0

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[tuple[float, list[int]]]:
        """(until, rows) per group, soonest first."""
        return iter(self._groups)

    def add(self, until: float, rows: list[int]) -> None:
        """Holds ``rows`` (not empty; owned from now on) until ``until``."""
        groups = self._groups
        index = len(groups)
        while index and groups[index - 1][0] > until:
            index -= 1  # usually none: times mostly arrive in order
        groups.insert(index, (until, rows))
        self.count += len(rows)

    def add_each(self, rows: list[int], until: Mapping[int, float]) -> None:
        """Holds each of ``rows`` until ``until[row]`` (one group per distinct time)."""
        groups: dict[float, list[int]] = {}
        for row in rows:
            groups.setdefault(until[row], []).append(row)
        for time, group in sorted(groups.items()):
            self.add(time, group)

    def pop_due(self, now: float) -> list[int]:
        """Removes and returns the rows whose time has come (``until <= now``),
        soonest first."""
        due: list[int] = []
        groups = self._groups
        while groups and groups[0][0] <= now:
            due.extend(groups.popleft()[1])
        self.count -= len(due)
        return due

    @property
    def next_until(self) -> float | None:
        """The soonest time still held; None when no row is."""
        return self._groups[0][0] if self._groups else None

    def rows(self) -> list[int]:
        """Every row held, soonest first."""
        return [row for _, rows in self._groups for row in rows]

    def until_of_rows(self) -> dict[int, float]:
        """row -> the time it is held until."""
        return {row: until for until, rows in self._groups for row in rows}

    def check_invariants(self) -> None:
        """The groups are in time order, no row is held twice, ``count`` is right."""
        times = [until for until, _ in self._groups]
        assert times == sorted(times), "held rows out of release order"
        rows = self.rows()
        assert len(rows) == len(set(rows)) == self.count, "a row held twice, or a wrong count"
