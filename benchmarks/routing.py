"""`make bench-routing`: KV-aware routing measured against a real router's view (issue #42).

Usage::

    python -m benchmarks routing [--trace FILE] [--requests N] [--json OUT]
        [--policies round_robin,conversation,kv_aware] [--gpu-blocks G]
        [--node-blocks C] [--redis-blocks R] [--block-size B] [--sample-every K]

A fleet of 3 nodes of 2 engines replays a Mooncake-format trace (the shipped one by
default) once per routing policy, each run on fresh daemons and an emptied cluster:

* each node runs its own real kvtierd daemon: one pool of ``C`` blocks its two
  engines share, a Redis tier on a real 3-master Redis Cluster every node shares,
  and (once the daemon has it) its ``[kv_events]`` publisher on a loopback endpoint;
* each engine (:mod:`benchmarks.routing_engine`) is vLLM without a model: a GPU prefix
  cache of ``G`` blocks publishing its own ``GPU`` events on its own socket, then a
  prefix lookup, verified loads and described stores on its node's pool through the
  real client library (:mod:`benchmarks.routing_blocks` makes vLLM's token ids,
  chained block hashes and keys from the trace's hash ids);
* NVIDIA Dynamo's standalone indexer, for real, subscribes to every engine's socket
  (instance ``engine + 1``, dp rank 0) and to its node's daemon registered under each
  of the node's engines with dp rank 1 (docs/design/kv-events.md): nothing else feeds it;
* a router per policy (:mod:`benchmarks.routing_policies`) picks each request's engine:
  ``round_robin``, ``conversation`` (a hash of the first block) or ``kv_aware`` (Dynamo's
  cost from the indexer's ``/query``, with a load term).

Hit rates are blocks served from each engine's GPU, its node's primary (CPU) or the
shared Redis tier (storage), over all the trace's blocks; ``load_max_over_mean`` is the
busiest engine's requests over the mean. The view: every ``K``-th request, before it
is routed, the indexer's answer for its tokens is set against what each engine could
really load (its GPU cache, then its node's pool: ``Explain`` per key, which starts no
promotion): precision = blocks claimed that were loadable / blocks claimed, recall =
blocks loadable that were claimed / blocks loadable. ``--json OUT`` writes issue #42's
shape; the table goes to stdout and ``bench-results/routing.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import BenchDaemon, machine
from benchmarks.replay import SHIPPED_TRACE, load_trace
from benchmarks.routing_blocks import Chain, ChainMaker
from benchmarks.routing_engine import EngineTotals, SimEngine
from benchmarks.routing_indexer import Holding, Indexer, free_port, version
from benchmarks.routing_policies import (
    POLICIES,
    Conversation,
    KvAware,
    KvWeights,
    RoundRobin,
    Router,
)
from benchmarks.routing_view import Placement, Truth, View, loadable

NODES = 3
ENGINES_PER_NODE = 2
POOL = "routing"
KEY_PREFIX = "kvtb-routing"
HEADER = 4096  # kvtierd.tiers.blockformat.HEADER_SIZE: a Redis value is header + row
READY_TIMEOUT_S = 60.0
REMOTE_WAIT = "200ms"


@dataclass
class PolicyResult:
    policy: str
    totals: list[EngineTotals]
    view: View
    wall_s: float
    load: tuple[float, float]
    warnings: list[str] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return sum(t.blocks for t in self.totals)

    def rate(self, tier: str) -> float:
        return sum(getattr(t, tier) for t in self.totals) / max(1, self.blocks)

    @property
    def hit_rate(self) -> float:
        return self.rate("gpu") + self.rate("cpu") + self.rate("storage")

    @property
    def load_max_over_mean(self) -> float:
        served = [t.requests for t in self.totals]
        mean = sum(served) / len(served)
        return max(served) / mean if mean else 0.0

    @property
    def wrong_bytes(self) -> int:
        return sum(t.wrong_bytes for t in self.totals)


def daemon_config(urls: list[str], events_port: int | None) -> str:
    """A node's daemon: the shared Redis tier and, when on, its KV-event publisher.

    ``remote_lookup_wait`` is raised from 5 ms to ``REMOTE_WAIT``: a Lookup of a block
    another node stored waits for the cluster's answer instead of answering MISS when
    the probe is slower than 5 ms (on a loaded 2-core machine it often is), so the
    machine's load does not decide which storage hits count. It costs nothing
    otherwise: the Lookup returns as soon as the probe answers."""
    quoted = ", ".join(f'"{url}"' for url in urls)
    text = (
        f'[limits]\nremote_lookup_wait = "{REMOTE_WAIT}"\n\n'
        f'[[tiers]]\ntype = "redis"\nname = "shared"\nurls = [{quoted}]\ncluster = true\n'
        f'key_prefix = "{KEY_PREFIX}"\n'
    )
    if events_port is not None:
        text += (
            f'\n[kv_events]\nendpoint = "tcp://127.0.0.1:{events_port}"\n'
            f'pools = ["{POOL}"]\nmodel = "default"\n'
        )
    return text


class Fleet:
    """One policy's run: the daemons, the engines, the indexer; :meth:`close` stops all."""

    def __init__(self, args: argparse.Namespace, urls: list[str]) -> None:
        import zmq

        self.args = args
        self.directory = tempfile.mkdtemp(prefix="kvtb-routing-")
        self.context = zmq.Context()
        self.daemons: list[BenchDaemon] = []
        self.clients: list[Any] = []
        self.engines: list[SimEngine] = []
        self._attached: list[Any] = []
        self.indexer: Indexer | None = None
        self.relays: list[Any] = []
        self._redis = redis.RedisCluster.from_url(urls[0])
        self._key_space = b""
        try:
            self._start(urls)
        except BaseException:
            self.close()
            raise

    def _start(self, urls: list[str]) -> None:
        from kvtierd_client.client import Client

        events_ports: list[int | None] = []
        for node in range(NODES):
            port = free_port() if self.args.daemon_events else None
            events_ports.append(port)
            path = Path(self.directory, f"node{node}.toml")
            path.write_text(daemon_config(urls, port))
            self.daemons.append(BenchDaemon("--config", str(path), "--memory-budget", "256MiB"))
        if self.args.relays:
            from benchmarks.routing_relay import StorageRelay

            self.relays = [StorageRelay(self.context, f"tcp://127.0.0.1:{port}")
                           for port in events_ports]  # fmt: skip
        workers: dict[str, str] = {}
        for node, daemon in enumerate(self.daemons):
            client = Client(daemon.address, timeout=60)
            self.clients.append(client)
            for _ in range(ENGINES_PER_NODE):
                engine = self._engine(client, len(self.engines), node)
                self.engines.append(engine)
                workers[str(engine.engine_id + 1)] = engine.publisher.endpoint
                if events_ports[node] is not None:
                    workers[f"{engine.engine_id + 1}:1"] = f"tcp://127.0.0.1:{events_ports[node]}"
                for other, relay in enumerate(self.relays):
                    if other != node:  # the other nodes' shared-tier blocks
                        workers[f"{engine.engine_id + 1}:{2 + other}"] = relay.endpoint
        self.indexer = Indexer(workers, self.args.block_size)
        for engine in self.engines:
            engine.publisher.wait_subscribed(READY_TIMEOUT_S)
        canaries = self._store_canaries()
        self._key_space = self._find_key_space(canaries[0])
        if self.args.daemon_events:
            self._wait_daemons_heard(canaries)

    def _engine(self, client: Any, engine_id: int, node: int) -> SimEngine:
        from benchmarks.routing_publisher import GpuEventPublisher
        from kvtierd_client.region import attach_announced

        session = client.open_session(
            POOL, block_bytes=self.args.block_bytes, num_blocks=self.args.node_blocks,
            eviction_policy="lru", client_name=f"routing-e{engine_id}",
        )  # fmt: skip
        attached = attach_announced(
            session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
        )
        self._attached.append(attached)
        publisher = GpuEventPublisher(self.context)
        return SimEngine(
            engine_id, node, session, attached.numpy(), publisher,
            self.args.gpu_blocks, self.args.block_bytes, self.args.describe_loads,
        )  # fmt: skip

    def _store_canaries(self) -> list[Chain]:
        """One described block stored through each node, before the replay: its tokens
        come from a negative hash id, which no trace has."""
        maker = ChainMaker(self.args.block_size)
        canaries = []
        for node in range(NODES):
            chain = maker.chain([-1 - node])
            self.engines[node * ENGINES_PER_NODE].store_only(chain)
            canaries.append(chain)
        return canaries

    def _wait_daemons_heard(self, canaries: list[Chain]) -> None:
        """Waits until the indexer credits each node's canary to both of the node's
        engines (and, with the relays, to every other engine as storage): every
        daemon's events reach the indexer before the replay starts."""
        assert self.indexer is not None
        for node, chain in enumerate(canaries):
            instances = [e.engine_id + 1 for e in self.engines if e.node == node]
            others = [e.engine_id + 1 for e in self.engines if e.node != node and self.relays]
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                held = self.indexer.query(chain.flat_tokens())
                if all(held.get(i, Holding()).cpu >= 1 for i in instances) and all(
                    held.get(i, Holding()).disk >= 1 for i in others
                ):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the indexer never heard node {node}'s daemon: {held}; "
                        f"indexer log: {self.indexer.log_tail()}"
                    )
                time.sleep(0.05)

    def truth(self, chain: Chain) -> list[Truth]:
        """Per engine, the leading blocks of ``chain`` it could load now."""
        shared = self._in_redis(chain)
        out: list[Truth] = []
        for node, client in enumerate(self.clients):
            engines = [e for e in self.engines if e.node == node]
            pool = self._placements(client, chain, engines, shared)
            out += [loadable(chain, engine.gpu, pool) for engine in engines]
        return out

    def _in_redis(self, chain: Chain) -> list[bool]:
        """Per block, whether the shared Redis tier holds its value (asked of the
        cluster itself: a daemon knows only the keys it stored or probed)."""
        pipeline = self._redis.pipeline(transaction=False)
        for key in chain.keys:
            pipeline.exists(self._key_space + key)
        return [bool(n) for n in pipeline.execute()]

    def _placements(
        self, client: Any, chain: Chain, engines: list[SimEngine], shared: list[bool]
    ) -> list[Placement]:
        """Per block, where the node's pool holds it: its primary (``Explain``, which
        starts no promotion) or the shared tier, up to the first block that neither
        the pool nor an engine of the node holds."""
        found: list[Placement] = []
        for index, key in enumerate(chain.keys):
            primary = client.explain(POOL, key).primary in _LOADABLE
            found.append(Placement(primary, primary or shared[index]))
            if not found[-1].anywhere and not any(chain.hashes[index] in e.gpu for e in engines):
                break
        return found

    def _find_key_space(self, canary: Chain) -> bytes:
        """The shared tier's prefix of value keys (``<key_prefix>:<pool fingerprint>:``),
        found by the canary block's value once it reached the cluster."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for name in self._redis.scan_iter(match=f"{KEY_PREFIX}:*".encode(), count=1000):
                if name.endswith(canary.keys[0]):
                    return bytes(name[: -len(canary.keys[0])])
            time.sleep(0.05)
        raise TimeoutError("the canary block never reached the Redis tier")

    def close(self) -> list[str]:
        """Stops everything; the indexer's and daemons' WARN/ERROR lines."""
        lines: list[str] = []
        for engine in self.engines:
            try:
                engine.session.close()
            except Exception as err:  # noqa: BLE001  (a stop must go on)
                lines.append(f"engine {engine.engine_id} close: {err}")
            engine.close()
            engine.region = None  # the last view of the region, before it is unmapped
        for relay in self.relays:
            relay.close()
        for attached in self._attached:
            attached.close()
        for client in self.clients:
            client.close()
        if self.indexer is not None:
            self.indexer.close()
            lines += [f"indexer: {line}" for line in self.indexer.warnings()]
        for node, daemon in enumerate(self.daemons):
            daemon.proc.terminate()
            try:
                daemon.proc.wait(60)
            except Exception:  # noqa: BLE001
                daemon.proc.kill()
            log = Path(daemon.workdir, "daemon.log").read_text(errors="replace")
            lines += [f"node {node}: {line}" for line in log.splitlines()
                      if "WARNING" in line or "ERROR" in line]  # fmt: skip
            daemon.close()
        self.context.term()
        self._redis.close()
        return lines


def _loadable() -> tuple[int, ...]:
    from kvtierd_client.client import LookupResult

    return (int(LookupResult.HIT), int(LookupResult.HIT_PENDING))


_LOADABLE = _loadable()


def make_router(policy: str, fleet: Fleet, weights: KvWeights) -> Router:
    engines = len(fleet.engines)
    if policy == "round_robin":
        return RoundRobin(engines)
    if policy == "conversation":
        return Conversation(engines)
    assert fleet.indexer is not None
    return KvAware(engines, fleet.indexer.query, weights)


def run_policy(
    policy: str, chains: list[Chain], cluster: Any, args: argparse.Namespace
) -> PolicyResult:
    load_before = os.getloadavg()[0]
    cluster.reset(args.redis_bytes_per_node, "allkeys-lru", 5)
    fleet = Fleet(args, cluster.urls)
    warnings: list[str] = []
    try:
        assert fleet.indexer is not None
        router = make_router(policy, fleet, args.weights)
        view = View()
        started = time.monotonic()
        for index, chain in enumerate(chains):
            if args.sample_every and index % args.sample_every == 0:
                held = fleet.indexer.query(chain.flat_tokens())
                view.add(held, fleet.truth(chain))
            engine = router.route(chain)
            fleet.engines[engine].serve(chain)
            if (index + 1) % 250 == 0:
                print(f"  {policy}: {index + 1}/{len(chains)} requests", file=sys.stderr,
                      flush=True)  # fmt: skip
        wall = time.monotonic() - started
        totals = [engine.totals for engine in fleet.engines]
    finally:
        warnings = fleet.close()
    return PolicyResult(policy, totals, view, wall, (load_before, os.getloadavg()[0]), warnings)


# ------------------------------------------------------------------------ reporting


def result_json(results: list[PolicyResult]) -> dict[str, Any]:
    """Issue #42's shape: per policy the hit rates and load; the pooled view."""
    pooled = View()
    for result in results:
        pooled.merge(result.view)
    return {
        "policies": {
            r.policy: {
                "hit_rate": round(r.hit_rate, 6),
                "hit_rate_by_tier": {
                    "gpu": round(r.rate("gpu"), 6),
                    "cpu": round(r.rate("cpu"), 6),
                    "storage": round(r.rate("storage"), 6),
                },
                "load_max_over_mean": round(r.load_max_over_mean, 6),
            }
            for r in results
        },
        "view": {"precision": round(pooled.precision, 6), "recall": round(pooled.recall, 6)},
        "indexer": version(),
        "wrong_bytes": sum(r.wrong_bytes for r in results),
    }


def table(results: list[PolicyResult]) -> str:
    lines = [
        "| policy | hit rate | GPU | CPU | storage | GPU + CPU | load max / mean | "
        "view precision | view recall | samples | blocks loaded (wrong) | wall |",
        "|---" * 12 + "|",
    ]
    for r in results:
        loaded = sum(t.loaded for t in r.totals)
        lines.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.rate('gpu'):.1%} | {r.rate('cpu'):.1%} | "
            f"{r.rate('storage'):.1%} | {r.rate('gpu') + r.rate('cpu'):.1%} | "
            f"{r.load_max_over_mean:.2f} | {r.view.precision:.3f} | {r.view.recall:.3f} | "
            f"{r.view.samples} | {loaded:,} ({r.wrong_bytes}) | "
            f"{r.wall_s:.0f} s |"
        )
    return "\n".join(lines)


def notes(results: list[PolicyResult]) -> str:
    out = []
    for r in results:
        t = r.totals
        out.append(
            f"- {r.policy}: requests per engine {[x.requests for x in t]}; stores refused "
            f"{sum(x.store_refused for x in t)}, load races {sum(x.load_races for x in t)}, "
            f"gave up waiting {sum(x.gave_up for x in t)}; GPU blocks evicted "
            f"{sum(x.gpu_evicted for x in t):,}; view: {r.view.describe()}; load average "
            f"{r.load[0]:.1f} -> {r.load[1]:.1f}; {len(r.warnings)} WARN/ERROR lines"
            + (": " + " / ".join(line[-160:] for line in r.warnings[:4]) if r.warnings else "")
        )
    return "\n".join(out)


def check(data: dict[str, Any]) -> list[str]:
    """Issue #42's acceptance lines this run misses (empty: all met)."""
    policies = data["policies"]
    missed = []
    if {"round_robin", "conversation", "kv_aware"} <= policies.keys():
        kv, conv, rr = (policies[p] for p in ("kv_aware", "conversation", "round_robin"))

        def local(p: dict[str, Any]) -> float:
            return float(p["hit_rate_by_tier"]["gpu"] + p["hit_rate_by_tier"]["cpu"])

        if local(kv) < local(conv):
            missed.append("kv_aware's GPU + CPU hit rate is below conversation's")
        if kv["hit_rate"] < conv["hit_rate"]:
            missed.append("kv_aware's hit rate is below conversation's")
        if local(kv) < 1.2 * local(rr):
            missed.append("kv_aware's GPU + CPU hit rate is below 1.2x round_robin's")
        if kv["load_max_over_mean"] > 1.2:
            missed.append("kv_aware's load_max_over_mean is above 1.2")
    if data["view"]["precision"] < 0.99:
        missed.append("view precision is below 0.99")
    if data["view"]["recall"] < 0.95:
        missed.append("view recall is below 0.95")
    if data["wrong_bytes"]:
        missed.append("some loaded blocks had wrong bytes")
    return missed


# ------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", default=str(SHIPPED_TRACE), help="a Mooncake-format JSONL")
    parser.add_argument("--requests", type=int, default=None, help="replay the first N")
    parser.add_argument("--json", default="", metavar="OUT", help="write the results here")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), type=lambda s: [p for p in s.split(",") if p]
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens a block")
    parser.add_argument("--block-bytes", type=int, default=4096, help="bytes a block")
    parser.add_argument("--gpu-blocks", type=int, default=1024, help="each engine's GPU cache")
    parser.add_argument("--node-blocks", type=int, default=4096, help="each node's pool")
    parser.add_argument(
        "--redis-blocks", type=int, default=0, help="the shared tier's bound (0: unbounded)"
    )
    parser.add_argument("--sample-every", type=int, default=10, help="view samples (0: none)")
    parser.add_argument("--load-weight", type=float, default=KvWeights.load_weight)
    parser.add_argument("--load-window", type=int, default=KvWeights.window)
    parser.add_argument("--host-weight", type=float, default=KvWeights.host_weight)
    parser.add_argument("--disk-weight", type=float, default=KvWeights.disk_weight)
    parser.add_argument(
        "--daemon-events",
        choices=("auto", "on", "off"),
        default="auto",
        help="register the daemons' [kv_events] with the indexer (auto: when the daemon has it)",
    )
    parser.add_argument(
        "--shared-view",
        choices=("relay", "none"),
        default="relay",
        help="relay each daemon's STORAGE events to the other nodes' engines (the shared "
        "Redis tier is theirs too; benchmarks/routing_relay.py), or not",
    )
    parser.add_argument(
        "--describe-loads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engines describe the blocks they load to their pool (a promoted block has no "
        "description on the node that promoted it)",
    )
    parser.add_argument("--out", default="bench-results/routing.md")
    args = parser.parse_args(argv)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    if args.daemon_events == "auto":
        args.daemon_events = importlib.util.find_spec("kvtierd.kvevents") is not None
    else:
        args.daemon_events = args.daemon_events == "on"
    args.relays = args.daemon_events and args.shared_view == "relay"
    args.weights = KvWeights(args.host_weight, args.disk_weight, args.load_weight, args.load_window)
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.rediscluster import BenchCluster

    args = parse_args(argv)
    requests = load_trace(args.trace, args.requests)
    longest = max((len(r.hash_ids) for r in requests), default=0)
    if longest > args.gpu_blocks:
        raise SystemExit(f"--gpu-blocks {args.gpu_blocks}: the longest request has {longest}")
    maker = ChainMaker(args.block_size)
    chains = [maker.chain(r.hash_ids) for r in requests]
    started = time.time()
    cluster = BenchCluster(3)
    results: list[PolicyResult] = []
    try:
        args.redis_bytes_per_node = 0
        if args.redis_blocks:
            per_value = cluster.calibrate(HEADER + args.block_bytes)
            args.redis_bytes_per_node = int(args.redis_blocks * per_value / len(cluster.nodes))
        for policy in args.policies:
            print(f"running {policy} ...", file=sys.stderr, flush=True)
            results.append(run_policy(policy, chains, cluster, args))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        cluster.close()
    data = result_json(results)
    unique = len({h for r in requests for h in r.hash_ids})
    head = (
        f"machine: {machine()}; trace {args.trace} ({len(requests)} requests, {unique:,} "
        f"unique blocks of {args.block_size} tokens); {NODES} nodes x {ENGINES_PER_NODE} "
        f"engines; GPU {args.gpu_blocks} blocks an engine, pool {args.node_blocks} blocks a "
        f"node, Redis {args.redis_blocks or 'unbounded'}; {data['indexer']}; daemons' events "
        f"{'on' if args.daemon_events else 'OFF (GPU events only)'}"
        f"{', shared tier relayed fleet-wide' if args.relays else ''}; "
        f"{time.time() - started:.0f} s in all"
    )
    missed = check(data)
    verdict = "acceptance: met" if not missed else "acceptance: MISSED: " + "; ".join(missed)
    text = f"{head}\n\n{table(results)}\n\n{notes(results)}\n\n{verdict}\n"
    print("\n" + text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0


__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
