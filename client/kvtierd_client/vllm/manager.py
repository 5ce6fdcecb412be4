"""The scheduler side: vLLM's ``OffloadingManager`` served by kvtierd over gRPC.

Every decision (which keys are present, which rows to write, what to evict) is
the daemon's; this class translates vLLM's per-key calls into batched RPCs of one
session and keeps only bookkeeping that makes the translation safe.

Ownership of daemon state (all of it belongs to this manager's *session*):

* **lookup pins**: when ``lookup`` answers HIT it has already pinned the key (the
  ``Lookup`` pins it, ``Session.lookup_and_pin``), so the row cannot be evicted by
  another engine between vLLM's lookup and its ``prepare_load``. A lookup pin is
  either *claimed* by ``prepare_load`` in the same scheduler step (it becomes a
  load pin) or released at ``on_schedule_end`` (``CompleteLoad`` with ``unused``,
  queued: the daemon does not count it as a load).
* **load pins**: taken by ``prepare_load``, released by ``complete_load`` (after
  every worker copied the rows).
* **reservations**: rows reserved by ``prepare_store``, completed by
  ``complete_store`` (success makes them readable, failure frees them).
* ``reset_cache`` flushes the pool (``FlushPool``: ready, unpinned blocks of every
  engine sharing it); vLLM then ignores completions of jobs in flight, so their
  pins and reservations are released two scheduler steps later, once the workers
  have flushed those jobs (until then ``has_pending_work`` is True).

Failure model: a daemon that does not answer (``Unavailable``,
``DeadlineExceeded``) turns every lookup into MISS and every ``prepare_store``
into None for ``retry_interval`` seconds, then the manager tries again. A session
the daemon no longer knows (``NotFound``: daemon restarted, lease expired) starts
a new *generation*: a new session, possibly a new region; pins and reservations
of older generations died with their session and are never completed against the
new one. Row ids always travel with the identity of their region
(:class:`KvtierdLoadStoreSpec`), so a worker never applies them to another region.

Round trips (one per scheduler step in the steady state). The manager's session
queues completions (``queue_completions``): ``complete_store``, ``complete_load``,
``touch`` and the release of unclaimed lookup pins cost no round trip; they travel
inside the ``Batch`` of the session's next call that needs an answer. A lookup
that is not answered from the step cache is *one* round trip:
``Session.lookup_and_pin(keys, prefix=True)`` of the request's next keys, after the
queued completions; the daemon answers and pins the leading run of HITs in the
same op, so no second call and no guess of what is present is needed.
``prepare_load`` of keys this step's lookups pinned costs nothing (it claims the
pins); only keys looked up in an earlier step are pinned by a ``PrepareLoad`` of
their own. ``prepare_store`` is one round trip (carrying whatever is queued).
Queued completions nothing carried are sent alone at ``on_schedule_end`` once they
have waited a whole scheduler step, or by the session's timer after
``flush_after`` seconds (``kvtierd_flush_after``, passed to ``open_session``) when
the engine stops stepping, so a step costs at most max(1, calls that need an
answer) round trips.

Ordering guarantees relied on (kvtierd's ``Batch`` and ``Lookup``, the client's queue):

1. The daemon applies this session's operations in the order the manager made
   them: a queued completion always travels before the call that carries it, and
   a ``Batch`` runs its ops in order in one event-loop turn. So a ``Lookup`` sees
   every ``CompleteStore`` / ``CompleteLoad`` the manager made before it (our own
   stores are HIT, our released pins are released), exactly as with single RPCs.
2. A pinning ``Lookup`` answers and pins in one event-loop turn: nothing another
   engine does falls between the answer and the pin, so every key of the leading
   HIT run is pinned (its row is >= 0). The manager answers HIT only for a key it
   holds a row for; an unpinned HIT (after a HIT_PENDING) is not answered HIT and
   not cached, a later lookup of it pins it then.
3. Lookups are prefix lookups (``prefix=True``; the keys are the request's chain
   in order, up to the first key already answered this step): every key after
   the first one that is neither HIT nor HIT_PENDING answers MISS and starts no
   promotion from a secondary tier (the fs tier), since vLLM loads nothing past
   its first miss. Those MISSes are cached for the step like any answer, so
   vLLM's scan stops there instead of asking again from that key on.
4. Calls that cannot ride in a ``Batch`` (``FlushPool``, ``TakeEvents``,
   ``GetStats``) are client or session RPCs of their own: ``reset_cache`` sends the
   queue first, so the flush sees every pin released before it; ``take_events``
   does not (events of completions still queued come with the next take).
5. Errors of queued completions cannot be raised by the call that queued them: the
   client logs them and keeps them in ``session.deferred_errors`` (a failed queued
   op stops nothing after it in its ``Batch``); a session the daemon forgot fails
   the next call that needs an answer (``NotFound``: a new generation, as before);
   a transport failure loses the queued ops with the call (the daemon releases
   their pins and reservations with the session).

Counting: ``step_stats()`` (steps, steps with daemon work, round trips) and the
``vllm:kv_offload_kvtierd_round_trips`` / ``..._scheduler_steps`` counters of
``get_stats``; a step is one ``on_schedule_end``.

Step-local cache: ``Lookup`` is batched over the request's following keys (vLLM
calls ``lookup`` key by key in prefix order; the request context records every
key's position) and the answers are reused for the rest of the scheduler step;
``prepare_store``, ``complete_store`` and reconnects drop the affected entries,
and ``on_schedule_end`` drops them all.

Runs in vLLM's scheduler thread only; not thread-safe.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvtierd_client.client import Client, Session
from kvtierd_client.client import LookupResult as DaemonLookup
from kvtierd_client.errors import FailedPrecondition, KvtierError, NotFound
from kvtierd_client.proto import pb2
from kvtierd_client.vllm.common import (
    KvtierdLoadStoreSpec,
    RegionIdentity,
    log,
    open_session_on,
)
from kvtierd_client.vllm.settings import PluginSettings, PoolPlan

__all__ = ["KvtierdOffloadingManager", "ManagerCounters", "METRIC_NAMES", "StepStats"]

_T = TypeVar("_T")

LOOKUP_BATCH = 256
"""At most this many keys per Lookup RPC (the asked key and the request's next keys)."""

GRAVE_STEPS = 2
"""Scheduler steps after ``reset_cache`` before abandoned pins/reservations are released."""

QUEUE_STEPS = 2
"""A queued completion nothing carried is sent alone at the ``on_schedule_end`` this
many steps after it was queued (it has then waited one whole scheduler step)."""

STEP_HISTORY = 4096
"""Round trips of this many recent steps are kept (``step_round_trips``)."""

_RESULTS = {
    DaemonLookup.MISS: LookupResult.MISS,
    DaemonLookup.HIT: LookupResult.HIT,
    DaemonLookup.HIT_PENDING: LookupResult.HIT_PENDING,
    DaemonLookup.RETRY: LookupResult.RETRY,
}
"""kvtierd's LookupResult -> vLLM's, one to one."""

METRIC_NAMES = {
    "lookups": "vllm:kv_offload_kvtierd_lookups",
    "rpc_failures": "vllm:kv_offload_kvtierd_rpc_failures",
    "reconnects": "vllm:kv_offload_kvtierd_reconnects",
    "used_blocks": "vllm:kv_offload_kvtierd_pool_used_blocks",
    "capacity_blocks": "vllm:kv_offload_kvtierd_pool_capacity_blocks",
    "round_trips": "vllm:kv_offload_kvtierd_round_trips",
    "steps": "vllm:kv_offload_kvtierd_scheduler_steps",
}


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


def _fence_of(session: Session) -> dict[str, str]:
    """What a worker needs to check that ``session`` still holds a job's rows."""
    return {"lease_beacon": session.lease_beacon().path, "session_id": session.session_id}


@dataclass
class _Generation:
    """One session of the manager and the region its row ids index."""

    number: int
    session: Session
    region: RegionIdentity


@dataclass
class _Grave:
    """Pins and reservations vLLM forgot at ``reset_cache``; released at ``release_step``."""

    release_step: int
    generation: int
    load_pins: Counter[bytes]
    reserved: list[bytes]


class KvtierdOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over one kvtierd session (see the module docstring).

    ``client`` and ``session`` are owned from here on (closed by :meth:`shutdown`).
    """

    def __init__(
        self,
        client: Client,
        session: Session,
        settings: PluginSettings,
        plan: PoolPlan,
        *,
        events_enabled: bool,
        client_name: str,
    ) -> None:
        self._client = client
        self._settings = settings
        self._plan = plan
        self._events_enabled = events_enabled
        self._client_name = client_name
        self._gen: _Generation | None = _Generation(1, session, RegionIdentity.of_session(session))
        self._last_generation = 1
        self._down_until = 0.0  # monotonic; calls short-circuit before it
        # step-local (cleared by on_schedule_end and by a new generation)
        self._step_results: dict[bytes, LookupResult] = {}
        self._step_pins: Counter[bytes] = Counter()  # lookup pins not yet claimed
        self._step_rows: dict[bytes, int] = {}  # row of every key in _step_pins
        # Invariant: _load_pins and _reserved hold keys of generation _gen.number only.
        self._load_pins: Counter[bytes] = Counter()
        self._reserved: set[bytes] = set()
        self._graves: list[_Grave] = []
        self._step = 0
        self.counters = ManagerCounters()
        self._reported = ManagerCounters()
        self._next_stats = 0.0
        # round trips and steps
        self._queued_at: int | None = None  # step of the oldest completion not yet sent
        self._dead_round_trips = 0  # of sessions of older generations
        self._own_round_trips = 0  # calls the session does not count (FlushPool, ...)
        self._busy_steps = 0
        self._step_busy = False  # this step made a daemon operation
        self._round_trips_at_step = 0
        self.step_round_trips: deque[int] = deque(maxlen=STEP_HISTORY)
        """Round trips of each recent scheduler step (``on_schedule_end`` to the next)."""

    # -- vLLM's OffloadingManager API ------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT only for a key this manager holds a pin on in this step (see module doc)."""
        result = self._step_results.get(key)
        if result is None:
            result = self._lookup_batch(key, req_context)
        self.counters.lookups[result.name.lower()] += 1
        return result

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> KvtierdLoadStoreSpec:
        """Rows of ``keys`` (co-indexed), pinned until ``complete_load``.

        Claims the lookup pins of this step; pins the others now. A key that cannot
        be pinned (not HIT any more, daemon gone) yields an *invalid* spec: the
        worker then reports the load job failed instead of copying unprotected rows.
        """
        keys = list(keys)
        gen = self._gen
        rows: dict[bytes, int] = {}
        claimed: list[bytes] = []
        if gen is not None:
            for key in keys:
                if self._step_pins[key] > 0 and key not in rows:
                    self._step_pins[key] -= 1
                    rows[key] = self._step_rows[key]
                    claimed.append(key)
        self._load_pins.update(claimed)
        missing = [k for k in dict.fromkeys(keys) if k not in rows]
        if missing:
            got = (
                None
                if gen is None
                else self._call(gen, "PrepareLoad", gen.session.prepare_load, missing)
            )
            if got is None or self._gen is not gen:
                log.error(
                    "kvtierd: cannot pin %d of %d blocks to load for request %s; the load "
                    "job will be reported failed", len(missing), len(keys), req_context.req_id,
                )  # fmt: skip
                return KvtierdLoadStoreSpec([-1] * len(keys), None, valid=False)
            rows.update(zip(missing, got, strict=True))
            self._load_pins.update(missing)
        assert gen is not None
        return KvtierdLoadStoreSpec([rows[k] for k in keys], gen.region, **_fence_of(gen.session))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        gen = self._usable()
        unique = list(dict.fromkeys(keys))
        if gen is not None and unique:
            self._call(gen, "Touch", gen.session.touch, unique)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Releases this generation's load pins on ``keys`` (older ones died with their session)."""
        mine = [k for k in dict.fromkeys(keys) if self._load_pins[k] > 0]
        for key in mine:
            self._load_pins[key] -= 1
            if self._load_pins[key] == 0:
                del self._load_pins[key]
        gen = self._gen
        if gen is not None and mine:
            self._call(gen, "CompleteLoad", gen.session.complete_load, mine, quiet=True)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Rows reserved for the keys the daemon does not hold yet; None when the
        daemon has no room now (``accepted=false``) or cannot be reached."""
        gen = self._usable()
        unique = list(dict.fromkeys(keys))
        if gen is None or not unique:
            return None
        grant = self._call(
            gen, "PrepareStore", gen.session.prepare_store, unique, req_context.req_id
        )
        if grant is None:  # refused (no room) or failed
            return None
        self._reserved.update(grant.keys_to_store)
        for key in (*grant.keys_to_store, *grant.evicted_keys):
            self._step_results.pop(key, None)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in grant.keys_to_store],
            store_spec=KvtierdLoadStoreSpec(grant.block_ids, gen.region, **_fence_of(gen.session)),
            evicted_keys=[OffloadKey(k) for k in grant.evicted_keys],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Completes this generation's reservations among ``keys``; others are ignored."""
        mine = [k for k in dict.fromkeys(keys) if k in self._reserved]
        self._reserved.difference_update(mine)
        for key in mine:
            self._step_results.pop(key, None)
        gen = self._gen
        if gen is not None and mine:
            self._call(gen, "CompleteStore", gen.session.complete_store, mine, success, quiet=True)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The pool's events since the last take (every engine sharing the pool), or
        nothing when vLLM's KV events are off (then nobody drains them)."""
        gen = self._usable()
        if not self._events_enabled or gen is None:
            return ()
        events = self._call(gen, "TakeEvents", gen.session.take_events) or []
        return [
            OffloadingEvent(
                keys=[OffloadKey(k) for k in e.keys],
                medium=Medium.CPU if e.medium == pb2.MEDIUM_CPU else Medium.STORAGE,
                removed=e.removed,
                ownership=None if e.tier in ("", "primary") else e.tier,
            )
            for e in events
        ]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Releases the lookup pins no ``prepare_load`` claimed (queued); forgets the
        step's answers; sends the completions that waited a whole step; ends the
        step's round-trip count."""
        self._step += 1
        unclaimed = [k for k, n in self._step_pins.items() for _ in range(n)]
        self._clear_step()
        gen = self._gen
        if unclaimed and gen is not None:
            self.counters.lookup_pins_released += len(unclaimed)
            self._release_pins(gen, unclaimed, unused=True)
        self._bury_due()
        if self._queued_at is not None and self._step - self._queued_at >= QUEUE_STEPS:
            self._send_queued()
        round_trips = self._round_trips()
        self.step_round_trips.append(round_trips - self._round_trips_at_step)
        self._round_trips_at_step = round_trips
        self._busy_steps += self._step_busy
        self._step_busy = False

    def has_pending_work(self) -> bool:
        return bool(self._graves)

    def reset_cache(self) -> None:
        """Flushes the pool in the daemon (every engine's ready, unpinned blocks)."""
        gen = self._gen
        if gen is not None:
            if self._load_pins or self._reserved:
                self._graves.append(
                    _Grave(
                        self._step + GRAVE_STEPS,
                        gen.number,
                        self._load_pins,
                        sorted(self._reserved),
                    )
                )
            unclaimed = [k for k, n in self._step_pins.items() for _ in range(n)]
            if unclaimed:
                self._release_pins(gen, unclaimed, unused=True)
        self._load_pins = Counter()
        self._reserved = set()
        self._clear_step()
        gen = self._usable()
        if gen is not None:
            self._send_queued()  # the flush must see the pins released above
            self._call(gen, "FlushPool", self._client.flush_pool, self._plan.name)

    def get_stats(self) -> Any:
        """Counter deltas since the last call, plus the pool's gauges every
        ``stats_interval`` seconds (one GetStats RPC)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, count in self.counters.lookups.items():
            delta = count - self._reported.lookups[name]
            if delta:
                stats.increase_counter(METRIC_NAMES["lookups"], delta, (name,))
        step_stats = self.step_stats()
        self.counters.round_trips = step_stats.round_trips
        self.counters.steps = step_stats.steps
        for attr in ("rpc_failures", "reconnects", "round_trips", "steps"):
            delta = getattr(self.counters, attr) - getattr(self._reported, attr)
            if delta:
                stats.increase_counter(METRIC_NAMES[attr], delta)
        self._reported = ManagerCounters(
            lookups=Counter(self.counters.lookups),
            rpc_failures=self.counters.rpc_failures,
            reconnects=self.counters.reconnects,
            round_trips=self.counters.round_trips,
            steps=self.counters.steps,
        )
        now = time.monotonic()
        gen = self._usable()
        if gen is not None and self._settings.stats_interval > 0 and now >= self._next_stats:
            self._next_stats = now + self._settings.stats_interval
            response = self._call(gen, "GetStats", self._client.get_stats, self._plan.name)
            primary = _primary_tier(response)
            if primary is not None:
                stats.set_gauge(METRIC_NAMES["used_blocks"], primary.used_blocks)
                stats.set_gauge(METRIC_NAMES["capacity_blocks"], primary.capacity_blocks)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Closes the session (the daemon releases its pins and aborts its reservations)."""
        self._gen = None
        self._client.close()

    # -- helpers -------------------------------------------------------------------

    @property
    def region(self) -> RegionIdentity | None:
        """The region of the current generation (None while disconnected)."""
        return None if self._gen is None else self._gen.region

    @property
    def pool_name(self) -> str:
        return self._plan.name

    def step_stats(self) -> StepStats:
        """Scheduler steps and daemon round trips so far (subtract two for a window)."""
        return StepStats(self._step, self._busy_steps, self._round_trips())

    def _round_trips(self) -> int:
        gen = self._gen
        live = 0 if gen is None else gen.session.rpcs
        return self._dead_round_trips + self._own_round_trips + live

    def _lookup_batch(self, key: bytes, ctx: ReqContext) -> LookupResult:
        """Asks the daemon about ``key`` and the request's next keys (one round trip),
        keeps the pins of the leading HIT run and caches the answers for the step."""
        batch = [key, *self._following_keys(key, ctx)]
        answered = self._lookup_rpc(batch, ctx.req_id)
        if answered is None:
            return LookupResult.MISS
        answers, rows = answered
        # The daemon pinned the leading run of HITs (prefix lookup: -1 from the first
        # key that is not HIT on). vLLM's prefix scan stops at the first MISS and
        # defers on HIT_PENDING / RETRY; a HIT after those is not pinned, hence not
        # cached (a later lookup of it pins it then). Keys after the first key that is
        # neither HIT nor HIT_PENDING answer MISS (the daemon looked no further): they
        # are cached too, so the scan stops there instead of asking from that key on.
        results: list[LookupResult | None] = []
        for k, answer, row in zip(batch, answers, rows, strict=True):
            result: LookupResult | None = _RESULTS[answer]
            if row >= 0:
                self._step_pins[k] += 1
                self._step_rows[k] = row
            elif result is LookupResult.HIT:
                result = None  # not pinned: never answered HIT, not cached
            if result is not None:
                self._step_results[k] = result
            results.append(result)
        return results[0] or LookupResult.MISS

    def _lookup_rpc(
        self, batch: list[bytes], req_id: str
    ) -> tuple[list[DaemonLookup], list[int]] | None:
        """``Session.lookup_and_pin(batch, prefix=True)``: one round trip (a ``Batch``
        of the queued completions, if any, then the ``Lookup``) that pins the leading
        HITs for this session; the answers and the rows, co-indexed with ``batch``
        (-1 where not pinned). A session the daemon forgot (restart) is replaced and
        asked again at once. None when the daemon cannot answer."""
        for _ in range(2):
            gen = self._usable()
            if gen is None:
                return None
            got = self._call(gen, "Lookup", gen.session.lookup_and_pin, batch, req_id, prefix=True)
            if got is not None and self._gen is gen:
                return got
            if self._gen is not None:  # failed for another reason than a lost session
                return None
        return None

    def _send_queued(self) -> None:
        """Sends the session's queued completions now (one ``Batch``, none if empty)."""
        gen = self._gen
        self._queued_at = None
        if gen is not None:
            self._call(gen, "Flush", gen.session.flush, quiet=True)

    def _following_keys(self, key: bytes, ctx: ReqContext) -> list[bytes]:
        """The request's next keys of ``key``'s KV group, in prefix order, up to the
        first one already answered this step (the lookup is a prefix chain: a gap
        would make the daemon pin and promote past a key it was not asked about).
        From vLLM's per-request key positions, when present."""
        positions: dict[bytes, int] | None = getattr(ctx, "_offload_key_positions", None)
        if not positions or key not in positions:
            return []
        start, group = positions[key], key[-4:]
        later = sorted((pos, k) for k, pos in positions.items() if pos > start and k[-4:] == group)
        chain: list[bytes] = []
        for _, k in later[: LOOKUP_BATCH - 1]:
            if k in self._step_results:
                break
            chain.append(k)
        return chain

    def _release_pins(self, gen: _Generation, keys: list[bytes], *, unused: bool = False) -> None:
        """Releases pins (queued ``CompleteLoad``); ``unused``: lookup pins no load
        claimed, which the daemon then does not count as loads (its loaded bytes
        are the blocks the workers were given to copy)."""
        # A key pinned n times is released in n calls (keys are unique per call).
        while keys:
            batch = list(dict.fromkeys(keys))
            for k in batch:
                keys.remove(k)
            self._call(
                gen, "CompleteLoad", gen.session.complete_load, batch, unused=unused, quiet=True
            )

    def _bury_due(self) -> None:
        due = [g for g in self._graves if g.release_step <= self._step]
        self._graves = [g for g in self._graves if g.release_step > self._step]
        gen = self._gen
        for grave in due:
            if gen is None or grave.generation != gen.number:
                continue  # that session is gone, and its pins with it
            if grave.reserved:
                self._call(
                    gen,
                    "CompleteStore",
                    gen.session.complete_store,
                    grave.reserved,
                    False,
                    quiet=True,
                )
            pins = [k for k, n in grave.load_pins.items() for _ in range(n)]
            if pins:
                self._release_pins(gen, pins)

    def _clear_step(self) -> None:
        self._step_results.clear()
        self._step_pins.clear()
        self._step_rows.clear()

    def _usable(self) -> _Generation | None:
        """The current generation, reconnecting after ``retry_interval`` if there is none;
        None while the daemon is considered down."""
        if time.monotonic() < self._down_until:
            return None
        if self._gen is not None:
            return self._gen
        self._own_round_trips += 1  # OpenSession
        try:
            session = open_session_on(
                self._client,
                self._settings,
                self._plan,
                self._client_name,
                queue_completions=True,
            )
            region = RegionIdentity.of_session(session)
        except (KvtierError, OSError) as err:
            self._down_until = time.monotonic() + self._settings.retry_interval
            self.counters.rpc_failures += 1
            log.warning("kvtierd: reopening pool %s failed: %s", self._plan.name, err)
            return None
        self._last_generation += 1
        self._gen = _Generation(self._last_generation, session, region)
        self.counters.reconnects += 1
        log.warning(
            "kvtierd: new session %s on pool %s (region %s); blocks of the old session "
            "are forgotten", session.session_id, self._plan.name, region.path,
        )  # fmt: skip
        return self._gen

    def _call(
        self,
        gen: _Generation,
        rpc: str,
        fn: Callable[..., _T],
        *args: Any,
        quiet: bool = False,
        **kwargs: Any,
    ) -> _T | None:
        """``fn(*args, **kwargs)``; None after a failure, which it handles (see the module doc).

        Bookkeeping of the queue and of the step: a completion marks when the queue
        started waiting; a call that needs an answer empties it (it carries the queue,
        or loses it with a transport failure)."""
        if rpc not in _SESSION_OPS:
            self._own_round_trips += 1  # a round trip session.rpcs does not count
        if rpc not in _NOT_WORK:
            self._step_busy = True
        if rpc in _QUEUED_OPS:
            if self._queued_at is None and gen.session.queue_completions:
                self._queued_at = self._step
        elif rpc in _ANSWERED_OPS:
            self._queued_at = None
        try:
            result = fn(*args, **kwargs)
        except KvtierError as err:
            self._failed(gen, rpc, err, quiet=quiet)
            return None
        self.counters.ops[rpc] += 1
        return result

    def _failed(self, gen: _Generation, rpc: str, err: KvtierError, quiet: bool = False) -> None:
        self.counters.rpc_failures += 1
        if isinstance(err, NotFound):
            if self._gen is gen:
                log.warning(
                    "kvtierd: %s: session %s is gone (%s)", rpc, gen.session.session_id, err
                )
                self._new_generation_needed()
            return
        if isinstance(err, FailedPrecondition) and quiet:
            log.debug("kvtierd: %s: %s", rpc, err)
            return
        if time.monotonic() >= self._down_until:
            log.warning(
                "kvtierd: %s failed (%s); serving misses for %.1fs",
                rpc, err, self._settings.retry_interval,
            )  # fmt: skip
        self._down_until = time.monotonic() + self._settings.retry_interval

    def _new_generation_needed(self) -> None:
        """Forgets the dead session: its pins, reservations, queue and this step's answers."""
        if self._gen is not None:
            self._dead_round_trips += self._gen.session.rpcs
        self._gen = None
        self._queued_at = None
        self._load_pins = Counter()
        self._reserved = set()
        self._clear_step()


_QUEUED_OPS = frozenset({"Touch", "CompleteLoad", "CompleteStore"})
"""Session calls queued by the client (``queue_completions``)."""
_ANSWERED_OPS = frozenset({"Lookup", "PrepareLoad", "PrepareStore", "Flush"})
"""Session calls that send the queue with them."""
_SESSION_OPS = _QUEUED_OPS | _ANSWERED_OPS
"""Calls whose round trips the session counts (``Session.rpcs``)."""
_NOT_WORK = frozenset({"Flush", "GetStats"})
"""Calls that do not make a step busy (they only send earlier work, or read gauges)."""


def _primary_tier(response: Any) -> Any:
    if response is None:
        return None
    for pool in response.pools:
        for tier in pool.tiers:
            if tier.tier == "primary":
                return tier
    return None


def default_client_name(role: str) -> str:
    return f"vllm-{role}/pid{os.getpid()}"
