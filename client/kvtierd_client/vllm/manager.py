"""The scheduler side: vLLM's ``OffloadingManager`` served by kvtierd over gRPC.

Every decision (which keys are present, which rows to write, what to evict) is
the daemon's; this class translates vLLM's per-key calls into batched RPCs of one
session and keeps only bookkeeping that makes the translation safe, in four parts:

* :mod:`~kvtierd_client.vllm.step_cache`: this step's lookup answers and the
  lookup pins behind the HITs (claimed by ``prepare_load`` in the same step, or
  released unused at ``on_schedule_end``);
* :mod:`~kvtierd_client.vllm.holdings`: load pins, reservations, and the graves
  ``reset_cache`` leaves (released at vLLM 0.33's ``on_reset_flushed``, or two
  steps later with 0.32);
* :mod:`~kvtierd_client.vllm.store_ahead`: the stores a lookup's round trip
  asked ahead, claimed by ``prepare_store`` (in the step, or right after its
  end with vLLM 0.32's call order: :mod:`~kvtierd_client.vllm.compat`);
* :mod:`~kvtierd_client.vllm.connection`: session generations, reconnects and
  the failure model (a daemon that does not answer serves misses for
  ``retry_interval``; a forgotten session starts a new generation);
* :mod:`~kvtierd_client.vllm.accounting`: counters, scheduler steps and round
  trips (one per scheduler step in the steady state).

A lookup that is not answered from the step cache is *one* round trip:
``Session.lookup_and_pin(keys, prefix=True)`` of the request's next keys, after the
queued completions; the daemon answers and pins the leading run of HITs in the
same op. ``prepare_load`` of keys this step's lookups pinned costs nothing (it
claims the pins); only keys looked up in an earlier step are pinned by a
``PrepareLoad`` of their own. ``prepare_store`` is one round trip (carrying
whatever is queued); completions are queued by the session.

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
``get_stats``; a step is one ``on_schedule_end``. With vLLM 0.33, ``config_info``
feeds ``vllm:kv_offload_config_info`` (pool, address, row size, capacity).

Runs in vLLM's scheduler thread only; not thread-safe.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any

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
from kvtierd_client.engine_events import Describer
from kvtierd_client.errors import KvtierError
from kvtierd_client.types import BlockDescription
from kvtierd_client.vllm.accounting import (
    METRIC_NAMES,
    CounterReport,
    ManagerCounters,
    StepAccounting,
    StepStats,
)
from kvtierd_client.vllm.common import KvtierdLoadStoreSpec, RegionIdentity, log, open_session_on
from kvtierd_client.vllm.compat import VllmCalls
from kvtierd_client.vllm.connection import DaemonConnection, Generation
from kvtierd_client.vllm.holdings import GRAVE_STEPS, Holdings
from kvtierd_client.vllm.settings import PluginSettings, PoolPlan
from kvtierd_client.vllm.step_cache import StepCache
from kvtierd_client.vllm.store_ahead import StoreAhead
from kvtierd_client.wire.proto import pb2
from kvtierd_client.wire.results import LookupResult as DaemonLookup
from kvtierd_client.wire.results import StoreResult

__all__ = [
    "CONFIG_INFO_KEYS",
    "KvtierdOffloadingManager",
    "ManagerCounters",
    "METRIC_NAMES",
    "StepStats",
]

CONFIG_INFO_KEYS = (
    "kvtierd_pool",
    "kvtierd_address",
    "kvtierd_block_bytes",
    "kvtierd_capacity_blocks",
    "kvtierd_capacity_bytes",
    "kvtierd_store_ahead",
)
"""Labels of ``vllm:kv_offload_config_info`` (vLLM 0.33+) the manager fills."""

_RESULTS = {
    DaemonLookup.MISS: LookupResult.MISS,
    DaemonLookup.HIT: LookupResult.HIT,
    DaemonLookup.HIT_PENDING: LookupResult.HIT_PENDING,
    DaemonLookup.RETRY: LookupResult.RETRY,
}
"""kvtierd's LookupResult -> vLLM's, one to one."""


class KvtierdOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over one kvtierd session (see the module docstring).

    ``client`` and ``session`` are owned from here on (closed by :meth:`shutdown`).
    ``counters``: counts since start (``ManagerCounters``). ``calls``: how the
    vLLM driving it calls it (default: the installed vLLM's). ``describer``: with
    ``kvtierd_events = "daemon"``, what describes its stores (owned: closed by
    :meth:`shutdown`; :mod:`~kvtierd_client.vllm.descriptions`).
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
        calls: VllmCalls | None = None,
        describer: Describer | None = None,
    ) -> None:
        self._settings = settings
        self.describer = describer
        self._calls = VllmCalls.installed() if calls is None else calls
        self._plan = plan
        self._events_enabled = events_enabled
        self.counters = ManagerCounters()
        self._report = CounterReport(self.counters)
        self._accounting = StepAccounting()
        self._cache = StepCache()  # cleared by on_schedule_end and by a lost session
        # stores asked ahead: claimed by the prepare_store calls of the step, which
        # vLLM 0.32 makes after on_schedule_end, 0.33 before it
        self._ahead = StoreAhead(lifetime=1 if self._calls.schedule_end_last else 2)
        self._holdings = Holdings()
        self._daemon = DaemonConnection(
            client,
            session,
            functools.partial(
                open_session_on,
                client,
                settings,
                plan,
                client_name,
                queue_completions=True,
                timeout=settings.timeout,
            ),
            pool_name=plan.name,
            retry_interval=settings.retry_interval,
            counters=self.counters,
            accounting=self._accounting,
            on_session_lost=self._session_lost,
        )
        self._next_stats = 0.0  # monotonic time of the next GetStats
        first = self._daemon.generation
        assert first is not None  # the connection starts with the session given
        region = first.region
        self._config_info: dict[str, str | int | float | bool] = {
            "kvtierd_pool": plan.name,
            "kvtierd_address": settings.address,
            "kvtierd_block_bytes": region.block_bytes,
            "kvtierd_capacity_blocks": region.num_blocks,
            "kvtierd_capacity_bytes": region.block_bytes * region.num_blocks,
            "kvtierd_store_ahead": settings.store_ahead,
        }  # fixed for the manager's lifetime, as vLLM requires

    # -- vLLM's OffloadingManager API ------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT only for a key this manager holds a pin on in this step (see module doc)."""
        result = self._cache.get(key)
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
        gen = self._daemon.generation
        rows = {} if gen is None else self._cache.claim(keys)
        self._holdings.pinned(rows)
        missing = [k for k in dict.fromkeys(keys) if k not in rows]
        if missing:
            got = None if gen is None else self._pin(gen, missing)
            if got is None or self._daemon.generation is not gen:
                log.error(
                    "kvtierd: cannot pin %d of %d blocks to load for request %s; the load "
                    "job will be reported failed", len(missing), len(keys), req_context.req_id,
                )  # fmt: skip
                return KvtierdLoadStoreSpec([-1] * len(keys), None, valid=False)
            rows.update(zip(missing, got, strict=True))
            self._holdings.pinned(missing)
        assert gen is not None
        return gen.spec([rows[k] for k in keys])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        gen = self._daemon.usable()
        unique = list(dict.fromkeys(keys))
        if gen is not None and unique:
            self._daemon.call(gen, "Touch", gen.session.touch, unique)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Releases this generation's load pins on ``keys`` (older ones died with their
        session). With a describer, the keys it has not described wait for vLLM's
        GPU events of their blocks (described at a later step end)."""
        if self.describer is not None:
            self.describer.late.loaded(keys)
        mine = self._holdings.unpin(keys)
        gen = self._daemon.generation
        if gen is not None and mine:
            self._daemon.call(gen, "CompleteLoad", gen.session.complete_load, mine, quiet=True)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Rows reserved for the keys the daemon does not hold yet; None when the
        daemon has no room now (``accepted=false``) or cannot be reached."""
        gen = self._daemon.usable()
        unique = list(dict.fromkeys(keys))
        if gen is None or not unique:
            return None
        claim = self._ahead.claim(unique)  # asked ahead by the request's lookup
        ask = unique if claim is None else claim.ask
        to_store: list[bytes] = [] if claim is None else claim.keys_to_store
        rows: list[int] = [] if claim is None else claim.rows
        evicted: list[bytes] = [] if claim is None else claim.evicted
        if ask:
            grant = self._daemon.call(
                gen, "PrepareStore", gen.session.prepare_store, ask, req_context.req_id
            )
            if grant is None:  # refused (no room) or failed: all or nothing
                if to_store:
                    complete = gen.session.complete_store
                    self._daemon.call(gen, "CompleteStore", complete, to_store, False, quiet=True)
                return None
            self._ahead.note_absent(grant.evicted_keys)
            to_store = [*to_store, *grant.keys_to_store]
            rows = [*rows, *grant.block_ids]
            evicted = [*evicted, *grant.evicted_keys]
        self._holdings.reserve(to_store)
        self._cache.forget((*to_store, *evicted))
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in to_store],
            store_spec=gen.spec(rows),
            evicted_keys=[OffloadKey(k) for k in evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Completes this generation's reservations among ``keys``; others are ignored.
        With a describer, each stored key goes with its blocks' tokens and hashes
        (or undescribed, when vLLM's GPU events did not give them)."""
        mine = self._holdings.complete(keys)
        self._cache.forget(mine)
        if not success:
            self._ahead.note_absent(mine)  # a grant that saw them present is wrong now
        gen = self._daemon.generation
        if gen is not None and mine:
            described = None
            if success and self.describer is not None:
                described = self.describer.describe(mine)
            self._daemon.call(
                gen, "CompleteStore", _complete_store, gen.session, mine, success, described,
                quiet=True,
            )  # fmt: skip

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The pool's events since the last take (every engine sharing the pool), or
        nothing when vLLM's KV events are off (then nobody drains them) or the
        daemon publishes them (``kvtierd_events = "daemon"``: vLLM must not publish
        them again, and could only as token-less placeholders)."""
        gen = self._daemon.usable()
        if not self._events_enabled or self._settings.events == "daemon" or gen is None:
            return ()
        events = self._daemon.call(gen, "TakeEvents", gen.session.take_events) or []
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
        step's answers; gives back the rows asked ahead whose grants end (queued);
        describes the loaded keys vLLM's events now describe (queued); sends the
        completions that waited a whole step; ends the step's round-trip count."""
        self._accounting.step += 1
        unclaimed = self._cache.unclaimed()
        self._cache.clear()
        gen = self._daemon.generation
        if unclaimed and gen is not None:
            self.counters.lookup_pins_released += len(unclaimed)
            self._daemon.release_pins(gen, unclaimed, unused=True)
        self._give_back(gen, self._ahead.end_step())
        self._describe_loaded(gen)
        self._bury_due()
        if self._accounting.queue_overdue():
            self._daemon.send_queued()
        self._accounting.end_step(self._daemon.live_session_rpcs())

    def has_pending_work(self) -> bool:
        """True while graves wait for their release, or rows asked ahead for a step
        end (vLLM 0.32's order): vLLM keeps stepping, so both are given back."""
        return self._holdings.has_graves or bool(self._ahead.live)

    def reset_cache(self) -> None:
        """Flushes the pool in the daemon (every engine's ready, unpinned blocks).
        What the jobs in flight hold is buried until vLLM's ``on_reset_flushed``
        (0.33), or for ``GRAVE_STEPS`` steps (0.32)."""
        gen = self._daemon.generation
        if gen is not None:
            on_flushed = self._calls.reset_flushed  # else released after GRAVE_STEPS
            self._holdings.bury(
                None if on_flushed else self._accounting.step + GRAVE_STEPS, gen.number
            )
            unclaimed = self._cache.unclaimed()
            if unclaimed:
                self._daemon.release_pins(gen, unclaimed, unused=True)
        self._give_back(gen, self._ahead.take_unclaimed())
        self._holdings.forget()
        self._cache.clear()
        gen = self._daemon.usable()
        if gen is not None:
            self._daemon.send_queued()  # the flush must see the pins released above
            self._daemon.call(gen, "FlushPool", self._daemon.client.flush_pool, self._plan.name)

    def on_reset_flushed(self) -> None:
        """vLLM 0.33+: the workers reported every job in flight at the resets so far,
        so nothing writes or reads the rows those jobs held: releases the graves
        (queued)."""
        gen = self._daemon.generation
        for grave in self._holdings.flushed():
            self._daemon.release_grave(grave, gen)

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        """vLLM 0.33+: the labels of ``vllm:kv_offload_config_info`` (one series;
        :data:`CONFIG_INFO_KEYS`), fixed at start."""
        return [dict(self._config_info)]

    def get_stats(self) -> Any:
        """Counter deltas since the last call, plus the pool's gauges every
        ``stats_interval`` seconds (one GetStats RPC)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, delta, labels in self._report.deltas(self.step_stats()):
            stats.increase_counter(name, delta, labels)
        now = time.monotonic()
        gen = self._daemon.usable()
        if gen is not None and self._settings.stats_interval > 0 and now >= self._next_stats:
            self._next_stats = now + self._settings.stats_interval
            client = self._daemon.client
            primary = _primary_tier(
                self._daemon.call(gen, "GetStats", client.get_stats, self._plan.name)
            )
            if primary is not None:
                stats.set_gauge(METRIC_NAMES["used_blocks"], primary.used_blocks)
                stats.set_gauge(METRIC_NAMES["capacity_blocks"], primary.capacity_blocks)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Closes the session (the daemon releases its pins and aborts its
        reservations) and stops listening to vLLM's KV events."""
        if self.describer is not None:
            self.describer.close()
        self._daemon.close()

    # -- statistics ------------------------------------------------------------------

    @property
    def region(self) -> RegionIdentity | None:
        """The region of the current generation (None while disconnected)."""
        gen = self._daemon.generation
        return None if gen is None else gen.region

    @property
    def pool_name(self) -> str:
        return self._plan.name

    @property
    def client(self) -> Client:
        """The manager's client (owned by the manager: do not close it)."""
        return self._daemon.client

    @property
    def step_round_trips(self) -> deque[int]:
        """Round trips of each recent scheduler step (``on_schedule_end`` to the next)."""
        return self._accounting.step_round_trips

    def step_stats(self) -> StepStats:
        """Scheduler steps and daemon round trips so far (subtract two for a window)."""
        return self._accounting.stats(self._daemon.live_session_rpcs())

    # -- helpers ---------------------------------------------------------------------

    def _pin(self, gen: Generation, keys: list[bytes]) -> list[int] | None:
        """``PrepareLoad`` of ``keys``: their rows, or None when that failed."""
        return self._daemon.call(gen, "PrepareLoad", gen.session.prepare_load, keys)

    def _lookup_batch(self, key: bytes, ctx: ReqContext) -> LookupResult:
        """Asks the daemon about ``key`` and the request's next keys (one round trip,
        which also asks their store ahead: ``store_ahead``), keeps the pins of the
        leading HIT run and caches the answers for the step."""
        positions = getattr(ctx, "_offload_key_positions", None)  # vLLM's, per request
        batch = [key, *self._cache.following_keys(key, positions)]
        answered = self._lookup_rpc(batch, ctx.req_id)
        if answered is None:
            return LookupResult.MISS
        answers, rows, grant = answered
        results = self._unreserved([_RESULTS[a] for a in answers], batch)
        first = self._cache.record(batch, results, rows)
        if grant is not None:
            # the reserved keys keep their MISS answers (vLLM's scan stops at the first
            # one; what asking at prepare_store time would answer); victims are gone
            self._ahead.add(batch, grant.keys_to_store, grant.block_ids, grant.evicted_keys)
            self._cache.forget(grant.evicted_keys)
        return first

    def _unreserved(self, results: list[LookupResult], batch: list[bytes]) -> list[LookupResult]:
        """``results`` as they were before this step's stores asked ahead: a key they
        reserved and nobody claimed is absent to vLLM (MISS, not HIT_PENDING), and so
        is every key after it in the prefix chain."""
        reserved = self._ahead.reserved
        if reserved:
            for i, key in enumerate(batch):
                if key in reserved and results[i] is LookupResult.HIT_PENDING:
                    return results[:i] + [LookupResult.MISS] * (len(results) - i)
        return results

    def _lookup_rpc(
        self, batch: list[bytes], req_id: str
    ) -> tuple[list[DaemonLookup], list[int], StoreResult | None] | None:
        """``Session.lookup_and_pin(batch, prefix=True)``: one round trip (a ``Batch``
        of the queued completions, if any, then the ``Lookup``, and with
        ``store_ahead`` a ``PrepareStore`` of ``batch``) that pins the leading HITs
        for this session; the answers and the rows, co-indexed with ``batch`` (-1
        where not pinned), and the store grant (None: not asked, refused or
        failed). A session the daemon forgot (restart) is replaced and asked again
        at once. None when the daemon cannot answer."""
        for _ in range(2):
            gen = self._daemon.usable()
            if gen is None:
                return None
            if self._settings.store_ahead:
                got = self._daemon.call(
                    gen, "Lookup", _lookup_and_store_ahead, gen.session, batch, req_id
                )
            else:
                pinned = self._daemon.call(
                    gen, "Lookup", gen.session.lookup_and_pin, batch, req_id, prefix=True
                )
                got = None if pinned is None else (*pinned, None)
            if got is not None and self._daemon.generation is gen:
                return got
            if self._daemon.generation is not None:  # failed, but not by a lost session
                return None
        return None

    def _give_back(self, gen: Generation | None, unclaimed: list[bytes]) -> None:
        """Frees rows stores asked ahead reserved and nobody claimed (queued)."""
        if unclaimed and gen is not None:
            complete = gen.session.complete_store
            self._daemon.call(gen, "CompleteStore", complete, unclaimed, False, quiet=True)

    def _describe_loaded(self, gen: Generation | None) -> None:
        """Queues a ``CompleteStore`` of the loaded keys now described: the daemon
        ignores the completion of a ready key and keeps the description (the first
        wins), announcing the key where it is. Never a key this generation reserved
        (completing it would make its rows readable before they are written): the
        queue reaches the daemon before any later ``PrepareStore``, so a key
        reserved after this call is reserved after the completion too."""
        late = None if self.describer is None else self.describer.late
        if late is None or gen is None or not late.waiting:
            return
        keys, descriptions = late.take(busy=self._holdings.reserved | self._ahead.reserved)
        if keys:
            self._daemon.call(
                gen, "CompleteStore", _complete_store, gen.session, keys, True, descriptions,
                quiet=True,
            )  # fmt: skip

    def _bury_due(self) -> None:
        """Releases the graves due at this step (against the generation that dug them)."""
        gen = self._daemon.generation
        for grave in self._holdings.due(self._accounting.step):
            self._daemon.release_grave(grave, gen)

    def _session_lost(self) -> None:
        """The daemon forgot the session: its pins and reservations died with it."""
        self._holdings.forget()
        self._cache.clear()
        self._ahead.clear()


def _complete_store(
    session: Session,
    keys: list[bytes],
    success: bool,
    descriptions: Sequence[BlockDescription | None] | None,
) -> None:
    """``Session.complete_store``, with the descriptions when there are any."""
    if descriptions is None:
        session.complete_store(keys, success)
    else:
        session.complete_store(keys, success, descriptions=descriptions)


def _lookup_and_store_ahead(
    session: Session, batch: list[bytes], req_id: str
) -> tuple[list[DaemonLookup], list[int], StoreResult | None]:
    """One ``Batch``: the pinning prefix ``Lookup`` of ``batch``, then a
    ``PrepareStore`` of the same keys (store_ahead). Raises the lookup's error; a
    failed or refused store is None (vLLM's ``prepare_store`` then asks)."""
    looked, stored = session.batch(
        [
            ("lookup_and_pin", batch, {"request_id": req_id, "prefix": True}),
            ("prepare_store", batch, {"request_id": req_id}),
        ]
    )
    if isinstance(looked, KvtierError):
        raise looked
    results, rows = looked
    grant = stored if isinstance(stored, StoreResult) else None
    return results, rows, grant


def _primary_tier(response: Any) -> Any:
    if response is None:
        return None
    for pool in response.pools:
        for tier in pool.tiers:
            if tier.tier == "primary":
                return tier
    return None
