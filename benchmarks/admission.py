"""Admission and write budgets (issue #43): what each admission policy writes to the fs
and redis tiers and what it serves from them, and a write budget under a flood.

Usage::

    python -m benchmarks admission [--trace FILE] [--requests N]
        [--policies always,reused,tinylfu] [--budget-seconds 60] [--json OUT]

**Policies.** Per trace, per policy, side by side in one run: one daemon (a fresh one
per policy) with a primary of C blocks, an fs tier of 3C and a redis tier of 6C (a real
``redis-server`` started here), both tiers with ``admission = "<policy>"``; one engine
replays the trace in order with vLLM's calls (a prefix Lookup, asked again while its
leading run waits for a promotion; PrepareLoad + CompleteLoad + Touch of the leading
HITs; PrepareStore + CompleteStore of the rest). C is 5 % of the trace's distinct
blocks. The traces: ``--trace`` (default the shipped one, the first 2,000 requests of
Mooncake's synthetic trace: about 70 % of its distinct blocks are never asked for
again) and a reuse-heavy synthetic trace made here, deterministically
(:func:`reuse_heavy_trace`: conversations over shared system prompts, each turn
extending the last). Reported per policy: block hit rate (all tiers, and the part each
tier served), bytes written per tier, hits per GB written, the store path's p99
(PrepareStore + CompleteStore, client side).

**Budget.** Two daemons at once, each with one fs tier, one with
``max_write_bytes_per_s`` = B and one without; for ``--budget-seconds`` (60) the
engine stores new blocks into both, alternating, at ten times B each. Reported: the fs
bytes the budgeted daemon wrote (its counter, and the files on its disk) against
B x seconds (target within 5 %), and the store path's p99 of each daemon (the same
load, the same minute: target unchanged).

When this build's tiers have no ``admission`` option, only ``always`` runs (the tier
as it is) and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import BenchDaemon, Row, machine, percentile
from benchmarks.replay import (
    SHIPPED_TRACE,
    Request,
    block_key,
    distinct_blocks,
    leading_hits,
    load_trace,
    markdown_table,
    unbounded_hit_rate,
)
from kvtierd.tiers.blockformat import HEADER_SIZE
from kvtierd.tiers.fs.settings import OPTIONS as FS_OPTIONS

POLICIES = ("always", "reused", "tinylfu")
BLOCK_BYTES = 4096  # the replays' blocks (a file or value is the header + this)
TIER_BYTES = HEADER_SIZE + BLOCK_BYTES  # what one block costs the fs and redis tiers
C_FRACTION = 0.05  # the primary: this fraction of the trace's distinct blocks
FS_TIMES_C = 3
REDIS_TIMES_C = 6
MIN_C = 64
PENDING_WAIT_S = 0.5  # a request waits this long for its promotions (then loads what is HIT)
STEP_S = 0.001  # ... asking again this often
DEFAULT_REQUESTS = 2000
SEED = 43

BUDGET_BLOCK_BYTES = 32 << 10
BUDGET_FILE_BYTES = HEADER_SIZE + BUDGET_BLOCK_BYTES
BUDGET_FILES_PER_S = 16  # B: 16 block files a second (589,824 B/s)
BUDGET_TIMES = 10  # the flood: ten times B
BUDGET_BATCH = 4  # blocks per store: 40 stores a second per daemon (p99 of 2,400 each)
BUDGET_POOL_BLOCKS = 512
BUDGET_TOLERANCE = 0.05


# -- traces (pure) ------------------------------------------------------------------------


def reuse_heavy_trace(
    requests: int = DEFAULT_REQUESTS,
    *,
    prompts: int = 40,
    prompt_blocks: int = 8,
    turns: int = 7,
    blocks_per_turn: int = 3,
    seed: int = SEED,
) -> list[Request]:
    """A trace where most blocks are asked for again: conversations, each on one of
    ``prompts`` system prompts (chosen with a Zipf-like skew), whose turn ``t`` is the
    prompt, every earlier turn's blocks and ``blocks_per_turn`` new ones; the turns of
    all conversations interleaved at random, each conversation's in order. The same
    arguments give the same trace."""
    rng = random.Random(seed)
    conversations = -(-requests // turns)
    weights = [1.0 / (rank + 1) for rank in range(prompts)]
    next_id = prompts * prompt_blocks
    chains: list[list[list[int]]] = []  # per conversation, per turn: its chain
    for _ in range(conversations):
        prompt = rng.choices(range(prompts), weights)[0]
        chain = list(range(prompt * prompt_blocks, (prompt + 1) * prompt_blocks))
        turns_of: list[list[int]] = []
        for _ in range(turns):
            chain = chain + list(range(next_id, next_id + blocks_per_turn))
            next_id += blocks_per_turn
            turns_of.append(chain)
        chains.append(turns_of)
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)  # which conversation speaks next; its turns stay in order
    taken = [0] * conversations
    out: list[Request] = []
    for c in order[:requests]:
        chain = chains[c][taken[c]]
        taken[c] += 1
        out.append(Request(len(out), float(len(out)), len(chain) * 512, 1, tuple(chain)))
    return out


def reused_fraction(requests: Sequence[Request]) -> float:
    """The fraction of the distinct blocks that a later request asks for again."""
    seen: set[int] = set()
    again: set[int] = set()
    for request in requests:
        for h in dict.fromkeys(request.hash_ids):
            (again if h in seen else seen).add(h)
    return len(again) / len(seen) if seen else 0.0


def admission_supported() -> bool:
    """Whether this build's tiers take an ``admission`` option."""
    return any(option.key == "admission" for option in FS_OPTIONS)


# -- one policy on one trace ----------------------------------------------------------------


@dataclass
class TierResult:
    name: str
    hits: int = 0  # blocks promoted from it
    bytes_written: int = 0
    blocks_written: int = 0  # handed to it by cascades (after admission and budget)
    extra: dict[str, int] = field(default_factory=dict)  # admission counters, when there

    def hits_per_gb(self) -> float:
        return self.hits / (self.bytes_written / 1e9) if self.bytes_written else 0.0


@dataclass
class PolicyResult:
    trace: str
    policy: str
    capacity: int  # C, blocks
    looked_up: int = 0
    hits: int = 0  # leading HITs loaded (any tier)
    primary_hits: int = 0  # of them, HIT at the request's first lookup
    store_s: list[float] = field(default_factory=list)  # per request's store path
    store_retries: int = 0  # PrepareStore refused (rows pinned by cascades), asked again
    store_refused: int = 0  # ... still refused after PENDING_WAIT_S: not stored
    tiers: list[TierResult] = field(default_factory=list)
    wall_s: float = 0.0

    def rate(self, hits: int) -> float:
        return hits / self.looked_up if self.looked_up else 0.0

    def store_p99_ms(self) -> float:
        return percentile(self.store_s, 0.99) * 1e3 if self.store_s else 0.0


class RedisServer:
    """A standalone ``redis-server`` on a free loopback port (no persistence)."""

    def __init__(self) -> None:
        from benchmarks.redis import _Server

        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not installed (`make test-tools`)")
        self._server = _Server(binary)
        self.url = self._server.url

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()

    def close(self) -> None:
        self._server.close()


def _config(fs_root: str, capacity: int, policy: str | None, redis_url: str | None) -> str:
    admission = f'admission = "{policy}"\n' if policy is not None else ""
    text = (
        f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{fs_root}"\n'
        f"capacity = {max(1 << 20, FS_TIMES_C * capacity * TIER_BYTES)}\n{admission}"
    )
    if redis_url is not None:
        text += (
            f'[[tiers]]\ntype = "redis"\nname = "redis"\nurls = ["{redis_url}"]\n'
            f"capacity = {REDIS_TIMES_C * capacity * TIER_BYTES}\n{admission}"
        )
    return text


def _start(directory: str, config: str) -> BenchDaemon:
    path = os.path.join(directory, "kvtierd.toml")
    Path(path).write_text(config)
    return BenchDaemon("--config", path)


def _settle(client: Any, pool: str, timeout: float = 120.0) -> Any:
    """The pool's stats once no tier job is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.get_stats(pool).pools[0]
        if not any(t.jobs_in_flight for t in stats.tiers[1:]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _tier_result(tier: Any) -> TierResult:
    extra = {
        name: int(getattr(tier, name))
        for name in ("admitted_blocks", "admitted_bytes", "dropped_blocks")
        if hasattr(tier, name)
    }
    return TierResult(
        tier.tier, int(tier.hits), int(tier.bytes_in), int(tier.cascade_blocks), extra
    )


def replay_policy(
    trace: str,
    requests: Sequence[Request],
    policy: str,
    capacity: int,
    redis: RedisServer,
    configured: bool,
    log: Callable[[str], None],
) -> PolicyResult:
    """One fresh daemon (fs 3C, redis 6C, ``admission = policy`` when ``configured``)
    replaying ``requests`` with one engine; its numbers."""
    from kvtierd_client.client import Client, LookupResult

    redis.flush()
    directory = tempfile.mkdtemp(prefix="kvtb-admission-")
    root = os.path.join(directory, "fs")
    os.mkdir(root)
    daemon = _start(directory, _config(root, capacity, policy if configured else None, redis.url))
    out = PolicyResult(trace, policy, capacity)
    hit, waiting = LookupResult.HIT, (LookupResult.HIT_PENDING, LookupResult.RETRY)
    pool = f"admission/{policy}"
    try:
        with Client(daemon.address, timeout=60) as client:
            session = client.open_session(pool, block_bytes=BLOCK_BYTES, num_blocks=capacity)
            started = time.perf_counter()
            for request in requests:
                keys = [block_key(h) for h in dict.fromkeys(request.hash_ids)]
                out.looked_up += len(keys)
                results = session.lookup(keys, prefix=True)
                k = leading_hits(results, hit)
                out.primary_hits += k
                deadline = time.perf_counter() + PENDING_WAIT_S
                while k < len(keys) and results[k] in waiting and time.perf_counter() < deadline:
                    time.sleep(STEP_S)
                    results = session.lookup(keys, prefix=True)
                    k = leading_hits(results, hit)
                k = _load(session, keys, k)
                out.hits += k
                _store(session, keys[k:], out)
            out.wall_s = time.perf_counter() - started
            stats = _settle(client, pool)
            out.tiers = [_tier_result(tier) for tier in stats.tiers[1:]]
            session.close()
    finally:
        daemon.close()
        shutil.rmtree(directory, ignore_errors=True)
    log(
        f"admission: {trace} / {policy}: hit rate {out.rate(out.hits):.2%}, "
        f"fs written {out.tiers[0].bytes_written / 2**20:.1f} MiB, {out.wall_s:.0f} s"
    )
    return out


def _load(session: Any, keys: list[bytes], k: int) -> int:
    """Loads the ``k`` leading HITs (fewer if one was evicted since): how many."""
    from kvtierd_client.client import LookupResult
    from kvtierd_client.errors import FailedPrecondition

    if k:
        try:
            session.prepare_load(keys[:k])
        except FailedPrecondition:  # evicted since the lookup: load what is there now
            k = leading_hits(session.lookup(keys[:k], prefix=True), LookupResult.HIT)
            if not k:
                return 0
            session.prepare_load(keys[:k])
        session.complete_load(keys[:k])
        session.touch(keys[:k])
    return k


def _store(session: Any, keys: list[bytes], out: PolicyResult) -> None:
    """Stores ``keys``; a PrepareStore refused for rows that cascades still pin is
    asked again a step later (the engine's next step), for up to ``PENDING_WAIT_S``.
    The store path timed is the granted PrepareStore and its CompleteStore."""
    if not keys:
        return
    deadline = time.perf_counter() + PENDING_WAIT_S
    while True:
        t0 = time.perf_counter()
        grant = session.prepare_store(keys)
        if grant is not None or time.perf_counter() > deadline:
            break
        out.store_retries += 1
        time.sleep(STEP_S)
    if grant is None:
        out.store_refused += 1
        return
    if grant.keys_to_store:
        session.complete_store(grant.keys_to_store)
    out.store_s.append(time.perf_counter() - t0)


# -- the budget run ------------------------------------------------------------------------


@dataclass
class BudgetResult:
    seconds: float
    budget_bytes_per_s: int
    offered_bytes: int = 0  # tier bytes of the blocks stored into each daemon
    written_bytes: int = 0  # the budgeted daemon's fs counter (bytes_in)
    on_disk_bytes: int = 0  # its block files' sizes at the end
    unbudgeted_written_bytes: int = 0
    store_s: dict[str, list[float]] = field(default_factory=dict)  # "budget" / "none"
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average, start and end

    @property
    def allowed_bytes(self) -> float:
        return self.budget_bytes_per_s * self.seconds

    @property
    def ratio(self) -> float:
        return self.written_bytes / self.allowed_bytes if self.allowed_bytes else 0.0

    def p99_ms(self, which: str) -> float:
        samples = self.store_s.get(which, [])
        return percentile(samples, 0.99) * 1e3 if samples else 0.0


def budget_run(seconds: float, log: Callable[[str], None]) -> BudgetResult:
    """Two daemons with an fs tier each, one with a write budget B; new blocks stored
    into both, alternating, at ``BUDGET_TIMES`` x B each for ``seconds``."""
    from kvtierd_client.client import Client

    budget = BUDGET_FILES_PER_S * BUDGET_FILE_BYTES
    out = BudgetResult(seconds, budget)
    directory = tempfile.mkdtemp(prefix="kvtb-budget-")
    daemons: dict[str, BenchDaemon] = {}
    roots: dict[str, str] = {}
    try:
        for which, rate in (("budget", budget), ("none", 0)):
            roots[which] = os.path.join(directory, which)
            os.makedirs(roots[which])
            config = (
                f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{roots[which]}"\n'
                f'capacity = "4GiB"\nmax_write_bytes_per_s = {rate}\n'
            )
            os.makedirs(os.path.join(directory, f"{which}-daemon"))
            daemons[which] = _start(os.path.join(directory, f"{which}-daemon"), config)
        clients = {w: Client(d.address, timeout=60) for w, d in daemons.items()}
        sessions = {
            w: c.open_session(
                "budget", block_bytes=BUDGET_BLOCK_BYTES, num_blocks=BUDGET_POOL_BLOCKS
            )
            for w, c in clients.items()
        }
        out.store_s = {w: [] for w in daemons}
        interval = BUDGET_BATCH / (BUDGET_TIMES * BUDGET_FILES_PER_S)  # seconds per store
        ticks = int(seconds / interval)
        out.load = (os.getloadavg()[0], 0.0)
        log(f"admission: budget run, {ticks} stores of {BUDGET_BATCH} blocks per daemon ...")
        start = time.perf_counter()
        for tick in range(ticks):
            order = ("budget", "none") if tick % 2 == 0 else ("none", "budget")
            for which in order:
                keys = [f"{which}-{tick}-{i}".encode() for i in range(BUDGET_BATCH)]
                t0 = time.perf_counter()
                grant = sessions[which].prepare_store(keys)
                if grant is not None and grant.keys_to_store:
                    sessions[which].complete_store(grant.keys_to_store)
                out.store_s[which].append(time.perf_counter() - t0)
            delay = start + (tick + 1) * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the flood's pace
        out.load = (out.load[0], os.getloadavg()[0])
        out.offered_bytes = ticks * BUDGET_BATCH * BUDGET_FILE_BYTES
        for which, client in clients.items():
            tier = _settle(client, "budget").tiers[1]
            if which == "budget":
                out.written_bytes = int(tier.bytes_in)
            else:
                out.unbudgeted_written_bytes = int(tier.bytes_in)
            sessions[which].close()
            client.close()
        out.on_disk_bytes = sum(p.stat().st_size for p in Path(roots["budget"]).rglob("*.kvb"))
    finally:
        for daemon in daemons.values():
            daemon.close()
        shutil.rmtree(directory, ignore_errors=True)
    return out


# -- reporting -------------------------------------------------------------------------------

COLUMNS = ["trace", "policy", "hit rate (all)", "primary", "fs", "redis", "fs written",
           "redis written", "fs hits/GB", "redis hits/GB", "fs vs always", "store p99 ms",
           "wall s"]  # fmt: skip


def table_rows(results: Sequence[PolicyResult]) -> list[list[str]]:
    always = {r.trace: r for r in results if r.policy == "always"}
    rows = []
    for r in results:
        fs, redis = r.tiers[0], r.tiers[1]
        base = always.get(r.trace)
        vs = (
            f"{fs.bytes_written / base.tiers[0].bytes_written:.2f}x"
            if base and base.tiers[0].bytes_written
            else ""
        )
        rows.append([
            r.trace, r.policy, f"{r.rate(r.hits):.2%}", f"{r.rate(r.primary_hits):.2%}",
            f"{r.rate(fs.hits):.2%}", f"{r.rate(redis.hits):.2%}",
            f"{fs.bytes_written / 2**20:,.1f} MiB", f"{redis.bytes_written / 2**20:,.1f} MiB",
            f"{fs.hits_per_gb():,.0f}", f"{redis.hits_per_gb():,.0f}", vs,
            f"{r.store_p99_ms():.2f}", f"{r.wall_s:.0f}",
        ])  # fmt: skip
    return rows


def budget_lines(b: BudgetResult) -> list[str]:
    return [
        f"budget run: {b.seconds:g} s of stores at {BUDGET_TIMES}x a budget of "
        f"{b.budget_bytes_per_s:,} B/s ({BUDGET_FILES_PER_S} files of {BUDGET_FILE_BYTES:,} B "
        f"a second) into two daemons at once; load average {b.load[0]:.2f} -> {b.load[1]:.2f}",
        f"  offered {b.offered_bytes:,} B to each; budgeted fs wrote {b.written_bytes:,} B "
        f"(on disk {b.on_disk_bytes:,} B) = {b.ratio:.3f}x budget x {b.seconds:g} s "
        f"(target within {BUDGET_TOLERANCE:.0%}); unbudgeted fs wrote "
        f"{b.unbudgeted_written_bytes:,} B",
        f"  store path p99: {b.p99_ms('budget'):.2f} ms with the budget, "
        f"{b.p99_ms('none'):.2f} ms without (p50 "
        f"{percentile(b.store_s['budget'], 0.5) * 1e3:.2f} / "
        f"{percentile(b.store_s['none'], 0.5) * 1e3:.2f} ms, "
        f"{len(b.store_s['budget'])} stores each)",
    ]


def bench_rows(results: Sequence[PolicyResult], budget: BudgetResult | None) -> list[Row]:
    """`make bench`'s rows: per trace and policy the hit rate and the fs bytes against
    ``always``'s; the budget's bytes and store p99 against the unbudgeted daemon's."""
    rows: list[Row] = []
    always = {r.trace: r for r in results if r.policy == "always"}
    for r in results:
        group = f"admission {r.trace}, C={r.capacity}"
        base = always.get(r.trace)
        rows.append(Row(group, f"{r.policy}: block hit rate", r.rate(r.hits) * 100, "%",
                        f"always {base.rate(base.hits):.2%}" if base else "",
                        r.hits / base.hits if base and base.hits else None))  # fmt: skip
        fs_bytes, base_bytes = r.tiers[0].bytes_written, base.tiers[0].bytes_written if base else 0
        rows.append(Row(group, f"{r.policy}: fs bytes written", fs_bytes / 2**20, "MiB",
                        f"always {base_bytes / 2**20:,.1f} MiB" if base else "",
                        fs_bytes / base_bytes if base_bytes else None,
                        "<= 0.4x (default policy)" if r.policy != "always" else ""))  # fmt: skip
        rows.append(Row(group, f"{r.policy}: store path p99", r.store_p99_ms() * 1e3, "us"))
    if budget is not None:
        group = f"write budget, {budget.seconds:g} s at {BUDGET_TIMES}x"
        rows.append(Row(group, "fs bytes written", budget.written_bytes / 2**20, "MiB",
                        f"budget x time {budget.allowed_bytes / 2**20:,.1f} MiB", budget.ratio,
                        "1 +- 0.05"))  # fmt: skip
        rows.append(Row(group, "store path p99 with the budget", budget.p99_ms("budget") * 1e3,
                        "us", f"without {budget.p99_ms('none') * 1e3:,.0f} us",
                        budget.p99_ms("budget") / budget.p99_ms("none")
                        if budget.p99_ms("none") else None, "unchanged"))  # fmt: skip
    return rows


def measure(
    trace: str, requests: int, policies: Sequence[str], budget_seconds: float
) -> tuple[list[PolicyResult], BudgetResult | None, list[str]]:
    """Every policy on both traces, then the budget run; and the header lines."""
    shipped = load_trace(trace, requests)
    traces = {Path(trace).name: shipped, "reuse-heavy": reuse_heavy_trace(requests)}
    configured = admission_supported()
    if not configured:
        policies = [p for p in policies if p == "always"] or ["always"]
    header = [f"machine: {machine()}; load average {os.getloadavg()[0]:.2f} at the start"]
    if not configured:
        header.append("this build's tiers have no admission option: `always` only (as it is)")
    log = _log
    results: list[PolicyResult] = []
    redis = RedisServer()
    try:
        for name, reqs in traces.items():
            distinct = distinct_blocks(reqs)
            capacity = max(MIN_C, int(distinct * C_FRACTION))
            header.append(
                f"{name}: {len(reqs)} requests, {distinct:,} distinct blocks "
                f"({reused_fraction(reqs):.0%} asked for again), unbounded hit rate "
                f"{unbounded_hit_rate(reqs):.2%}; C = {capacity:,} blocks of {BLOCK_BYTES} B, "
                f"fs {FS_TIMES_C}C, redis {REDIS_TIMES_C}C ({TIER_BYTES} B per block on a tier)"
            )
            for policy in policies:
                results.append(replay_policy(name, reqs, policy, capacity, redis, configured, log))
    finally:
        redis.close()
    budget = budget_run(budget_seconds, log) if budget_seconds > 0 else None
    return results, budget, header


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run() -> list[Row]:
    """`make bench` suite: the shipped trace (2,000 requests) and the reuse-heavy one,
    every policy this build has, and a 60 s budget run; skipped without redis-server."""
    if shutil.which("redis-server") is None:
        print("admission: skipped (redis-server not installed: `make test-tools`)",
              file=sys.stderr)  # fmt: skip
        return []
    results, budget, _ = measure(str(SHIPPED_TRACE), DEFAULT_REQUESTS, POLICIES, 60.0)
    return bench_rows(results, budget)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks admission", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trace", default=str(SHIPPED_TRACE),
                        help="Mooncake-format JSONL trace (default: the shipped one)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                        help="replay the first N requests of each trace (%(default)s)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="admission policies, comma-separated (%(default)s)")  # fmt: skip
    parser.add_argument("--budget-seconds", type=float, default=60.0,
                        help="length of the budget run, 0 to skip it (%(default)s)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write every figure here (JSON)")
    parser.add_argument("--out", default="bench-results/admission.md",
                        help="also write the table here (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        parser.error(f"trace {args.trace} not found; give a Mooncake-format JSONL file")
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"unknown policy {unknown[0] if unknown else ''!r}; choose from "
                     f"{', '.join(POLICIES)}")  # fmt: skip
    if shutil.which("redis-server") is None:
        parser.error("redis-server not installed (`make test-tools`)")
    results, budget, header = measure(args.trace, args.requests, policies, args.budget_seconds)
    text = "\n".join(header) + "\n\n" + markdown_table(COLUMNS, table_rows(results))
    if budget is not None:
        text += "\n\n" + "\n".join(budget_lines(budget))
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        figures = {
            "header": header,
            "policies": [asdict(r) | {"store_p99_ms": r.store_p99_ms()} for r in results],
            "budget": None if budget is None else asdict(budget) | {
                "ratio": budget.ratio,
                "p99_ms": {"budget": budget.p99_ms("budget"), "none": budget.p99_ms("none")},
            },
        }  # fmt: skip
        for entry in figures["policies"]:
            entry.pop("store_s")
        if figures["budget"] is not None:
            figures["budget"].pop("store_s")
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
