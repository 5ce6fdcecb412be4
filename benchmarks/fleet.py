"""`make bench-fleet`: N daemons and a real Redis Cluster replay the shipped trace as a fleet.

Usage::

    python -m benchmarks.fleet [--trace PATH] [--nodes 3] [--capacities 0.1,0.3]
        [--routings rr,conversation] [--remotes one,none,C,3C,unbounded]
        [--bounds server,fleet] [--policies] [--before DIR]
        [--fault kill|stop|trickle] [--out FILE]

One run per configuration, each on fresh daemons (this checkout's, or with
``--before DIR`` another checkout's too: its rows sit next to these) and an
emptied cluster. ``C`` is a fraction of the trace's unique blocks (``--capacities``);
every configuration has C blocks of primary in all:

* ``one``: one daemon of C (no shared tier);
* ``none``: N nodes of C/N each, isolated;
* ``C``, ``3C``, ``unbounded``: N nodes of C/N each sharing a 3-master Redis
  Cluster bounded to that many blocks, by the server (``--bounds server``: its
  ``maxmemory`` holds that many blocks, ``allkeys-lru``; the bytes one value costs
  the server are measured first, :meth:`BenchCluster.calibrate`) or by the fleet
  (``--bounds fleet``: the tier's ``fleet_capacity``, an exact LRU the daemons keep
  in the server, under a ``maxmemory`` of half as much again as a backstop that
  should never evict).

Requests go to nodes round-robin (``rr``) or by conversation (their first block);
each node has one engine process (:mod:`benchmarks.fleet_engine`: vLLM's steps,
every loaded row verified against its key). Next to each measured hit rate the
table gives the exact model of the same configuration with synchronous remote
lookups (:mod:`benchmarks.fleet_model`): with an exact LRU for Redis, and with the
server's own eviction (its sampled LRU on a one-second clock at the replay's
speed, its random eviction, or no eviction: the model of the policy the run
used; ``-`` for ``allkeys-lfu``), the replay's wall time, the first
lookup's latency, the lookups that waited for Redis and the presence round trips
per request. ``--policies`` adds runs of Redis = C under other eviction policies
(``maxmemory-samples`` 1 and 10, ``allkeys-lfu``, ``allkeys-random``,
``noeviction``); ``--fault`` kills, stops (SIGSTOP) or slows (a proxy trickling
its answers) one Redis node from a third to two thirds of a round-robin replay
with Redis unbounded (``--fault-remote C`` or ``3C``: bounded as the last of
``--bounds`` says), and reports the lookups' latency and the daemons' fault lines
(before, during and after the fault: each part's first-Lookup latency and hit
rate; each node's WARNING lines). Results go to ``bench-results/fleet.md`` as well,
the daemons' WARNING and ERROR lines to ``bench-results/fleet.warnings.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.common import BenchDaemon, machine, percentile
from benchmarks.fleet_engine import EngineArgs, EngineResult, engine_main
from benchmarks.fleet_model import FleetShape, ModelResult, chain, node_of, simulate
from benchmarks.harnesses import TrickleProxy
from benchmarks.rediscluster import BenchCluster
from benchmarks.replay import DONE, SHIPPED_TRACE, Request, load_trace

BLOCK = 4096
HEADER = 4096  # kvtierd.tiers.blockformat.HEADER_SIZE: a value is header + row
REMOTES = ("one", "none", "C", "3C", "unbounded")
POLICIES = (  # (label, maxmemory-policy, maxmemory-samples): Redis = C, round-robin
    ("allkeys-lru, samples 1", "allkeys-lru", 1),
    ("allkeys-lru, samples 10", "allkeys-lru", 10),
    ("allkeys-lfu", "allkeys-lfu", 5),
    ("allkeys-random", "allkeys-random", 5),
    ("noeviction", "noeviction", 5),
)
BOUNDS = ("server", "fleet")
BACKSTOP = 1.5  # with a fleet bound, the server's maxmemory holds this many times it
STEP_S = 0.005  # an engine asks again after a HIT_PENDING one scheduler step later
MAX_STEPS = 400  # ... at most this many times (2 s)
WINDOW = 3  # a request starts once every other engine reached the one 3 places before
SPEEDUP = 20.0  # requests arrive at their trace time / 20 (the shipped trace: 27 s)


@dataclass(frozen=True)
class Config:
    """One row: a fleet shape on one capacity, with its shared tier's policy, run
    by this checkout's daemons (``before``: ``--before DIR``'s)."""

    fraction: float
    remote: str  # one of REMOTES
    shape: FleetShape
    policy: str = "allkeys-lru"
    samples: int = 5
    before: bool = False
    fault: str = ""
    bound: str = "server"  # who bounds a bounded Redis: the server, or fleet_capacity

    @property
    def fleet_bound(self) -> bool:
        return self.bound == "fleet" and self.shape.remote_blocks is not None

    @property
    def label(self) -> str:
        names = {"one": "one daemon of C", "none": "N isolated nodes"}
        text = names.get(self.remote, f"N nodes + Redis {self.remote}")
        if self.fleet_bound:
            text += " (fleet LRU)"
        elif (self.policy, self.samples) != ("allkeys-lru", 5):
            text += f" ({self.policy}, samples {self.samples})"
        return text + (f", node {self.fault} mid-run" if self.fault else "")


@dataclass
class Outcome:
    config: Config
    model: ModelResult  # exact LRU for the shared tier
    model_server: ModelResult | None  # the server's own eviction (None: no model of it)
    merged: EngineResult
    tier: dict[str, int] = field(default_factory=dict)  # the redis tier, all nodes summed
    server_keys: int = 0
    server_evicted: int = 0
    stop_s: float = 0.0
    log_lines: list[str] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average, start / end

    @property
    def hit_rate(self) -> float:
        m = self.merged
        return m.hits / m.looked_up if m.looked_up else 0.0


def plan(args: argparse.Namespace, unique: int) -> list[Config]:
    """The configurations to run, in order."""
    configs: list[Config] = []
    for fraction in args.capacities:
        c = max(args.nodes, int(unique * fraction) // args.nodes * args.nodes)
        for remote in args.remotes:
            nodes = 1 if remote == "one" else args.nodes
            remote_blocks = {"one": 0, "none": 0, "C": c, "3C": 3 * c, "unbounded": None}[remote]
            routings = ["rr"] if remote == "one" else args.routings
            for routing in routings:
                shape = FleetShape(nodes, c // nodes, remote_blocks, routing)
                if "server" in args.bounds or remote in ("one", "none", "unbounded"):
                    configs.append(Config(fraction, remote, shape))
                if args.before and remote not in ("one", "none"):
                    configs.append(Config(fraction, remote, shape, before=True))
                if "fleet" in args.bounds and remote in ("C", "3C"):
                    configs.append(Config(fraction, remote, shape, bound="fleet"))
        if args.policies:
            shape = FleetShape(args.nodes, c // args.nodes, c, "rr")
            for _, policy, samples in POLICIES:
                configs.append(Config(fraction, "C", shape, policy, samples))
    if args.fault:
        c = int(unique * args.capacities[0]) // args.nodes * args.nodes
        remote_blocks = {"C": c, "3C": 3 * c, "unbounded": None}[args.fault_remote]
        shape = FleetShape(args.nodes, c // args.nodes, remote_blocks, "rr")
        bound = args.bounds[-1] if args.bounds else "server"
        configs.append(
            Config(args.capacities[0], args.fault_remote, shape, fault=args.fault, bound=bound)
        )
    return configs


class Fleet:
    """The daemons of one configuration, started on a cluster reset for it."""

    def __init__(
        self, config: Config, cluster: BenchCluster | None, urls: list[str], args: Any
    ) -> None:
        self.config = config
        self.directory = tempfile.mkdtemp(prefix="kvtb-fleet-")
        env = None
        if config.before:
            env = {**os.environ, "PYTHONPATH": f"{args.before}:{args.before}/client"}
        text = _daemon_config(config, urls, args.wait, args.tier_option)
        path = os.path.join(self.directory, "kvtierd.toml")
        Path(path).write_text(text)
        self.daemons = [
            BenchDaemon("--config", path, "--memory-budget", "256MiB", env=env)
            for _ in range(config.shape.nodes)
        ]

    def stats(self, pool: str) -> tuple[dict[str, int], int]:
        """The redis tier's numbers summed over the nodes, and the primaries' blocks."""
        from kvtierd_client.client import Client

        summed: dict[str, int] = {}
        used = 0
        for daemon in self.daemons:
            with Client(daemon.address, timeout=60) as client:
                tiers = client.get_stats(pool).pools[0].tiers
            used += tiers[0].used_blocks
            for tier in tiers[1:]:
                for name in TIER_FIELDS:
                    summed[name] = summed.get(name, 0) + int(getattr(tier, name, 0))
        return summed, used

    def close(self) -> tuple[float, list[str]]:
        """Stops every daemon; the seconds the slowest stop took and the daemons'
        WARNING and ERROR lines."""
        lines: list[str] = []
        slowest = 0.0
        for node, daemon in enumerate(self.daemons):
            started = time.monotonic()
            daemon.proc.terminate()
            try:
                daemon.proc.wait(120)
            except Exception:
                daemon.proc.kill()
            slowest = max(slowest, time.monotonic() - started)
            log = Path(daemon.workdir, "daemon.log").read_text(errors="replace")
            lines += [f"node {node}: {line}" for line in log.splitlines()
                      if "WARNING" in line or "ERROR" in line]  # fmt: skip
            daemon.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        return slowest, lines


TIER_FIELDS = (
    "probes", "lookup_waits", "lookup_wait_timeouts", "promoted_blocks", "promotion_failures",
    "cascade_blocks", "cascade_failures", "dropped_blocks", "probe_failures", "checksum_failures",
)  # fmt: skip


def _daemon_config(config: Config, urls: list[str], wait: str, options: list[str]) -> str:
    if config.remote in ("one", "none"):
        return "# the primary tier alone\n"
    limits = f'[limits]\nremote_lookup_wait = "{wait}"\n' if wait and not config.before else ""
    quoted = ", ".join(f'"{url}"' for url in urls)
    extra = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in
                    (option.split("=", 1) for option in options))  # fmt: skip
    if config.fleet_bound:  # the tier keeps the bound: C or 3C values
        extra += f"fleet_capacity = {(config.shape.remote_blocks or 0) * (HEADER + BLOCK)}\n"
    return (
        f'{limits}[[tiers]]\ntype = "redis"\nname = "fleet"\nurls = [{quoted}]\n'
        f'cluster = true\nkey_prefix = "kvtb-fleet"\n{extra}'
    )


def run_config(
    config: Config,
    requests: list[Request],
    cluster: BenchCluster | None,
    per_value: float,
    args: Any,
) -> Outcome:
    """One configuration, start to stop."""
    load_before = os.getloadavg()[0]
    proxy = None
    urls = cluster.urls if cluster else []
    if cluster is not None:
        blocks = config.shape.remote_blocks
        data_per_node = math.ceil(blocks / len(cluster.nodes) * per_value) if blocks else 0
        if config.fleet_bound:
            data_per_node = math.ceil(data_per_node * BACKSTOP)
        cluster.reset(data_per_node, config.policy, config.samples)
        if config.fault == "trickle":  # every client reaches node 0 through the proxy
            proxy = TrickleProxy(cluster.nodes[0].port, trickle_s=0.2)
            cluster.announce(cluster.nodes[0], proxy.port)
    fleet = Fleet(config, cluster, urls, args)
    try:
        pool = f"fleet/{config.shape.routing}/{config.remote}"
        merged = _replay(fleet, config, requests, pool, args, cluster, proxy)
        tier, _ = fleet.stats(pool)
    finally:
        stop_s, lines = fleet.close()
        if proxy is not None and cluster is not None:
            cluster.announce(cluster.nodes[0], None)
            proxy.close()
    server = None
    if config.shape.remote_blocks and config.policy != "allkeys-lfu" and not config.fleet_bound:
        server = simulate(requests, config.shape, (config.policy, config.samples), args.speedup)
    outcome = Outcome(config, simulate(requests, config.shape), server, merged, tier, stop_s=stop_s)
    outcome.log_lines = lines
    outcome.load = (load_before, os.getloadavg()[0])
    if cluster is not None and config.remote not in ("one", "none"):
        outcome.server_keys, outcome.server_evicted = cluster.keys(), cluster.evicted()
    return outcome


def _replay(
    fleet: Fleet,
    config: Config,
    requests: list[Request],
    pool: str,
    args: Any,
    cluster: BenchCluster | None,
    proxy: TrickleProxy | None,
) -> EngineResult:
    nodes = config.shape.nodes
    queues: list[list[tuple[int, float, list[bytes]]]] = [[] for _ in range(nodes)]
    origin = requests[0].timestamp if requests else 0.0
    for request in requests:
        keys = [h.to_bytes(8, "big") for h in chain(request)]
        item = (request.index, request.timestamp - origin, keys)
        queues[node_of(request, nodes, config.shape.routing)].append(item)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(nodes + 1), ctx.Queue()
    progress = ctx.Array("q", [0] * nodes, lock=False)
    start = ctx.Value("d", 0.0, lock=False)  # trace time 0, set once every session is open
    procs = []
    for engine in range(nodes):
        engine_args = EngineArgs(
            fleet.daemons[engine].address, engine, pool, BLOCK, config.shape.node_blocks,
            queues[engine], WINDOW, STEP_S, MAX_STEPS, args.speedup,
        )  # fmt: skip
        proc = ctx.Process(
            target=engine_main, args=(engine_args, barrier, progress, start, results)
        )
        proc.start()
        procs.append(proc)
    injector = None
    merged = EngineResult()
    try:
        barrier.wait(600)  # every session open
        start.value = time.monotonic() + 0.1
        barrier.wait(600)
        if config.fault:
            injector = _Fault(config.fault, cluster, proxy, progress, len(requests))
        for _ in procs:
            merged.merge(results.get(timeout=3600)[1])
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():  # interrupted, or an engine failed: not left behind
                proc.terminate()
                proc.join(10)
        if injector is not None:
            injector.stop()
    return merged


class _Fault:
    """Kills, stops or slows node 0 of the cluster from a third to two thirds of
    the replay (by the engines' progress), then heals it."""

    def __init__(
        self, kind: str, cluster: BenchCluster | None, proxy: TrickleProxy | None,
        progress: Any, total: int,
    ) -> None:  # fmt: skip
        assert cluster is not None
        self.kind, self.cluster, self.proxy = kind, cluster, proxy
        self.progress, self.total = progress, total
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _reached(self, fraction: float) -> bool:
        done = min(p if p != DONE else self.total for p in self.progress)
        return done >= fraction * self.total

    def _run(self) -> None:
        node = self.cluster.nodes[0]
        while not self._reached(1 / 3) and not self._done.is_set():
            time.sleep(0.01)
        {"kill": node.kill, "stop": node.pause, "trickle": self._slow}[self.kind]()
        while not self._reached(2 / 3) and not self._done.is_set():
            time.sleep(0.01)
        self.heal()

    def _slow(self) -> None:
        assert self.proxy is not None
        self.proxy.slow.set()

    def heal(self) -> None:
        node = self.cluster.nodes[0]
        if self.kind == "kill" and node.proc is None:
            node.start()
        elif self.kind == "stop":
            node.resume()
        elif self.proxy is not None:
            self.proxy.slow.clear()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)
        self.heal()


# ------------------------------------------------------------------------ the table


def table(outcomes: list[Outcome]) -> str:
    header = (
        "| C | configuration | routing | model: exact LRU | model: server's eviction | "
        "hit rate | / exact | / server's | rows verified (wrong) | first Lookup p50 / p99 / "
        "max | waited (ran out) | probes / request | stale promotions | wall |"
    )
    lines = [header, "|---" * 14 + "|"]
    for o in outcomes:
        m, t = o.merged, o.tier
        lat = sorted(m.first_lookup_s) or [0.0]
        tree = " (before)" if o.config.before else ""
        server = o.model_server if o.model_server is not None else o.model
        shown = "-" if o.config.policy == "allkeys-lfu" else f"{server.hit_rate:.1%}"
        lines.append(
            f"| {o.config.fraction:.0%} | {o.config.label}{tree} | {o.config.shape.routing} | "
            f"{o.model.hit_rate:.1%} | {shown} | {o.hit_rate:.1%} | "
            f"{_ratio(o.hit_rate, o.model)} | "
            f"{'-' if shown == '-' else _ratio(o.hit_rate, server)} | "
            f"{m.loaded:,} ({m.mismatches}) | "
            f"{percentile(lat, 0.5) * 1e3:.2f} / {percentile(lat, 0.99) * 1e3:.2f} / "
            f"{lat[-1] * 1e3:.1f} ms | {t.get('lookup_waits', 0):,} "
            f"({t.get('lookup_wait_timeouts', 0):,}) | "
            f"{t.get('probes', 0) / max(1, m.requests):.2f} | "
            f"{t.get('promotion_failures', 0):,} | {m.wall:.0f} s |"
        )
    return "\n".join(lines)


def _ratio(rate: float, model: ModelResult) -> str:
    return f"{rate / model.hit_rate:.2f}x" if model.hit_rate else "-"


def notes(outcomes: list[Outcome]) -> str:
    out = []
    for o in outcomes:
        m = o.merged
        extra = []
        if o.config.remote not in ("one", "none"):
            extra.append(f"server keys at the end {o.server_keys:,}, evicted {o.server_evicted:,}")
        extra.append(f"client round trips per request {m.rpcs / max(1, m.requests):.2f}")
        extra.append(f"stop {o.stop_s:.1f} s; load average {o.load[0]:.1f} -> {o.load[1]:.1f}")
        if m.store_refused or m.gave_up or m.load_races:
            extra.append(
                f"stores refused {m.store_refused}, gave up waiting {m.gave_up}, "
                f"load races {m.load_races}"
            )
        if o.config.fault:
            extra += fault_phases(o)
        if o.log_lines:
            extra.append(f"{len(o.log_lines)} WARNING/ERROR lines: " + " / ".join(
                line[-160:] for line in o.log_lines[:6]))  # fmt: skip
        out.append(f"- {o.config.fraction:.0%} {o.config.label} {o.config.shape.routing}"
                   f"{' (before)' if o.config.before else ''}: " + "; ".join(extra))  # fmt: skip
    return "\n".join(out)


def fault_phases(outcome: Outcome) -> list[str]:
    """A fault run's requests before, during and after the fault (by trace position:
    the fault lasts from a third to two thirds of the replay, :class:`_Fault`): each
    part's first-Lookup latency and hit rate, and each node's WARNING lines."""
    m = outcome.merged
    total = max(index for index, _, _ in m.per_request) + 1 if m.per_request else 0
    parts: dict[str, list[tuple[float, int, int]]] = {"before": [], "during": [], "after": []}
    for (index, hits, answers), seconds in zip(m.per_request, m.first_lookup_s, strict=False):
        part = "before" if index < total / 3 else "during" if index < 2 * total / 3 else "after"
        parts[part].append((seconds, hits, len(answers)))
    out = []
    for part, rows in parts.items():
        if not rows:
            continue
        lat = sorted(seconds for seconds, _, _ in rows)
        rate = sum(h for _, h, _ in rows) / max(1, sum(n for _, _, n in rows))
        out.append(
            f"{part} the fault: first Lookup p50 / p99 / max {percentile(lat, 0.5) * 1e3:.2f} / "
            f"{percentile(lat, 0.99) * 1e3:.2f} / {lat[-1] * 1e3:.1f} ms, hit rate {rate:.1%}"
        )
    per_node: dict[str, int] = {}
    for line in outcome.log_lines:
        if " WARNING " in line:
            node = line.split(":", 1)[0]
            per_node[node] = per_node.get(node, 0) + 1
    out.append("WARNING lines per node: " + (", ".join(
        f"{node} {count}" for node, count in sorted(per_node.items())) or "none"))  # fmt: skip
    return out


def _dump(path: str, outcome: Outcome) -> None:
    """Appends one JSON line: the configuration and, per request, the blocks it hit and
    its first lookup's answers (for a look at where a run lost to the model)."""
    record = {
        "config": {"fraction": outcome.config.fraction, "remote": outcome.config.remote,
                   "routing": outcome.config.shape.routing, "before": outcome.config.before,
                   "policy": outcome.config.policy, "samples": outcome.config.samples,
                   "bound": outcome.config.bound},
        "requests": sorted(outcome.merged.per_request),
    }  # fmt: skip
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", default=str(SHIPPED_TRACE))
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--capacities", default="0.1,0.3", type=lambda s: [float(x) for x in s.split(",")]
    )
    parser.add_argument("--routings", default="rr,conversation", type=lambda s: s.split(","))
    parser.add_argument(
        "--remotes", default=",".join(REMOTES), type=lambda s: [x for x in s.split(",") if x]
    )  # "": none of them (a --fault run alone)
    parser.add_argument(
        "--bounds",
        default=",".join(BOUNDS),
        type=lambda s: [x for x in s.split(",") if x],
        help="who bounds Redis C and 3C: the server (maxmemory), the fleet (fleet_capacity)",
    )
    parser.add_argument("--policies", action="store_true", help="Redis = C under other policies")
    parser.add_argument("--before", default="", help="another checkout: its daemons' rows too")
    parser.add_argument("--wait", default="", help="limits.remote_lookup_wait (default: its)")
    parser.add_argument(
        "--speedup",
        type=float,
        default=SPEEDUP,
        help="trace time / replay time (0: as fast as the fleet goes)",
    )
    parser.add_argument(
        "--tier-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a redis tier option for every node, e.g. presence_ttl=2s",
    )
    parser.add_argument("--fault", default="", choices=("", "kill", "stop", "trickle"))
    parser.add_argument(
        "--fault-remote",
        default="unbounded",
        choices=("C", "3C", "unbounded"),
        help="the Redis of the --fault run (C, 3C: bounded as --bounds' last says)",
    )
    parser.add_argument("--out", default="bench-results/fleet.md")
    parser.add_argument("--dump", default="", help="append each run's requests as JSON lines")
    args = parser.parse_args(argv)
    if any(b not in BOUNDS for b in args.bounds):
        parser.error(f"--bounds: choose from {', '.join(BOUNDS)}")
    unknown = [r for r in args.remotes if r not in REMOTES]
    if unknown:
        parser.error(f"--remotes: unknown {unknown[0]!r}; choose from {', '.join(REMOTES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = load_trace(args.trace, args.limit)
    unique = len({h for r in requests for h in r.hash_ids})
    configs = plan(args, unique)
    started = time.time()
    cluster = None
    per_value = 0.0
    if any(c.remote not in ("one", "none") for c in configs):
        cluster = BenchCluster(3)
        per_value = cluster.calibrate(HEADER + BLOCK)
    outcomes = []
    try:
        for config in configs:
            before = " (before)" if config.before else ""
            print(f"running {config.fraction:.0%} {config.label} {config.shape.routing}"
                  f"{before} ...", file=sys.stderr, flush=True)  # fmt: skip
            outcomes.append(run_config(config, requests, cluster, per_value, args))
            if args.dump:
                _dump(args.dump, outcomes[-1])
            print(table(outcomes[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    head = (
        f"machine: {machine()}; trace {args.trace} ({len(requests)} requests, {unique:,} "
        f"unique blocks of {BLOCK} bytes); {args.nodes} nodes; a Redis value costs "
        f"{per_value:,.0f} bytes of server memory; {time.time() - started:.0f} s in all"
    )
    text = f"{head}\n\n{table(outcomes)}\n\n{notes(outcomes)}\n"
    print("\n" + text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(text)
    lines = [f"{o.config.label} {o.config.shape.routing}: {line}"
             for o in outcomes for line in o.log_lines]  # fmt: skip
    Path(args.out).with_suffix(".warnings.txt").write_text("\n".join(lines) + "\n")
    return 0


__all__ = ["Config", "Outcome", "main", "plan", "replace"]

if __name__ == "__main__":
    raise SystemExit(main())
