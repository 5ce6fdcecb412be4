"""What the manager counts: operations, failures, scheduler steps and round trips.

Round trips (one per scheduler step in the steady state). The manager's session
queues completions (``queue_completions``): ``complete_store``, ``complete_load``,
``touch`` and the release of unclaimed lookup pins cost no round trip; they travel
inside the ``Batch`` of the session's next call that needs an answer. Queued
completions nothing carried are sent alone at ``on_schedule_end`` once they have
waited a whole scheduler step (:data:`QUEUE_STEPS`), or by the session's timer
after ``flush_after`` seconds when the engine stops stepping, so a step costs at
most max(1, calls that need an answer) round trips.

:class:`StepAccounting` keeps that bookkeeping: which step the oldest queued
completion is from, which steps made daemon operations, and the round trips of
sessions the daemon forgot (a live session counts its own, ``Session.rpcs``).
:class:`CounterReport` turns the counters into the deltas vLLM's ``get_stats``
reports. Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "METRIC_NAMES",
    "QUEUE_STEPS",
    "STEP_HISTORY",
    "CounterReport",
    "ManagerCounters",
    "StepAccounting",
    "StepStats",
]

QUEUE_STEPS = 2
"""A queued completion nothing carried is sent alone at the ``on_schedule_end`` this
many steps after it was queued (it has then waited one whole scheduler step)."""

STEP_HISTORY = 4096
"""Round trips of this many recent steps are kept (``step_round_trips``)."""

METRIC_NAMES = {
    "lookups": "vllm:kv_offload_kvtierd_lookups",
    "rpc_failures": "vllm:kv_offload_kvtierd_rpc_failures",
    "reconnects": "vllm:kv_offload_kvtierd_reconnects",
    "used_blocks": "vllm:kv_offload_kvtierd_pool_used_blocks",
    "capacity_blocks": "vllm:kv_offload_kvtierd_pool_capacity_blocks",
    "round_trips": "vllm:kv_offload_kvtierd_round_trips",
    "steps": "vllm:kv_offload_kvtierd_scheduler_steps",
}

QUEUED_OPS = frozenset({"Touch", "CompleteLoad", "CompleteStore"})
"""Session calls queued by the client (``queue_completions``)."""
ANSWERED_OPS = frozenset({"Lookup", "PrepareLoad", "PrepareStore", "Flush"})
"""Session calls that send the queue with them."""
SESSION_OPS = QUEUED_OPS | ANSWERED_OPS
"""Calls whose round trips the session counts (``Session.rpcs``)."""
NOT_WORK = frozenset({"Flush", "GetStats"})
"""Calls that do not make a step busy (they only send earlier work, or read gauges)."""


@dataclass
class ManagerCounters:
    """Counts since the manager started (``get_stats`` reports the deltas)."""

    lookups: Counter[str] = field(default_factory=Counter)  # by vLLM result name
    ops: Counter[str] = field(default_factory=Counter)  # daemon operations by name, sent or queued
    rpc_failures: int = 0
    reconnects: int = 0
    lookup_pins_released: int = 0  # lookup pins no prepare_load claimed in their step
    round_trips: int = 0  # as of the last get_stats (see StepStats for the live count)
    steps: int = 0


@dataclass(frozen=True)
class StepStats:
    """Scheduler steps and daemon round trips since the manager started.

    ``busy_steps``: steps in which the manager made at least one daemon operation
    (sent or queued). Subtract two snapshots for a window: ``round_trips /
    busy_steps`` is the cost of a step that has work, ``round_trips / steps`` the
    average over every step (idle decode steps cost nothing).
    """

    steps: int
    busy_steps: int
    round_trips: int

    def __sub__(self, other: StepStats) -> StepStats:
        return StepStats(
            self.steps - other.steps,
            self.busy_steps - other.busy_steps,
            self.round_trips - other.round_trips,
        )

    @property
    def per_step(self) -> float:
        return self.round_trips / self.steps if self.steps else 0.0

    @property
    def per_busy_step(self) -> float:
        return self.round_trips / self.busy_steps if self.busy_steps else 0.0


class StepAccounting:
    """Scheduler steps, busy steps, round trips, and the age of the completion queue.

    Invariants: ``step`` only grows (one per ``on_schedule_end``); ``queued_at`` is
    None or the step of the oldest completion the session still queues; round
    trips = ``_dead_round_trips`` (sessions the daemon forgot) +
    ``_own_round_trips`` (calls the session does not count: OpenSession,
    FlushPool, GetStats, TakeEvents) + the live session's ``rpcs``.
    """

    def __init__(self) -> None:
        self.step = 0
        self.queued_at: int | None = None  # step of the oldest completion not yet sent
        self._dead_round_trips = 0
        self._own_round_trips = 0
        self._busy_steps = 0
        self._step_busy = False  # this step made a daemon operation
        self._round_trips_at_step = 0
        self.step_round_trips: deque[int] = deque(maxlen=STEP_HISTORY)
        """Round trips of each recent scheduler step (``on_schedule_end`` to the next)."""

    def on_call(self, rpc: str, queues_completions: bool) -> None:
        """A daemon operation ``rpc`` is about to be made (sent, or queued by the
        session when ``queues_completions``)."""
        if rpc not in SESSION_OPS:
            self._own_round_trips += 1  # a round trip session.rpcs does not count
        if rpc not in NOT_WORK:
            self._step_busy = True
        if rpc in QUEUED_OPS:
            if self.queued_at is None and queues_completions:
                self.queued_at = self.step
        elif rpc in ANSWERED_OPS:
            self.queued_at = None  # it carries the queue (or loses it with a failure)

    def on_open_session(self) -> None:
        self._own_round_trips += 1

    def on_session_lost(self, session_rpcs: int) -> None:
        """The session the daemon forgot made ``session_rpcs`` round trips; its queue died."""
        self._dead_round_trips += session_rpcs
        self.queued_at = None

    def queue_overdue(self) -> bool:
        """The oldest queued completion has waited a whole scheduler step."""
        return self.queued_at is not None and self.step - self.queued_at >= QUEUE_STEPS

    def round_trips(self, live_session_rpcs: int) -> int:
        return self._dead_round_trips + self._own_round_trips + live_session_rpcs

    def end_step(self, live_session_rpcs: int) -> None:
        """Closes the step's round-trip count (after its last operation)."""
        round_trips = self.round_trips(live_session_rpcs)
        self.step_round_trips.append(round_trips - self._round_trips_at_step)
        self._round_trips_at_step = round_trips
        self._busy_steps += self._step_busy
        self._step_busy = False

    def stats(self, live_session_rpcs: int) -> StepStats:
        return StepStats(self.step, self._busy_steps, self.round_trips(live_session_rpcs))


class CounterReport:
    """The counters and what of them ``get_stats`` already reported."""

    def __init__(self, counters: ManagerCounters) -> None:
        self.counters = counters
        self._reported = ManagerCounters()

    def deltas(self, step_stats: StepStats) -> Iterator[tuple[str, int, tuple[str, ...]]]:
        """(metric name, increase, labels) of every counter that grew since the last
        call; everything yielded counts as reported."""
        counters = self.counters
        for name, count in counters.lookups.items():
            delta = count - self._reported.lookups[name]
            if delta:
                yield METRIC_NAMES["lookups"], delta, (name,)
        counters.round_trips = step_stats.round_trips
        counters.steps = step_stats.steps
        for attr in ("rpc_failures", "reconnects", "round_trips", "steps"):
            delta = getattr(counters, attr) - getattr(self._reported, attr)
            if delta:
                yield METRIC_NAMES[attr], delta, ()
        self._reported = ManagerCounters(
            lookups=Counter(counters.lookups),
            rpc_failures=counters.rpc_failures,
            reconnects=counters.reconnects,
            round_trips=counters.round_trips,
            steps=counters.steps,
        )
