"""Prometheus metrics (DESIGN.md §9): names prefixed ``kvtierd_``, labels ``pool``
and ``tier`` where they apply. The README's metrics table documents each one.

Two kinds of source:

* *state read at scrape time* (:class:`DaemonCollector`): counters and gauges
  converted from each pool's :meth:`kvtierd.pool.Pool.statistics` snapshot (the
  one GetStats converts too, so both always tell the same numbers) and from the
  sessions. Nothing is added to the request path for them.
* *observations* (histograms and the RPC counter): recorded as they happen
  through :meth:`Metrics.observe_rpc` and :meth:`Metrics.observe_job`.

The HTTP endpoint runs on the daemon's event loop (``asyncio.start_server``),
so a scrape reads pool state on the same thread that mutates it: a scrape is
always a consistent snapshot, and no lock is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvtierd import __version__
from kvtierd.contract import PRIMARY_TIER

if TYPE_CHECKING:
    from kvtierd.pool import PoolStatistics, SecondaryStatistics
    from kvtierd.pools import PoolTable
    from kvtierd.sessions import SessionTable

log = logging.getLogger("kvtierd.metrics")

RPC_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0)
LAG_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0, 5.0)
JOB_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    """The daemon's registry: observed histograms plus the scrape-time collector."""

    def __init__(self, pools: PoolTable, sessions: SessionTable) -> None:
        disable_created_metrics()  # process-wide: no *_created series, only the values
        self.registry = CollectorRegistry(auto_describe=True)
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
        self.registry.register(DaemonCollector(pools, sessions))

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag_seconds.observe(seconds)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_requests.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def observe_job(self, pool: str, tier: str, is_promotion: bool, seconds: float) -> None:
        kind = "promotion" if is_promotion else "store"
        self.job_seconds.labels(pool, tier, kind).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
        yield from _PoolFamilies(self._pools).collect()


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class _PoolFamilies:
    """One family per per-pool metric, filled pool by pool, tier by tier."""

    def __init__(self, pools: PoolTable) -> None:
        self._pools = pools
        pt = ["pool", "tier"]
        self.region = GaugeMetricFamily(
            "kvtierd_region_bytes", "Bytes of the pool's shared-memory region", labels=["pool"]
        )
        self.sessions = GaugeMetricFamily(
            "kvtierd_pool_sessions", "Sessions attached to the pool", labels=["pool"]
        )
        self.lookups = CounterMetricFamily(
            "kvtierd_lookups", "Keys looked up, by answer", labels=["pool", "result"]
        )
        self.hits = CounterMetricFamily(
            "kvtierd_hit_blocks",
            "Primary: keys answered HIT; secondary: blocks promoted from the tier",
            labels=pt,
        )
        self.misses = CounterMetricFamily(
            "kvtierd_miss_blocks",
            "Primary: keys answered MISS; secondary: primary misses the tier did not serve",
            labels=pt,
        )
        self.retries = CounterMetricFamily(
            "kvtierd_retry_blocks",
            "Primary: keys answered RETRY; secondary: primary misses the tier could not answer yet",
            labels=pt,
        )
        self.used = GaugeMetricFamily("kvtierd_blocks_used", "Blocks held by the tier", labels=pt)
        self.capacity = GaugeMetricFamily(
            "kvtierd_blocks_capacity", "Blocks the tier can hold", labels=pt
        )
        self.used_bytes = GaugeMetricFamily(
            "kvtierd_used_bytes", "Bytes held by the tier (this pool)", labels=pt
        )
        self.capacity_bytes = GaugeMetricFamily(
            "kvtierd_capacity_bytes",
            "Byte capacity of the tier (fs: shared by its pools)",
            labels=pt,
        )
        self.stored = CounterMetricFamily(
            "kvtierd_stored_bytes", "Bytes stored into the tier", labels=pt
        )
        self.loaded = CounterMetricFamily(
            "kvtierd_loaded_bytes",
            "Bytes loaded out of the tier (primary: pins released by CompleteLoad as loads)",
            labels=pt,
        )
        self.unused_pins = CounterMetricFamily(
            "kvtierd_unused_pins",
            "Primary pins released by CompleteLoad with unused (nobody read the rows)",
            labels=["pool"],
        )
        self.failed = CounterMetricFamily(
            "kvtierd_failed_blocks",
            "Primary: stores aborted; secondary: blocks the tier failed to write or read",
            labels=pt,
        )
        self.evictions = CounterMetricFamily(
            "kvtierd_evictions", "Blocks evicted from the tier", labels=pt
        )
        self.pinned = GaugeMetricFamily(
            "kvtierd_pinned_blocks", "Primary blocks pinned by readers", labels=["pool"]
        )
        self.pending = GaugeMetricFamily(
            "kvtierd_pending_blocks", "Primary blocks with a write in flight", labels=["pool"]
        )
        self.quarantined = GaugeMetricFamily(
            "kvtierd_quarantined_blocks",
            "Primary rows of stores an ended session left unfinished, not yet reusable",
            labels=["pool"],
        )
        jobs = ["pool", "tier", "kind"]
        self.jobs_started = CounterMetricFamily(
            "kvtierd_tier_jobs_started",
            "Tier jobs submitted (kind: cascade, promotion)",
            labels=jobs,
        )
        self.jobs_finished = CounterMetricFamily(
            "kvtierd_tier_jobs_finished", "Tier jobs that succeeded", labels=jobs
        )
        self.jobs_failed = CounterMetricFamily(
            "kvtierd_tier_jobs_failed", "Tier jobs that failed (in part or whole)", labels=jobs
        )
        self.jobs_in_flight = GaugeMetricFamily(
            "kvtierd_tier_jobs_in_flight", "Tier jobs submitted and not yet reported", labels=pt
        )
        self.promoted = CounterMetricFamily(
            "kvtierd_promoted_blocks", "Blocks promoted into the primary, by outcome",
            labels=["pool", "tier", "outcome"],
        )  # fmt: skip
        self.no_room = CounterMetricFamily(
            "kvtierd_promotion_no_room", "Tier hits not promoted: no primary row", labels=pt
        )
        self.cascaded = CounterMetricFamily(
            "kvtierd_cascade_blocks", "Blocks handed to the tier by cascades", labels=pt
        )
        self.dropped = CounterMetricFamily(
            "kvtierd_dropped_writes", "Cascade blocks dropped by backpressure", labels=pt
        )
        self.checksum = CounterMetricFamily(
            "kvtierd_checksum_failures", "Block files that failed verification", labels=pt
        )
        self.queue_jobs = GaugeMetricFamily(
            "kvtierd_queue_depth_jobs", "Jobs queued on the tier's I/O threads", labels=pt
        )
        self.queue_bytes = GaugeMetricFamily(
            "kvtierd_queue_bytes", "Cascade bytes queued on the tier's I/O threads", labels=pt
        )

    def collect(self) -> Iterator[Metric]:
        for pool in self._pools:
            stats = pool.statistics()
            self._primary(stats)
            for secondary in stats.secondaries:
                self._secondary(stats.spec.name, secondary)
        yield from (value for value in vars(self).values() if isinstance(value, Metric))

    def _primary(self, stats: PoolStatistics) -> None:
        name = stats.spec.name
        primary = stats.primary
        labels = [name, PRIMARY_TIER]
        self.region.add_metric([name], stats.region_bytes)
        self.sessions.add_metric([name], stats.sessions)
        answers = {
            "hit": primary.hits,
            "hit_pending": primary.hits_pending,
            "miss": primary.misses,
            "retry": primary.retries,
        }
        for result, count in answers.items():
            self.lookups.add_metric([name, result], count)
        self.hits.add_metric(labels, primary.hits)
        self.misses.add_metric(labels, primary.misses)
        self.retries.add_metric(labels, primary.retries)
        self.used.add_metric(labels, primary.used_blocks)
        self.capacity.add_metric(labels, primary.capacity_blocks)
        self.used_bytes.add_metric(labels, primary.used_blocks * primary.block_bytes)
        self.capacity_bytes.add_metric(labels, primary.capacity_blocks * primary.block_bytes)
        self.stored.add_metric(labels, primary.bytes_in)
        self.loaded.add_metric(labels, primary.bytes_out)
        self.unused_pins.add_metric([name], primary.unused_pins)
        self.failed.add_metric(labels, primary.stores_aborted)
        self.evictions.add_metric(labels, primary.evictions)
        self.pinned.add_metric([name], primary.pinned_blocks)
        self.pending.add_metric([name], primary.pending_blocks)
        self.quarantined.add_metric([name], primary.quarantined_blocks)

    def _secondary(self, pool: str, secondary: SecondaryStatistics) -> None:
        stats, jobs = secondary.tier, secondary.counters
        labels = [pool, stats.name]
        self.hits.add_metric(labels, jobs.hits)
        self.misses.add_metric(labels, jobs.misses)
        self.retries.add_metric(labels, jobs.retries)
        self.used.add_metric(labels, stats.blocks)
        self.capacity.add_metric(labels, stats.capacity_bytes // stats.bytes_per_block)
        self.used_bytes.add_metric(labels, stats.used_bytes)
        self.capacity_bytes.add_metric(labels, stats.capacity_bytes)
        self.stored.add_metric(labels, stats.bytes_written)
        self.loaded.add_metric(labels, stats.bytes_read)
        self.failed.add_metric(labels, stats.store_failures + stats.load_failures)
        self.evictions.add_metric(labels, stats.evictions)
        for kind in ("cascade", "promotion"):
            job_labels = [*labels, kind]
            self.jobs_started.add_metric(job_labels, getattr(jobs, f"{kind}_jobs_started"))
            self.jobs_finished.add_metric(job_labels, getattr(jobs, f"{kind}_jobs_finished"))
            self.jobs_failed.add_metric(job_labels, getattr(jobs, f"{kind}_jobs_failed"))
        self.jobs_in_flight.add_metric(labels, jobs.jobs_in_flight)
        self.promoted.add_metric([*labels, "loaded"], jobs.promotion_blocks_loaded)
        self.promoted.add_metric([*labels, "failed"], jobs.promotion_blocks_failed)
        self.no_room.add_metric(labels, jobs.promotion_no_room)
        self.cascaded.add_metric(labels, jobs.cascade_blocks)
        self.dropped.add_metric(labels, jobs.cascade_blocks_dropped)
        self.checksum.add_metric(labels, stats.checksum_failures)
        self.queue_jobs.add_metric(labels, stats.queued_jobs)
        self.queue_bytes.add_metric(labels, stats.queued_bytes)


# ----------------------------------------------------------------------- endpoint


async def serve_metrics(address: str, render: Callable[[], bytes]) -> asyncio.Server:
    """Serves ``GET /metrics`` on ``HOST:PORT`` from the running loop."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path == "/metrics":
                status, body, ctype = "200 OK", render(), CONTENT_TYPE_LATEST
            elif path == "/":
                status, body, ctype = "200 OK", b"kvtierd: metrics at /metrics\n", "text/plain"
            else:
                status, body, ctype = "404 Not Found", b"not found; try /metrics\n", "text/plain"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, ValueError):  # fmt: skip
            pass  # a broken or slow client; nothing to answer
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, int(port))
