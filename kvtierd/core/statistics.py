"""A pool's statistics: the one snapshot (:meth:`kvtierd.core.pool.Pool.statistics`) and
the numbers each of its tiers tells, computed from it in one place.

GetStats (:mod:`kvtierd.api.messages`), the metrics endpoint
(:mod:`kvtierd.ops.metrics`) and, through GetStats, ``kvtierctl stats`` convert the
same snapshot through :data:`TIER_NUMBERS` (:func:`tier_views`), so they cannot
disagree: a number is named after its GetStats ``TierStats`` field, and is computed
once for the primary and once for a secondary tier. A few numbers only the metrics
endpoint tells (``on_wire`` False: GetStats has no field for them and the wire contract
stays as it is). ``tests/unit/core/test_statistics.py`` checks that every field of the
snapshot reaches both outputs, or is declared to reach only one and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.contract import PRIMARY_TIER, Medium, PoolSpec
from kvtierd.tiering.admission import REASONS, AdmissionStats
from kvtierd.tiering.manager import TierCounters
from kvtierd.tiers.base import TierStats


@dataclass(frozen=True, slots=True)
class PrimaryStatistics:
    """The primary tier of a pool at one instant: its state and cumulative counters.

    Lookup answers, one per key and Lookup (a client that polls a promotion counts
    once per poll): ``hits`` HIT, ``hits_pending`` HIT_PENDING, ``misses`` MISS,
    ``retries`` RETRY. Loads: ``loads`` pins (PrepareLoad's, or a pinning
    Lookup's) released by CompleteLoad as loads; ``unused_pins`` those released
    with ``unused`` (read by nobody); pins dropped with their session count in
    neither.
    """

    block_bytes: int
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    pending_blocks: int
    quarantined_blocks: int
    evictions: int
    hits: int
    hits_pending: int
    misses: int
    retries: int
    loads: int
    unused_pins: int
    stores_completed: int
    stores_aborted: int  # CompleteStore(success=false), or left unfinished by an ended session
    stores_refused: int  # PrepareStore answered accepted=false

    @property
    def bytes_in(self) -> int:
        return self.stores_completed * self.block_bytes

    @property
    def bytes_out(self) -> int:
        return self.loads * self.block_bytes


@dataclass(frozen=True, slots=True)
class SecondaryStatistics:
    """One secondary tier of a pool at one instant. ``tier`` is the tier's own view
    (capacity, usage, bytes moved, evictions, failures, queue); its ``hits``,
    ``misses`` and ``dropped_writes`` are the tier's raw counts, superseded by
    ``counters``' (what this pool got from the tier)."""

    tier: TierStats
    ready: bool  # index rebuilt: the tier answers HIT / MISS, not RETRY
    counters: TierCounters
    admission: AdmissionStats  # which blocks it was written (kvtierd.tiering.admission)


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """One pool at one instant: the single snapshot GetStats, the metrics endpoint
    and (through GetStats) kvtierctl convert from, so they cannot disagree."""

    spec: PoolSpec
    sessions: int
    region_path: str
    region_bytes: int
    last_event_seq: int
    primary: PrimaryStatistics
    secondaries: tuple[SecondaryStatistics, ...]  # in lookup order
    warm_adopted_blocks: int = 0  # memory.warm_restart: adopted when the pool opened
    warm_dropped_blocks: int = 0  # ... and dropped there (checksum mismatch)
    journal_bytes: int = 0  # the journal's size now (0: warm restart off)
    # age of the oldest completion not yet journaled (0: none, or warm restart off)
    journal_lag_seconds: float = 0.0
    # 1: memory.warm_restart is on but this pool has no working journal (its path
    # was taken, or a write failed): its next start is cold
    warm_restart_off: int = 0


# ----------------------------------------------------------------- tier numbers


def _rejected(reason: str, unit: str = "blocks") -> Callable[[SecondaryStatistics], int]:
    """The number of blocks (or bytes) a tier's admission rejected for ``reason``."""
    if unit == "bytes":
        return lambda s: s.admission.rejected_bytes[reason]
    return lambda s: s.admission.rejected_blocks[reason]


@dataclass(frozen=True, slots=True)
class TierNumber:
    """One number a tier tells: how it is computed from the primary's snapshot and
    from a secondary tier's (None: that kind of tier does not have it)."""

    name: str  # the GetStats TierStats field (or the metrics-only number)
    primary: Callable[[PrimaryStatistics], int] | None
    secondary: Callable[[SecondaryStatistics], int] | None
    on_wire: bool = True  # GetStats carries it


TIER_NUMBERS: tuple[TierNumber, ...] = (
    # usage
    TierNumber(
        "capacity_blocks",
        lambda p: p.capacity_blocks,
        lambda s: s.tier.capacity_bytes // s.tier.bytes_per_block,
    ),
    TierNumber("used_blocks", lambda p: p.used_blocks, lambda s: s.tier.blocks),
    TierNumber(
        "capacity_bytes",
        lambda p: p.capacity_blocks * p.block_bytes,
        lambda s: s.tier.capacity_bytes,
    ),
    TierNumber("used_bytes", lambda p: p.used_blocks * p.block_bytes, lambda s: s.tier.used_bytes),
    TierNumber("pinned_blocks", lambda p: p.pinned_blocks, None),
    TierNumber("pending_blocks", lambda p: p.pending_blocks, None),
    TierNumber("quarantined_blocks", lambda p: p.quarantined_blocks, None),
    # answers HIT / MISS, not RETRY: a secondary tier once its index is rebuilt; the
    # primary whenever its pool has statistics (an open pool's primary never says RETRY)
    TierNumber("ready", lambda p: 1, lambda s: int(s.ready)),
    # lookup answers
    TierNumber("hits", lambda p: p.hits, lambda s: s.counters.hits),
    TierNumber("hits_pending", lambda p: p.hits_pending, None),
    TierNumber("misses", lambda p: p.misses, lambda s: s.counters.misses),
    TierNumber("retries", lambda p: p.retries, lambda s: s.counters.retries),
    # bytes moved, blocks lost
    TierNumber("bytes_in", lambda p: p.bytes_in, lambda s: s.tier.bytes_written),
    TierNumber("bytes_out", lambda p: p.bytes_out, lambda s: s.tier.bytes_read),
    TierNumber("unused_pins", lambda p: p.unused_pins, None),
    TierNumber("evictions", lambda p: p.evictions, lambda s: s.tier.evictions),
    TierNumber(
        "failures",
        lambda p: p.stores_aborted,
        lambda s: s.tier.store_failures + s.tier.load_failures,
    ),
    TierNumber("stores_refused", lambda p: p.stores_refused, None, on_wire=False),
    TierNumber("checksum_failures", None, lambda s: s.tier.checksum_failures),
    TierNumber("integrity_failures", None, lambda s: s.tier.integrity_failures),
    # jobs between the primary and the tier
    TierNumber("jobs_in_flight", None, lambda s: s.counters.jobs_in_flight),
    TierNumber(
        "cascade_jobs_started", None, lambda s: s.counters.cascade_jobs_started, on_wire=False
    ),
    TierNumber(
        "cascade_jobs_finished", None, lambda s: s.counters.cascade_jobs_finished, on_wire=False
    ),
    TierNumber("cascade_failures", None, lambda s: s.counters.cascade_jobs_failed),
    TierNumber("cascade_blocks", None, lambda s: s.counters.cascade_blocks),
    TierNumber("dropped_blocks", None, lambda s: s.counters.cascade_blocks_dropped),
    TierNumber(
        "promotion_jobs_started", None, lambda s: s.counters.promotion_jobs_started, on_wire=False
    ),
    TierNumber(
        "promotion_jobs_finished",
        None,
        lambda s: s.counters.promotion_jobs_finished,
        on_wire=False,
    ),
    TierNumber(
        "promotion_jobs_failed", None, lambda s: s.counters.promotion_jobs_failed, on_wire=False
    ),
    TierNumber("promoted_blocks", None, lambda s: s.counters.promotion_blocks_loaded),
    TierNumber("promotion_failures", None, lambda s: s.counters.promotion_blocks_failed),
    TierNumber("promotion_no_room", None, lambda s: s.counters.promotion_no_room),
    TierNumber("queued_jobs", None, lambda s: s.tier.queued_jobs, on_wire=False),
    TierNumber("queued_bytes", None, lambda s: s.tier.queued_bytes),
    # a remote tier's server (0 for a tier without one)
    TierNumber("nodes_known", None, lambda s: s.tier.nodes_known),
    TierNumber("nodes_reachable", None, lambda s: s.tier.nodes_reachable),
    TierNumber("round_trip_us", None, lambda s: s.tier.round_trip_us),
    TierNumber("server_capacity_bytes", None, lambda s: s.tier.server_capacity_bytes),
    TierNumber("server_used_bytes", None, lambda s: s.tier.server_used_bytes),
    TierNumber("probe_failures", None, lambda s: s.tier.probe_failures),
    # a shared fs root (kvtierd.tiers.fs.shared)
    TierNumber("foreign_files_found", None, lambda s: s.tier.foreign_files_found),
    TierNumber("shared_rechecks", None, lambda s: s.tier.shared_rechecks),
    TierNumber("shared_rescans", None, lambda s: s.tier.shared_rescans),
    TierNumber("shared_files_vanished", None, lambda s: s.tier.shared_files_vanished),
    # a remote tier's presence probes and the Lookups that waited for them
    TierNumber("probes", None, lambda s: s.tier.probes),
    TierNumber("lookup_waits", None, lambda s: s.counters.lookup_waits),
    TierNumber("lookup_wait_timeouts", None, lambda s: s.counters.lookup_wait_timeouts),
    # admission (kvtierd.tiering.admission): blocks offered to the tier, written or not
    TierNumber("admitted_blocks", None, lambda s: s.admission.admitted_blocks),
    TierNumber("admitted_bytes", None, lambda s: s.admission.admitted_bytes),
    *(TierNumber(f"rejected_{reason}_blocks", None, _rejected(reason)) for reason in REASONS),
    *(  # bytes by reason: blocks x block_bytes, which GetStats tells already
        TierNumber(f"rejected_{reason}_bytes", None, _rejected(reason, "bytes"), on_wire=False)
        for reason in REASONS
    ),
    TierNumber("admission_sketch_bytes", None, lambda s: s.admission.sketch_bytes),
)

WIRE_NUMBERS = frozenset(number.name for number in TIER_NUMBERS if number.on_wire)


@dataclass(frozen=True, slots=True)
class TierView:
    """What one tier of one pool tells: its name, medium and numbers (by name)."""

    name: str
    medium: Medium
    numbers: dict[str, int]
    admission: str = ""  # a secondary tier's admission policy ("" for the primary)

    def wire_numbers(self) -> dict[str, int]:
        """The numbers GetStats carries (its TierStats fields)."""
        return {name: value for name, value in self.numbers.items() if name in WIRE_NUMBERS}


def tier_views(stats: PoolStatistics) -> list[TierView]:
    """The tiers of one pool snapshot, primary first, then secondaries in lookup order."""
    primary = stats.primary
    views = [
        TierView(
            PRIMARY_TIER,
            Medium.CPU,
            {n.name: n.primary(primary) for n in TIER_NUMBERS if n.primary is not None},
        )
    ]
    for secondary in stats.secondaries:
        numbers = {n.name: n.secondary(secondary) for n in TIER_NUMBERS if n.secondary is not None}
        views.append(
            TierView(
                secondary.tier.name, secondary.tier.medium, numbers, secondary.admission.policy
            )
        )
    return views
