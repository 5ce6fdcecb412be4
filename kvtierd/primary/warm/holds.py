"""Which rows the previous daemon's clients may still touch after a restart, and for
how long (docs/design/journal.md, "How long an old client may touch a row").

A client copies into a row it reserved, or out of a row it pinned, under the lease
its daemon granted (its lease fence, a vLLM worker's lease beacon). When that
daemon stops, its pins and reservations die with it, but the client learns of it
only when its lease runs out: until then the adopting daemon must not hand such a
row to a writer. What the journal tells it (:func:`old_client_holds`):

* **a graceful stop** (the last record is ``stopped``): the rows a session pinned or
  reserved at the stop, the rows still quarantined and the adopted blocks still
  held for an older daemon's clients, each with the instant its last client may
  touch it (``held`` records: the session's lease as its client proves it, plus
  ``write_quarantine``). Every other row is usable at once.
* **a crash** (no stop record): every row the journal names (``ready`` or
  ``freed``: a client may have got it), until the last ``horizon``. The daemon
  appends a horizon *before* it grants a lease that could end past the last
  one's time minus ``write_quarantine``
  (``JournalWriter.cover_leases``), so the horizon
  bounds every client's lease, write fence included, counted from its last grant:
  at most :data:`HORIZON_SLACK_SECONDS` later than ``lease + write_quarantine``
  after the crash. A row the journal never names was never handed out: usable at once.
* **a version-2 journal** (no such records): every row it names, for the longer of
  both daemons' ``lease + write_quarantine`` from the adoption (as before).

Instants are read as :mod:`kvtierd.primary.warm.clock` says, capped at the old
daemon's fence (its ``fence_seconds`` + the slack): no record can hold a row longer
than a lease it could have granted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.primary.warm.clock import same_boot
from kvtierd.primary.warm.journalformat import Replay

# a horizon covers the leases granted in the next this many seconds: at most one
# record per that time per pool under steady renewals; a crash's hold ends at most
# that much after the old daemon's last lease (+ write_quarantine) would have
HORIZON_SLACK_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class OldClientHolds:
    """The rows to keep from writers after an adoption, in seconds from now (> 0)."""

    seconds: dict[int, float]
    why: str  # one phrase for the adoption's log line

    @property
    def longest(self) -> float:
        return max(self.seconds.values(), default=0.0)


def old_client_holds(replay: Replay, fallback_seconds: float) -> OldClientHolds:
    """What the old daemon's clients may still touch (see the module docstring).
    ``fallback_seconds``: the hold of a journal without liveness records."""
    header = replay.header
    named = set(replay.ready) | replay.freed
    if header.version < 3:
        seconds = dict.fromkeys(named, fallback_seconds) if fallback_seconds > 0 else {}
        return OldClientHolds(
            seconds,
            f"a format-{header.version} journal (no liveness records): the {len(seconds)} rows "
            f"it names held {fallback_seconds:g}s",
        )
    same = same_boot(header.boot_id)
    cap = header.fence_seconds + HORIZON_SLACK_SECONDS
    if replay.stopped is not None:
        seconds = {}
        for row, instant in replay.held.items():
            left = instant.seconds_left(same, cap)
            if left > 0:
                seconds[row] = left
        return OldClientHolds(
            seconds,
            f"a graceful stop: {len(seconds)} rows its clients may still touch held up to "
            f"{max(seconds.values(), default=0.0):.1f}s, every other row usable at once",
        )
    left = replay.horizon.seconds_left(same, cap) if replay.horizon is not None else 0.0
    seconds = dict.fromkeys(named, left) if left > 0 else {}
    return OldClientHolds(
        seconds,
        f"a crash: its last lease (+ write_quarantine) ends in {left:.1f}s; the {len(seconds)} "
        "rows it handed out held until then",
    )
