"""Prometheus metrics (docs/operations/metrics.md): names prefixed ``kvtierd_``, labels ``pool``
and ``tier`` where they apply. The metrics table of docs/operations/metrics.md documents each one.

Two kinds of source:

* *state read at scrape time* (:class:`DaemonCollector`): counters and gauges
  converted from each pool's :meth:`kvtierd.core.pool.Pool.statistics` snapshot (the
  one GetStats converts too, so both always tell the same numbers) and from the
  sessions. Nothing is added to the request path for them.
* *observations* (histograms and the RPC counter): recorded as they happen
  through :meth:`Metrics.observe_rpc` and :meth:`Metrics.observe_job`.

A scrape is two steps (``kvtierd.ops.metrics_endpoint`` runs them when its
exporter process asks): ``collect`` reads the state on the daemon's event loop,
the thread that mutates it, so a scrape is always a consistent snapshot without a
lock; ``render`` formats those families and the observations (prometheus_client's
values are thread-safe) into the exposition text on the endpoint's own thread.
``render`` leaves out every sample of a pool that ``PoolLabels`` does not show
(``server.metrics_pool_labels``: with principals, no pool's by default).
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from kvtierd import __version__
from kvtierd.core.statistics import PoolStatistics, TierView, tier_views
from kvtierd.kvevents.service import KvEventsStats
from kvtierd.tiering.admission import REASONS

if TYPE_CHECKING:
    from kvtierd.core.pools import PoolTable
    from kvtierd.core.sessions import SessionTable

RPC_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0)
LAG_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0, 5.0)
JOB_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class PoolLabels:
    """Which pools' series /metrics shows: the pools matching one of ``patterns``
    (``fnmatch`` globs matched against the whole name, ``*`` also matching ``/``,
    as principals' pool patterns are)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        alternatives = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.patterns)
        self._matcher = re.compile(alternatives or "(?!)")
        self.every_pool = "*" in self.patterns

    def shows(self, pool: str) -> bool:
        return self.every_pool or self._matcher.match(pool) is not None


EVERY_POOL = PoolLabels(("*",))


def pool_labels_for(patterns: Sequence[str] | None, principals: bool) -> PoolLabels:
    """``server.metrics_pool_labels``: its patterns, or when unset ("auto") every
    pool without principals and none with them (the endpoint asks no identity:
    any local user reads it, while GetStats tells a principal its own pools only)."""
    if patterns is None:
        patterns = () if principals else ("*",)
    return PoolLabels(patterns)


class Metrics:
    """The daemon's registry: observed histograms plus the scrape-time collector."""

    def __init__(
        self, pools: PoolTable, sessions: SessionTable, pool_labels: PoolLabels = EVERY_POOL
    ) -> None:
        disable_created_metrics()  # process-wide: no *_created series, only the values
        self.pool_labels = pool_labels
        self.registry = CollectorRegistry(auto_describe=True)
        self._rpc_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.rpc_requests = Counter(
            "kvtierd_rpc_requests",
            "gRPC calls handled, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "kvtierd_rpc_duration_seconds",
            "Time the daemon spent handling a gRPC call (excluding transport)",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.job_seconds = Histogram(
            "kvtierd_tier_job_duration_seconds",
            "Duration of secondary-tier jobs from submission to report",
            ["pool", "tier", "kind"],
            buckets=JOB_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag_seconds = Histogram(
            "kvtierd_event_loop_lag_seconds",
            "How late the daemon's event loop ran its 100 ms supervisor tick "
            "(stalls above 0.25 s, or a quarter of a shorter lease, are credited to every lease)",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.collector = DaemonCollector(pools, sessions)

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag_seconds.observe(seconds)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        # the labelled children, looked up once per (method, code): ``labels()``
        # costs more than the fast lane's whole Lookup. Bounded: methods x codes.
        children = self._rpc_children.get((method, code))
        if children is None:
            children = (self.rpc_requests.labels(method, code), self.rpc_seconds.labels(method))
            self._rpc_children[(method, code)] = children
        children[0].inc()
        children[1].observe(seconds)

    def observe_job(self, pool: str, tier: str, is_promotion: bool, seconds: float) -> None:
        kind = "promotion" if is_promotion else "store"
        self.job_seconds.labels(pool, tier, kind).observe(seconds)

    def collect(self) -> list[Metric]:
        """The state's families, fresh objects (event loop only)."""
        return list(self.collector.collect())

    def render(self, state: list[Metric]) -> bytes:
        """The exposition text of ``state`` (from ``collect``) and of the
        observations, pools ``pool_labels`` does not show left out (any thread)."""
        return generate_latest(_Exposition([*state, *self.registry.collect()], self.pool_labels))


class _Exposition:
    """What ``generate_latest`` reads: ``families`` without the samples of the pools
    ``labels`` hides (families left empty keep their HELP and TYPE lines)."""

    def __init__(self, families: list[Metric], labels: PoolLabels) -> None:
        self._families, self._labels = families, labels

    def collect(self) -> Iterator[Metric]:
        shows = self._labels.shows
        for family in self._families:
            if not self._labels.every_pool:
                family.samples = [
                    s for s in family.samples if "pool" not in s.labels or shows(s.labels["pool"])
                ]
            yield family


class DaemonCollector(Collector):
    """Reads pool, tier and session state at scrape time (on the event loop)."""

    def __init__(self, pools: PoolTable, sessions: SessionTable) -> None:
        self._pools = pools
        self._sessions = sessions
        self._started = time.time()

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvtierd_build_info", "kvtierd version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield _gauge("kvtierd_start_time_seconds", "Unix time the daemon started", self._started)
        yield _gauge("kvtierd_sessions_open", "Client sessions open", len(self._sessions))
        yield _gauge("kvtierd_pools", "Pools open", len(self._pools))
        yield _gauge(
            "kvtierd_memory_budget_bytes", "Shared-memory budget", self._pools.budget_bytes
        )
        yield _gauge(
            "kvtierd_memory_used_bytes", "Shared memory used by regions", self._pools.used_bytes
        )
        yield from collect_pool_families(pool.statistics() for pool in self._pools)
        if self._pools.kv_events is not None:
            yield from collect_kv_events_families(self._pools.kv_events.stats())


def collect_kv_events_families(stats: KvEventsStats) -> list[Metric]:
    """The KV-event publisher's counters (``[kv_events]``; kvtierd.kvevents)."""
    publisher = stats.publisher
    counters = (
        ("messages", "KV-event messages sent (one per topic per batch)", publisher.messages),
        ("events", "KV events sent", publisher.events),
        ("refused_items", "hand-overs the queue's bound refused (then AllBlocksCleared)",
         publisher.refused_items),
        ("clears", "AllBlocksCleared sent (one at start, one after each refusal)",
         stats.cleared),
        ("dropped_frames", "hand-overs the publisher's socket buffer refused (then cleared)",
         stats.dropped_frames),
        ("restarts", "publisher processes started again after one ended", stats.restarts),
        ("replays", "replay requests answered", publisher.replays),
        ("dropped_descriptions", "block descriptions the byte bound dropped (withdrawn first)",
         stats.dropped_descriptions),
        ("undescribed_stores", "stores of a key without a description (published nowhere)",
         stats.undescribed_stores),
    )  # fmt: skip
    families: list[Metric] = [
        CounterMetricFamily(f"kvtierd_kv_events_{name}", text, value=value)
        for name, text, value in counters
    ]
    families.append(
        _gauge(
            "kvtierd_kv_events_described_blocks",
            "keys with a description held",
            stats.described_keys,
        )  # fmt: skip
    )
    families.append(
        _gauge(
            "kvtierd_kv_events_description_bytes",
            "bytes the descriptions count",
            stats.description_bytes,
        )  # fmt: skip
    )
    return families


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


@dataclass(frozen=True, slots=True)
class Family:
    """One per-pool metric family: its name (counters without ``_total``), type,
    help, where its values come from and how they are labelled.

    ``source`` names a pool number (:data:`POOL_NUMBERS`) or a tier number
    (:data:`kvtierd.core.statistics.TIER_NUMBERS`); a mapping gives one sample per
    value of the label ``by`` (value -> number). ``scope``: ``"pool"`` (labels
    ``pool``), ``"primary"`` (the primary's number, labels ``pool``) or ``"tier"``
    (labels ``pool``, ``tier``: one sample per tier that has the number).
    """

    name: str
    type: Literal["counter", "gauge"]
    help: str
    source: str | Mapping[str, str]
    scope: Literal["pool", "primary", "tier"] = "tier"
    by: str | None = None  # the label whose values key a mapping ``source``


COUNTER: Literal["counter"] = "counter"
GAUGE: Literal["gauge"] = "gauge"
LOOKUP_ANSWERS = {
    "hit": "hits",
    "hit_pending": "hits_pending",
    "miss": "misses",
    "retry": "retries",
}

# Numbers of a pool itself (not of one of its tiers), from its snapshot.
POOL_NUMBERS: dict[str, Callable[[PoolStatistics], float]] = {
    "region_bytes": lambda stats: stats.region_bytes,
    "sessions": lambda stats: stats.sessions,
    "warm_adopted_blocks": lambda stats: stats.warm_adopted_blocks,
    "warm_dropped_blocks": lambda stats: stats.warm_dropped_blocks,
    "journal_bytes": lambda stats: stats.journal_bytes,
    "journal_lag_seconds": lambda stats: stats.journal_lag_seconds,
    "warm_restart_off": lambda stats: stats.warm_restart_off,
}

# Every per-pool family, in exposition order. docs/operations/metrics.md lists them.
POOL_FAMILIES: tuple[Family, ...] = (
    Family("kvtierd_region_bytes", GAUGE, "Bytes of the pool's shared-memory region",
           "region_bytes", scope="pool"),
    Family("kvtierd_pool_sessions", GAUGE, "Sessions attached to the pool", "sessions",
           scope="pool"),
    Family("kvtierd_warm_adopted_blocks", GAUGE,
           "Blocks adopted from the previous daemon's region when the pool opened "
           "(memory.warm_restart)", "warm_adopted_blocks", scope="pool"),
    Family("kvtierd_warm_dropped_blocks", GAUGE,
           "Blocks of the previous daemon's region dropped when the pool opened: their "
           "checksum did not match", "warm_dropped_blocks", scope="pool"),
    Family("kvtierd_journal_bytes", GAUGE,
           "Bytes of the pool's warm-restart journal in shm_dir", "journal_bytes",
           scope="pool"),
    Family("kvtierd_journal_lag_seconds", GAUGE,
           "Seconds the oldest completed block not yet in the pool's warm-restart journal "
           "has waited (0: none); a block completed longer ago survives a crash "
           "(memory.warm_restart_max_lag)", "journal_lag_seconds", scope="pool"),
    Family("kvtierd_warm_restart_off", GAUGE,
           "1 when memory.warm_restart is on but the pool has no working journal (its "
           "path was taken, or a write failed; one ERROR line says why): its next start "
           "is cold", "warm_restart_off", scope="pool"),
    Family("kvtierd_lookups", COUNTER, "Keys looked up, by answer", LOOKUP_ANSWERS,
           scope="primary", by="result"),
    Family("kvtierd_hit_blocks", COUNTER,
           "Primary: keys answered HIT; secondary: blocks promoted from the tier", "hits"),
    Family("kvtierd_miss_blocks", COUNTER,
           "Primary: keys answered MISS; secondary: primary misses the tier did not serve",
           "misses"),
    Family("kvtierd_retry_blocks", COUNTER,
           "Primary: keys answered RETRY; secondary: primary misses the tier could not "
           "answer yet", "retries"),
    Family("kvtierd_blocks_used", GAUGE, "Blocks held by the tier", "used_blocks"),
    Family("kvtierd_blocks_capacity", GAUGE, "Blocks the tier can hold", "capacity_blocks"),
    Family("kvtierd_used_bytes", GAUGE, "Bytes held by the tier (this pool)", "used_bytes"),
    Family("kvtierd_capacity_bytes", GAUGE,
           "Byte capacity of the tier (fs: shared by its pools)", "capacity_bytes"),
    Family("kvtierd_stored_bytes", COUNTER, "Bytes stored into the tier", "bytes_in"),
    Family("kvtierd_loaded_bytes", COUNTER,
           "Bytes loaded out of the tier (primary: pins released by CompleteLoad as loads)",
           "bytes_out"),
    Family("kvtierd_unused_pins", COUNTER,
           "Primary pins released by CompleteLoad with unused (nobody read the rows)",
           "unused_pins", scope="primary"),
    Family("kvtierd_failed_blocks", COUNTER,
           "Primary: stores aborted; secondary: blocks the tier failed to write or read",
           "failures"),
    Family("kvtierd_evictions", COUNTER, "Blocks evicted from the tier", "evictions"),
    Family("kvtierd_stores_refused", COUNTER,
           "PrepareStore calls refused: no room in the primary (nothing reserved)",
           "stores_refused", scope="primary"),
    Family("kvtierd_pinned_blocks", GAUGE, "Primary blocks pinned by readers", "pinned_blocks",
           scope="primary"),
    Family("kvtierd_pending_blocks", GAUGE, "Primary blocks with a write in flight",
           "pending_blocks", scope="primary"),
    Family("kvtierd_quarantined_blocks", GAUGE,
           "Primary rows of stores an ended session left unfinished, not yet reusable",
           "quarantined_blocks", scope="primary"),
    Family("kvtierd_tier_ready", GAUGE,
           "1 once the secondary tier's index is rebuilt (HIT/MISS answers), 0 before (RETRY)",
           "ready"),
    Family("kvtierd_tier_jobs_started", COUNTER,
           "Tier jobs submitted (kind: cascade, promotion)",
           {"cascade": "cascade_jobs_started", "promotion": "promotion_jobs_started"},
           by="kind"),
    Family("kvtierd_tier_jobs_finished", COUNTER, "Tier jobs that succeeded",
           {"cascade": "cascade_jobs_finished", "promotion": "promotion_jobs_finished"},
           by="kind"),
    Family("kvtierd_tier_jobs_failed", COUNTER, "Tier jobs that failed (in part or whole)",
           {"cascade": "cascade_failures", "promotion": "promotion_jobs_failed"}, by="kind"),
    Family("kvtierd_tier_jobs_in_flight", GAUGE, "Tier jobs submitted and not yet reported",
           "jobs_in_flight"),
    Family("kvtierd_promoted_blocks", COUNTER, "Blocks promoted into the primary, by outcome",
           {"loaded": "promoted_blocks", "failed": "promotion_failures"}, by="outcome"),
    Family("kvtierd_tier_admitted_blocks", COUNTER,
           "Blocks the tier's admission let through to be written (a completed store, a load "
           "of a block it lacked, a promotion from a later tier)", "admitted_blocks"),
    Family("kvtierd_tier_admitted_bytes", COUNTER, "Bytes of the blocks admitted to the tier",
           "admitted_bytes"),
    Family("kvtierd_tier_rejected_blocks", COUNTER,
           "Blocks not written to the tier, by reason (not_reused, infrequent: its admission "
           "policy; budget: its write budget)",
           {reason: f"rejected_{reason}_blocks" for reason in REASONS}, by="reason"),
    Family("kvtierd_tier_rejected_bytes", COUNTER,
           "Bytes of the blocks not written to the tier, by reason",
           {reason: f"rejected_{reason}_bytes" for reason in REASONS}, by="reason"),
    Family("kvtierd_tier_admission_sketch_bytes", GAUGE,
           "Bytes of the tier's admission state for the pool (tinylfu's frequency sketch; "
           "fixed when the pool opens)", "admission_sketch_bytes"),
    Family("kvtierd_promotion_no_room", COUNTER, "Tier hits not promoted: no primary row",
           "promotion_no_room"),
    Family("kvtierd_cascade_blocks", COUNTER, "Blocks handed to the tier by cascades",
           "cascade_blocks"),
    Family("kvtierd_dropped_writes", COUNTER, "Cascade blocks dropped by backpressure",
           "dropped_blocks"),
    Family("kvtierd_checksum_failures", COUNTER, "Block files that failed verification",
           "checksum_failures"),
    Family("kvtierd_integrity_failures", COUNTER,
           "Values or block files not sealed under the tier's integrity keys (refused)",
           "integrity_failures"),
    Family("kvtierd_queue_depth_jobs", GAUGE, "Jobs queued on the tier's I/O threads",
           "queued_jobs"),
    Family("kvtierd_queue_bytes", GAUGE, "Cascade bytes queued on the tier's I/O threads",
           "queued_bytes"),
    Family("kvtierd_remote_nodes", GAUGE,
           "Remote tier: masters known and reachable at the last health check (0: no server)",
           {"known": "nodes_known", "reachable": "nodes_reachable"}, by="state"),
    Family("kvtierd_remote_round_trip_microseconds", GAUGE,
           "Remote tier: running average of small-command round trips (probes, PINGs)",
           "round_trip_us"),
    Family("kvtierd_remote_server_bytes", GAUGE,
           "Remote tier: the server's maxmemory (capacity; 0 unbounded) and used_memory, "
           "summed over masters", {"capacity": "server_capacity_bytes",
                                   "used": "server_used_bytes"}, by="kind"),
    Family("kvtierd_remote_probe_failures", COUNTER,
           "Remote tier: presence probes (per node) that failed", "probe_failures"),
    Family("kvtierd_remote_probes", COUNTER,
           "Remote tier: presence round trips (redis: pipelined EXISTS per node, all pools "
           "of the tier; a shared fs root: batches of header checks)", "probes"),
    Family("kvtierd_remote_lookup_waits", COUNTER,
           "Lookups that waited for a remote tier's answers (limits.remote_lookup_wait)",
           "lookup_waits"),
    Family("kvtierd_remote_lookup_wait_timeouts", COUNTER,
           "Lookups answered before all of a remote tier's answers were in (the wait ran "
           "out: the keys still unknown answered MISS)", "lookup_wait_timeouts"),
    Family("kvtierd_shared_foreign_files", COUNTER,
           "Files other daemons wrote in a shared fs root, found and indexed",
           "foreign_files_found"),
    Family("kvtierd_shared_rechecks", COUNTER,
           "Keys looked for in a shared fs root after a lookup missed the index",
           "shared_rechecks"),
    Family("kvtierd_shared_rescans", COUNTER, "Rescans of a shared fs root's pool directory",
           "shared_rescans"),
    Family("kvtierd_shared_files_vanished", COUNTER,
           "Indexed block files removed by someone else (another daemon, an operator)",
           "shared_files_vanished"),
)  # fmt: skip


def collect_pool_families(snapshots: Iterable[PoolStatistics]) -> list[Metric]:
    """Every family of :data:`POOL_FAMILIES`, filled pool by pool, tier by tier."""
    pools = [(stats, tier_views(stats)) for stats in snapshots]
    return [_family_metric(family, pools) for family in POOL_FAMILIES]


def _family_metric(family: Family, pools: list[tuple[PoolStatistics, list[TierView]]]) -> Metric:
    kind = CounterMetricFamily if family.type == COUNTER else GaugeMetricFamily
    by = [family.by] if family.by is not None else []
    if family.scope == "pool":
        assert isinstance(family.source, str), family.name
        pool_number = POOL_NUMBERS[family.source]
        metric = kind(family.name, family.help, labels=["pool"])
        for stats, _ in pools:
            metric.add_metric([stats.spec.name], pool_number(stats))
        return metric
    source = family.source
    numbers = list(source.items()) if isinstance(source, Mapping) else [(None, source)]
    per_tier = family.scope == "tier"
    metric = kind(family.name, family.help, labels=["pool", *(["tier"] if per_tier else []), *by])
    for stats, views in pools:
        for view in views if per_tier else views[:1]:  # the primary is the first view
            labels = [stats.spec.name, *([view.name] if per_tier else [])]
            for label, number in numbers:
                if number in view.numbers:  # else a number of the other kind of tier
                    value = view.numbers[number]
                    metric.add_metric([*labels, *([label] if label else [])], value)
    return metric
