"""Trace replay: N engine processes replay a Mooncake-format trace through a live daemon.

Usage::

    python -m benchmarks.replay [TRACE] [--engines 4] [--assign rr|hash] [--capacity-blocks C]
                                      [--limit N] [--batch] [--copy] [--fs-root DIR]

The trace is JSON lines with ``timestamp``, ``input_length``, ``output_length`` and
``hash_ids`` (one id per 512-token block; a request's ids are its prefix chain). Each
engine is a process with its own ``Client`` and ``Session``; requests go to engines
round-robin (``rr``) or by a hash of their first block (``hash``). Every request is one
engine step doing vLLM's manager call pattern:

    lookup(chain) -> leading HITs k -> prepare_load(chain[:k]) + complete_load + touch
                  -> prepare_store(chain[k:]) + complete_store(keys_to_store)

Keys are the hash ids as 8-byte big-endian integers. No KV bytes are copied unless
``--copy`` (then numpy copies the rows between a per-engine buffer and the attached
region; the copy is excluded from the control latency). The step's control latency is
the wall time of its RPCs. Two floors are timed by every engine during the same replay,
under the same load: an empty RPC (the gRPC health ``Check``, no daemon code) and a
``Batch`` of no operations on the engine's session (the method a step uses, so it waits
where a step's call waits, whatever the server does per method).

One run compares, at the same total capacity C: ``isolated`` (N pools of C/N blocks,
what in-engine offloading gives) vs ``shared`` (one pool of C blocks: kvtierd), each with
the ``lru`` and ``arc`` eviction policies. Every (mode, policy) uses its own pools, so
modes never see each other's keys. Engines advance through the trace in its order: a
request starts only when every request more than ``--window`` places before it is done.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import BenchDaemon, Row, machine, percentile

TOKENS_PER_BLOCK = 512
KEY_BYTES = 8
DONE = 1 << 62  # progress of an engine that has finished its requests
DEFAULT_TRACE_ENV = "KVTIERD_REPLAY_TRACE"
SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "synthetic_trace_2000.jsonl"
"""The default trace when neither an argument nor $KVTIERD_REPLAY_TRACE names one: the first
2,000 requests of Mooncake's synthetic trace, shipped in the repository (traces/README.md)."""
DEFAULT_FLUSH_AFTER = 0.1
"""Seconds a batch run's queued completion waits for the engine's next call: the vLLM
adapter's ``kvtierd_flush_after`` default (``kvtierd_client.vllm.settings``; a test in
tests/vllm keeps them equal), since the engines replay vLLM's call pattern. A real
scheduler step (10-50 ms) is longer than the client library's own 5 ms default."""


# --------------------------------------------------------------------------------------
# Pure parts (unit tested): trace parsing, assignment, prefix-hit counting
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int  # position in the trace (0-based), the replay order
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: Iterable[str], limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake-format JSONL trace (blank lines skipped); ``limit`` keeps the
    first requests. Raises ``ValueError`` naming the line for a malformed record."""
    requests: list[Request] = []
    for number, line in enumerate(lines, 1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            hash_ids = tuple(int(h) for h in record["hash_ids"])
            request = Request(
                index=len(requests),
                timestamp=float(record.get("timestamp", 0)),
                input_length=int(record.get("input_length", len(hash_ids) * TOKENS_PER_BLOCK)),
                output_length=int(record.get("output_length", 0)),
                hash_ids=hash_ids,
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"trace line {number}: {type(err).__name__}: {err}") from None
        if any(h < 0 or h >= 1 << (8 * KEY_BYTES) for h in hash_ids):
            raise ValueError(f"trace line {number}: hash ids must be in [0, 2**64)")
        requests.append(request)
    return requests


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[Request]:
    with open(path) as handle:
        return parse_trace(handle, limit)


def block_key(hash_id: int) -> bytes:
    """The key of one block: its hash id as 8 bytes, big-endian."""
    return hash_id.to_bytes(KEY_BYTES, "big")


def request_keys(request: Request) -> list[bytes]:
    """The request's prefix chain as keys, duplicates dropped (a call names a key once)."""
    return [block_key(h) for h in dict.fromkeys(request.hash_ids)]


def engine_of(request: Request, engines: int, how: str) -> int:
    """The engine that serves ``request``: ``rr`` round-robin by trace position, ``hash``
    a stable hash of its first block (requests without blocks fall back to ``rr``)."""
    if how == "rr" or not request.hash_ids:
        return request.index % engines
    if how == "hash":
        digest = hashlib.blake2b(block_key(request.hash_ids[0]), digest_size=8).digest()
        return int.from_bytes(digest, "big") % engines
    raise ValueError(f"unknown assignment {how!r}; use rr or hash")


def assign(requests: Sequence[Request], engines: int, how: str) -> list[list[Request]]:
    """Each engine's requests, in trace order."""
    if engines < 1:
        raise ValueError("engines must be >= 1")
    queues: list[list[Request]] = [[] for _ in range(engines)]
    for request in requests:
        queues[engine_of(request, engines, how)].append(request)
    return queues


def leading_hits(results: Sequence[Any], hit: Any) -> int:
    """How many results, from the first, are ``hit`` (the loadable prefix)."""
    count = 0
    for result in results:
        if result != hit:
            break
        count += 1
    return count


def distinct_blocks(requests: Iterable[Request]) -> int:
    return len({h for request in requests for h in request.hash_ids})


def unbounded_hit_rate(requests: Sequence[Request]) -> float:
    """Prefix hit rate of one cache of unlimited size (the ceiling for every mode)."""
    seen: set[int] = set()
    hits = looked_up = 0
    for request in requests:
        chain = list(dict.fromkeys(request.hash_ids))
        hits += leading_hits([h in seen for h in chain], True)
        looked_up += len(chain)
        seen.update(chain)
    return hits / looked_up if looked_up else 0.0


def default_capacity(distinct: int, engines: int, fraction: float = 0.25) -> int:
    """``fraction`` of the distinct blocks, a multiple of ``engines`` (>= engines)."""
    per_engine = max(1, int(distinct * fraction) // engines)
    return per_engine * engines


# --------------------------------------------------------------------------------------
# Engine processes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    mode: str  # "isolated" | "shared"
    policy: str  # "lru" | "arc"
    batch: bool  # Session(queue_completions=True): completions ride on the next call
    pool_blocks: int  # capacity of each pool this run opens
    pipelined: bool = False  # one Batch per step: previous stores + this lookup (pinned)
    fast_lane: bool = True  # the sessions' hot calls over the fast lane; False: gRPC only

    @property
    def label(self) -> str:
        kind = " pipelined" if self.pipelined else " batch" if self.batch else ""
        return f"{self.mode} {self.policy}{kind}{'' if self.fast_lane else ' gRPC'}"

    def pool(self, tag: str, engine: int) -> str:
        suffix = f"/e{engine}" if self.mode == "isolated" else ""
        kind = "p" if self.pipelined else "b" if self.batch else "u"
        kind += "" if self.fast_lane else "g"
        return f"replay-{tag}/{self.mode}-{self.policy}-{kind}{suffix}"


@dataclass
class EngineResult:
    steps: int = 0
    looked_up: int = 0  # blocks named in lookups (one per block of each request)
    hits: int = 0  # leading HIT blocks loaded
    pending_hits: int = 0  # of those, blocks that answered HIT_PENDING first (promotions)
    loaded: int = 0
    stored: int = 0
    evicted: int = 0
    store_rejected: int = 0  # PrepareStore answered "no room"
    load_races: int = 0  # PrepareLoad refused: a hit was evicted after the lookup
    rpcs: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds per step
    step_rpcs: list[int] = field(default_factory=list)
    empty: list[float] = field(default_factory=list)  # empty RPC (health Check) round trips
    empty_batch: list[float] = field(default_factory=list)  # Batch of no ops, same session
    wall: float = 0.0
    daemon_cpu: float = 0.0  # daemon CPU seconds over the run (engine 0 measures it)


@dataclass(frozen=True)
class EngineArgs:
    address: str
    engine: int
    requests: list[tuple[int, list[bytes]]]  # (trace index, keys)
    runs: list[RunSpec]
    tag: str
    block_bytes: int
    window: int
    floor_every: int
    copy: bool
    pending_wait: float  # seconds to wait for HIT_PENDING blocks (promotions)
    flush_after: float  # seconds a queued completion waits for a carrier call (batch runs)
    daemon_pid: int = 0  # engine 0 reads the daemon's CPU from /proc at each run's barriers


def _wait_turn(progress: Any, engine: int, index: int, window: int) -> None:
    """Blocks until every other engine has reached ``index - window`` in trace order."""
    while True:
        slowest = min((progress[j] for j in range(len(progress)) if j != engine), default=index)
        if slowest >= index - window:
            return
        time.sleep(0.0002)


def _engine_main(args: EngineArgs, barrier: Any, progress: Any, results: Any) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from benchmarks.common import cpu_seconds
    from kvtierd_client.client import Client

    clients = {True: Client(args.address, timeout=30)}
    channel = grpc.insecure_channel(args.address.replace("unix://", "unix:", 1))
    health = health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest()
    try:
        for run in args.runs:
            extra = (
                {"queue_completions": True, "flush_after": args.flush_after} if run.batch else {}
            )
            client = clients.get(run.fast_lane)
            if client is None:
                client = clients[run.fast_lane] = Client(
                    args.address, timeout=30, fast_lane=run.fast_lane
                )
            session = client.open_session(
                run.pool(args.tag, args.engine),
                block_bytes=args.block_bytes,
                num_blocks=run.pool_blocks,
                eviction_policy=run.policy,
                client_name=f"replay-e{args.engine}",
                **extra,
            )
            barrier.wait()
            progress[args.engine] = args.requests[0][0] if args.requests else DONE
            barrier.wait()
            replay_one = _replay_pipelined if run.pipelined else _replay
            floors = _Floors(
                check=lambda: health.Check(check, timeout=30),
                batch=_empty_batch(channel, session.session_id),
            )
            measures_cpu = args.engine == 0 and args.daemon_pid > 0
            cpu_before = cpu_seconds(args.daemon_pid) if measures_cpu else 0.0
            result = replay_one(args, session, floors, progress)
            barrier.wait()  # every engine's steps are done: the run's daemon CPU ends here
            if measures_cpu:
                result.daemon_cpu = cpu_seconds(args.daemon_pid) - cpu_before
            session.close()
            result.rpcs = session.rpcs
            results.put((run.label, args.engine, result))
    finally:
        channel.close()
        for client in clients.values():
            client.close()


@dataclass(frozen=True)
class _Floors:
    """The two empty calls an engine times between its steps: the health ``Check``
    (no daemon code) and a ``Batch`` of no operations on the engine's own session
    (the step's method and handler, minus the operations)."""

    check: Callable[[], Any]
    batch: Callable[[], Any]


def _empty_batch(channel: Any, session_id: str) -> Callable[[], Any]:
    from kvtierd_client.wire.proto import pb2, pb2_grpc

    stub = pb2_grpc.KVTierStub(channel)
    request = pb2.BatchRequest(session_id=session_id)
    return lambda: stub.Batch(request, timeout=30)


def _replay(args: EngineArgs, session: Any, floors: _Floors, progress: Any) -> EngineResult:
    from kvtierd_client.client import LookupResult
    from kvtierd_client.errors import FailedPrecondition

    out = EngineResult()
    region = kv = None
    if args.copy:
        import numpy as np

        from kvtierd_client.region import AttachedRegion

        attached = AttachedRegion.attach(
            session.region.path, session.region.num_blocks, session.region.block_bytes
        )
        region = attached.numpy()
        longest = max((len(keys) for _, keys in args.requests), default=1)
        kv = np.full((longest, args.block_bytes), args.engine, dtype=np.uint8)
    hit, pending = LookupResult.HIT, LookupResult.HIT_PENDING
    started = time.perf_counter()
    for step, (index, keys) in enumerate(args.requests):
        _wait_turn(progress, args.engine, index, args.window)
        rpcs_before = session.rpcs
        copy_s = 0.0
        t0 = time.perf_counter()
        results = session.lookup(keys)
        k = leading_hits(results, hit)
        waited = 0
        if k < len(keys) and results[k] == pending and args.pending_wait > 0:
            # a promotion (or another engine's write) is in flight: ask again shortly
            deadline = time.perf_counter() + args.pending_wait
            first = k
            while k < len(keys) and results[k] == pending and time.perf_counter() < deadline:
                time.sleep(0.0005)
                results = session.lookup(keys)
                k = leading_hits(results, hit)
            waited = max(0, k - first)
        if k:
            try:
                block_ids = session.prepare_load(keys[:k])
            except FailedPrecondition:  # evicted by another engine since the lookup
                out.load_races += 1
                k = leading_hits(session.lookup(keys), hit)
                try:
                    block_ids = session.prepare_load(keys[:k]) if k else []
                except FailedPrecondition:
                    k, block_ids = 0, []
            if k:
                if region is not None:
                    c0 = time.perf_counter()
                    kv[:k] = region[block_ids]
                    copy_s += time.perf_counter() - c0
                session.complete_load(keys[:k])
                session.touch(keys[:k])
        if k < len(keys):
            grant = session.prepare_store(keys[k:])
            if grant is None:
                out.store_rejected += 1
            elif grant.keys_to_store:
                if region is not None:
                    c0 = time.perf_counter()
                    region[grant.block_ids] = kv[: len(grant.block_ids)]
                    copy_s += time.perf_counter() - c0
                session.complete_store(grant.keys_to_store)
                out.stored += len(grant.keys_to_store)
                out.evicted += len(grant.evicted_keys)
        out.latencies.append(time.perf_counter() - t0 - copy_s)
        out.pending_hits += min(waited, k)
        _end_step(args, out, step, len(keys), k, session.rpcs - rpcs_before, floors, progress)
    out.wall = time.perf_counter() - started
    return out


def _end_step(
    args: EngineArgs,
    out: EngineResult,
    step: int,
    looked_up: int,
    hits: int,
    rpcs: int,
    floors: _Floors,
    progress: Any,
) -> None:
    """Books one step, publishes progress, and times both empty-call floors every few
    steps (alternating which goes first, so neither always runs right after a step)."""
    out.step_rpcs.append(rpcs)
    out.steps += 1
    out.looked_up += looked_up
    out.hits += hits
    out.loaded += hits
    progress[args.engine] = args.requests[step + 1][0] if step + 1 < len(args.requests) else DONE
    if args.floor_every and step % args.floor_every == 0:
        timed = [(floors.check, out.empty), (floors.batch, out.empty_batch)]
        if (step // args.floor_every) % 2:
            timed.reverse()
        for call, samples in timed:
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)


def _replay_pipelined(
    args: EngineArgs, session: Any, floors: _Floors, progress: Any
) -> EngineResult:
    """One ``Batch`` round trip per step, as an engine scheduler would issue it:
    the previous step's completions (queued by the session), the PrepareStore of
    the previous request's computed blocks, and this request's prefix Lookup with
    pins (``lookup_and_pin``: no separate PrepareLoad). Stored blocks become
    readable one step later than in the unpipelined replay, as in vLLM, where a
    block computed in step N is stored after the step."""
    out = EngineResult()
    to_store: list[bytes] = []
    started = time.perf_counter()
    for step, (index, keys) in enumerate(args.requests):
        _wait_turn(progress, args.engine, index, args.window)
        rpcs_before = session.rpcs
        t0 = time.perf_counter()
        k = pipelined_step(session, keys, to_store, out)
        to_store = keys[k:]
        out.latencies.append(time.perf_counter() - t0)
        _end_step(args, out, step, len(keys), k, session.rpcs - rpcs_before, floors, progress)
    if to_store:  # the last request's blocks, after the last step
        _complete_pipelined_store(session, session.batch([("prepare_store", to_store, {})])[0], out)
    session.flush()
    out.wall = time.perf_counter() - started
    return out


def pipelined_step(
    session: Any, keys: list[bytes], to_store: list[bytes], out: EngineResult
) -> int:
    """One engine step in one ``Batch``: the session's queued completions, the
    PrepareStore of ``to_store`` (the previous request's computed blocks; their
    CompleteStore is queued) and a pinned prefix Lookup of ``keys``, whose hit
    prefix is then completed (queued: it rides on the next step's Batch). Returns
    the hit prefix length; ``keys[k:]`` are the next step's ``to_store``."""
    from kvtierd_client.errors import KvtierError

    calls = [("prepare_store", to_store, {})] if to_store else []
    answers = session.batch([*calls, ("lookup_and_pin", keys, {"prefix": True})])
    if to_store:
        _complete_pipelined_store(session, answers[0], out)
    looked = answers[-1]
    if isinstance(looked, KvtierError):
        raise looked
    _results, block_ids = looked
    k = next((i for i, row in enumerate(block_ids) if row < 0), len(keys))
    if k:
        session.complete_load(keys[:k])
        session.touch(keys[:k])
    return k


def _complete_pipelined_store(session: Any, grant: Any, out: EngineResult) -> None:
    from kvtierd_client.errors import KvtierError

    if isinstance(grant, KvtierError):
        raise grant
    if grant is None:
        out.store_rejected += 1
    elif grant.keys_to_store:
        session.complete_store(grant.keys_to_store)  # queued
        out.stored += len(grant.keys_to_store)
        out.evicted += len(grant.evicted_keys)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


@dataclass
class ModeResult:
    run: RunSpec
    engines: int
    capacity: int
    block_bytes: int
    merged: EngineResult
    daemon_stats: dict[str, int]

    @property
    def hit_rate(self) -> float:
        return self.merged.hits / self.merged.looked_up if self.merged.looked_up else 0.0

    @property
    def rpcs_per_step(self) -> float:
        return self.merged.rpcs / self.merged.steps if self.merged.steps else 0.0

    def latency(self, q: float) -> float:
        return percentile(self.merged.latencies, q) if self.merged.latencies else 0.0

    @property
    def daemon_cpu_per_step(self) -> float:
        """Daemon CPU seconds per engine step over the run (floors included, if timed)."""
        return self.merged.daemon_cpu / self.merged.steps if self.merged.steps else 0.0

    @property
    def empty_p50(self) -> float:
        return percentile(self.merged.empty, 0.5) if self.merged.empty else 0.0

    @property
    def empty_batch_p50(self) -> float:
        return percentile(self.merged.empty_batch, 0.5) if self.merged.empty_batch else 0.0


def batch_supported() -> bool:
    from kvtierd_client.client import Client

    return "queue_completions" in inspect.signature(Client.open_session).parameters


def _merge(parts: list[EngineResult]) -> EngineResult:
    merged = EngineResult()
    for part in parts:
        for name in ("steps", "looked_up", "hits", "pending_hits", "loaded", "stored",
                     "evicted", "store_rejected", "load_races", "rpcs"):  # fmt: skip
            setattr(merged, name, getattr(merged, name) + getattr(part, name))
        merged.latencies += part.latencies
        merged.step_rpcs += part.step_rpcs
        merged.empty += part.empty
        merged.empty_batch += part.empty_batch
        merged.wall = max(merged.wall, part.wall)
        merged.daemon_cpu = max(merged.daemon_cpu, part.daemon_cpu)
    return merged


def _pool_stats(client: Any, pools: list[str]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for name in pools:
        for pool in client.get_stats(name).pools:
            for tier in pool.tiers:
                prefix = "primary" if tier.tier == "primary" else "secondary"
                for stat in ("hits", "misses", "evictions", "promoted_blocks"):
                    key = f"{prefix}_{stat}"
                    totals[key] = totals.get(key, 0) + int(getattr(tier, stat))
    return totals


def replay(
    requests: Sequence[Request],
    *,
    engines: int = 4,
    how: str = "rr",
    capacity: int,
    block_bytes: int = 4096,
    modes: Sequence[str] = ("isolated", "shared"),
    policies: Sequence[str] = ("lru", "arc"),
    batch: bool = False,
    window: int | None = None,
    floor_every: int = 4,
    copy: bool = False,
    fs_root: str | None = None,
    pending_wait_ms: float = 20.0,
    flush_after: float = DEFAULT_FLUSH_AFTER,
    grpc_too: bool = False,
    log: Any = sys.stderr,
) -> list[ModeResult]:
    """Replays ``requests`` once per (mode, policy) through one fresh daemon; with
    ``batch`` also once unbatched in the shared LRU mode (the RPC-count reference)
    and once pipelined; with ``grpc_too`` the pipelined run once more with
    ``Client(fast_lane=False)`` (daemon CPU per step: fast lane vs gRPC)."""
    from kvtierd_client.client import Client

    runs = [RunSpec(mode, policy, batch, capacity // engines if mode == "isolated" else capacity)
            for mode in modes for policy in policies]  # fmt: skip
    if batch and "shared" in modes:
        runs.append(RunSpec("shared", policies[0], False, capacity))
        runs.append(RunSpec("shared", policies[0], True, capacity, pipelined=True))
        if grpc_too:
            runs.append(
                RunSpec("shared", policies[0], True, capacity, pipelined=True, fast_lane=False)
            )
    queues = assign(requests, engines, how)
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**9}"
    budget = sum(r.pool_blocks * (engines if r.mode == "isolated" else 1) for r in runs)
    budget = budget * block_bytes + (64 << 20)
    args: list[str] = ["--memory-budget", str(budget)]
    daemon = None
    try:
        if fs_root is not None:
            daemon = _fs_daemon(fs_root, args)
        else:
            daemon = BenchDaemon(*args)
        ctx = mp.get_context("spawn")
        barrier, results, progress = (
            ctx.Barrier(engines),
            ctx.Queue(),
            ctx.Array("q", engines, lock=False),
        )
        procs = []
        for engine, queue in enumerate(queues):
            engine_args = EngineArgs(
                daemon.address, engine, [(r.index, request_keys(r)) for r in queue], runs, tag,
                block_bytes, engines * 2 if window is None else window, floor_every, copy,
                pending_wait_ms / 1000.0, flush_after, daemon.proc.pid,
            )  # fmt: skip
            procs.append(ctx.Process(target=_engine_main,
                                     args=(engine_args, barrier, progress, results)))  # fmt: skip
        for proc in procs:
            proc.start()
        out: list[ModeResult] = []
        with Client(daemon.address) as client:
            for run in runs:
                print(f"replay: {run.label} ({run.pool_blocks} blocks per pool) ...",
                      file=log, flush=True)  # fmt: skip
                parts = [_next_result(results, procs) for _ in range(engines)]
                if any(label != run.label for label, _, _ in parts):
                    raise RuntimeError("engines out of step")
                pools = sorted({run.pool(tag, e) for e in range(engines)})
                stats = _pool_stats(client, pools)
                merged = _merge([part for _, _, part in parts])
                out.append(ModeResult(run, engines, capacity, block_bytes, merged, stats))
        for proc in procs:
            proc.join(60)
            if proc.exitcode != 0:
                raise RuntimeError(f"engine process exited with {proc.exitcode}")
        return out
    finally:
        if daemon is not None:
            daemon.close()


def _next_result(results: Any, procs: list[Any], timeout: float = 3600.0) -> Any:
    """The next engine result; raises as soon as an engine died without one."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"engine process {dead[0].name} exited with {dead[0].exitcode} "
                    "(its traceback is above)"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine result in {timeout:.0f} s") from None


def _fs_daemon(fs_root: str, args: list[str]) -> BenchDaemon:
    import tempfile

    os.makedirs(fs_root, exist_ok=True)
    config = tempfile.NamedTemporaryFile(  # noqa: SIM115
        "w", prefix="kvtierd-replay-", suffix=".toml", delete=False
    )
    with config:
        config.write(f'[[tiers]]\ntype = "fs"\nname = "fs0"\nroot = "{fs_root}"\n')
    try:
        return BenchDaemon("--config", config.name, *args)
    finally:
        os.unlink(config.name)


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------

COLUMNS = ["mode", "policy", "batch", "pool blocks", "hit rate", "tokens saved",
           "blocks loaded", "blocks stored", "bytes moved", "evicted", "no room",
           "RPCs/step", "step p50 ms", "step p99 ms", "empty p50 ms", "p50/empty",
           "empty Batch p50 ms", "p50/empty Batch", "daemon CPU/step µs", "wall s"]  # fmt: skip


def table_rows(results: Sequence[ModeResult]) -> list[list[str]]:
    rows = []
    for r in results:
        m = r.merged
        moved = (m.loaded + m.stored) * r.block_bytes
        empty, empty_batch = r.empty_p50, r.empty_batch_p50
        rows.append([
            r.run.mode, r.run.policy,
            ("pipelined" if r.run.pipelined else "yes" if r.run.batch else "no")
            + ("" if r.run.fast_lane else ", gRPC only"),
            f"{r.engines}x{r.run.pool_blocks}" if r.run.mode == "isolated"
            else str(r.run.pool_blocks),
            f"{r.hit_rate:.2%}", f"{m.hits * TOKENS_PER_BLOCK:,}", f"{m.loaded:,}",
            f"{m.stored:,}", f"{moved / 2**20:,.1f} MiB", f"{m.evicted:,}",
            str(m.store_rejected), f"{r.rpcs_per_step:.2f}", f"{r.latency(0.5) * 1e3:.2f}",
            f"{r.latency(0.99) * 1e3:.2f}", f"{empty * 1e3:.2f}",
            f"{r.latency(0.5) / empty:.2f}x" if empty else "", f"{empty_batch * 1e3:.2f}",
            f"{r.latency(0.5) / empty_batch:.2f}x" if empty_batch else "",
            f"{r.daemon_cpu_per_step * 1e6:.0f}", f"{m.wall:.1f}",
        ])  # fmt: skip
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in table]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def bench_rows(results: Sequence[ModeResult], group: str) -> list[Row]:
    """The replay in `make bench`'s table: every run's hit rate (shared next to isolated);
    RPCs per step and step latency (vs the empty RPC of the same run) of the shared runs."""
    rows: list[Row] = []
    isolated = {r.run.policy: r.hit_rate for r in results if r.run.mode == "isolated"}
    for r in results:
        label = r.run.label + ("" if r.run.batch else " (unbatched)")
        base = isolated.get(r.run.policy) if r.run.mode == "shared" else None
        rows.append(Row(group, f"{label}: hit rate", r.hit_rate * 100, "%",
                        "" if base is None else f"isolated {base:.1%}",
                        r.hit_rate / base if base else None,
                        "" if base is None else ">= isolated"))  # fmt: skip
    for r in results:
        if r.run.mode != "shared":
            continue
        label = r.run.label + ("" if r.run.batch else " (unbatched)")
        empty = r.empty_p50
        rows.append(Row(group, f"{label}: RPCs per step", r.rpcs_per_step, "RPCs",
                        target="<= 1.2 (8 engines)"))  # fmt: skip
        rows.append(Row(group, f"{label}: step p50", r.latency(0.5) * 1e6, "us",
                        f"empty RPC p50 {empty * 1e6:.0f} us" if empty else "",
                        r.latency(0.5) / empty if empty else None, "<= 1.5x"))  # fmt: skip
        batch = r.empty_batch_p50
        rows.append(Row(group, f"{label}: step p50 vs a Batch of no ops", r.latency(0.5) * 1e6,
                        "us", f"empty Batch p50 {batch * 1e6:.0f} us" if batch else "",
                        r.latency(0.5) / batch if batch else None, "<= 1.5x"))  # fmt: skip
        rows.append(Row(group, f"{label}: step p99", r.latency(0.99) * 1e6, "us"))
    return rows


def default_trace() -> str:
    """The trace used when none is given: $KVTIERD_REPLAY_TRACE when set and not empty, else
    the shipped one (so a fresh clone replays with no arguments). Not checked to exist."""
    return os.environ.get(DEFAULT_TRACE_ENV) or str(SHIPPED_TRACE)


def missing_trace_message(path: str) -> str:
    """What to tell a user whose trace ``path`` is not a readable file."""
    return (
        f"trace {path} not found; give a Mooncake-format JSONL path as the argument "
        f"(make: TRACE=path) or set {DEFAULT_TRACE_ENV}"
    )


SHORT_REQUESTS = 2000


def run() -> list[Row]:
    """`make bench` suite: the first 2,000 requests, 4 engines, 25 % of their distinct blocks;
    batched when the client can queue completions. The trace: $KVTIERD_REPLAY_TRACE, else the
    shipped one; when the trace named is missing the suite is skipped."""
    trace = default_trace()
    if not Path(trace).is_file():
        print(f"replay: skipped ({missing_trace_message(trace)})", file=sys.stderr)
        return []
    requests = load_trace(trace, SHORT_REQUESTS)
    engines = 4
    capacity = default_capacity(distinct_blocks(requests), engines)
    results = replay(requests, engines=engines, capacity=capacity, batch=batch_supported())
    group = f"replay {len(requests)} req, {engines} engines, C={capacity}"
    return bench_rows(results, group)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.replay``; the trace defaults to
    ``default_trace()`` as it is when this is called."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay", description=__doc__.split("\n\n")[0]
    )
    trace = default_trace()
    parser.add_argument(
        "trace",
        nargs="?",
        default=trace,
        help=f"Mooncake-format JSONL trace (default {trace}: ${DEFAULT_TRACE_ENV}, else the "
        "trace shipped in benchmarks/traces/)",
    )
    parser.add_argument("--engines", type=int, default=4, help="engine processes (4)")
    parser.add_argument(
        "--assign",
        choices=("rr", "hash"),
        default="rr",
        help="requests to engines: round-robin or hash of the first block",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=0,
        help="total capacity C (default: 25%% of the distinct blocks)",
    )
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.25,
        help="default C as a fraction of the distinct blocks (0.25)",
    )
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=4096,
        help="bytes per block; bytes moved are reported at this size (4096)",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--modes", default="isolated,shared", help="isolated,shared")
    parser.add_argument("--policies", default="lru,arc", help="lru,arc")
    parser.add_argument(
        "--batch",
        action="store_true",
        help="queue completions (Batch RPC); adds an unbatched shared row",
    )
    parser.add_argument(
        "--copy",
        action="store_true",
        help="copy the rows with numpy (excluded from control latency)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="how far (requests) an engine may run ahead (2 x engines)",
    )
    parser.add_argument(
        "--floor-every", type=int, default=4, help="time an empty RPC after every Nth step (4)"
    )
    parser.add_argument(
        "--grpc-too",
        action="store_true",
        help="with --batch: replay the pipelined shared run once more over gRPC only "
        "(Client(fast_lane=False)), to compare the daemon's CPU per step with the fast lane's "
        "(use --floor-every 0: the timed floors are gRPC calls and cost daemon CPU)",
    )
    parser.add_argument("--fs-root", default=None, help="add an fs tier at this directory")
    parser.add_argument(
        "--pending-wait-ms",
        type=float,
        default=20.0,
        help="how long a step waits for HIT_PENDING blocks (20)",
    )
    parser.add_argument(
        "--flush-after-ms",
        type=float,
        default=DEFAULT_FLUSH_AFTER * 1000.0,
        help="with --batch: how long a queued completion waits for the engine's next call "
        "before it is sent alone (%(default)g: the vLLM adapter's kvtierd_flush_after; "
        "the client library's own default is 5)",
    )
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        parser.error(missing_trace_message(args.trace))
    if args.engines < 1:
        parser.error("--engines must be >= 1")
    if args.flush_after_ms < 0:
        parser.error("--flush-after-ms must be >= 0")
    if args.grpc_too and not args.batch:
        parser.error("--grpc-too needs --batch (it repeats the pipelined run, which batches)")
    if args.batch and not batch_supported():
        print("replay: this client cannot queue completions; --batch ignored", file=sys.stderr)
        args.batch = False

    requests = load_trace(args.trace, args.limit)
    if not requests:
        parser.error(f"{args.trace}: no requests")
    distinct = distinct_blocks(requests)
    capacity = args.capacity_blocks or default_capacity(
        distinct, args.engines, args.capacity_fraction
    )
    capacity -= capacity % args.engines
    if capacity < args.engines:
        parser.error("--capacity-blocks must be at least --engines")
    looked_up = sum(len(set(r.hash_ids)) for r in requests)
    per_engine = [len(q) for q in assign(requests, args.engines, args.assign)]
    tier = "primary + fs" if args.fs_root else "primary only"
    header = (
        f"trace {args.trace}: {len(requests)} requests, {looked_up:,} blocks looked up, "
        f"{distinct:,} distinct blocks; unbounded-cache prefix hit rate "
        f"{unbounded_hit_rate(requests):.2%}\n"
        f"engines {args.engines} (assign {args.assign}: {per_engine} requests), capacity "
        f"C = {capacity:,} blocks ({capacity / distinct:.0%} of distinct) x {args.block_bytes} B;"
        f" isolated = {args.engines} x {capacity // args.engines:,}; "
        f"copy {'numpy' if args.copy else 'none'}; tier {tier}"
        f"{f'; flush after {args.flush_after_ms:g} ms' if args.batch else ''}\n"
        f"machine: {machine()}"
    )
    print(header, flush=True)
    results = replay(
        requests,
        engines=args.engines,
        how=args.assign,
        capacity=capacity,
        block_bytes=args.block_bytes,
        modes=[m for m in args.modes.split(",") if m],
        policies=[p for p in args.policies.split(",") if p],
        batch=args.batch,
        window=args.window,
        floor_every=args.floor_every,
        copy=args.copy,
        fs_root=args.fs_root,
        pending_wait_ms=args.pending_wait_ms,
        flush_after=args.flush_after_ms / 1000.0,
        grpc_too=args.grpc_too,
    )
    text = markdown_table(COLUMNS, table_rows(results))
    print()
    print(text)
    notes = []
    for r in results:
        m, s = r.merged, r.daemon_stats
        note = (
            f"{r.run.label}: load races {m.load_races}, mean RPCs/step {r.rpcs_per_step:.2f}, "
            f"daemon CPU {m.daemon_cpu:.2f} s over {m.steps:,} steps"
        )
        if args.fs_root:
            note += (
                f", primary hits (daemon) {s.get('primary_hits', 0):,}, fs hits "
                f"{s.get('secondary_hits', 0):,}, "
                f"promoted {s.get('secondary_promoted_blocks', 0):,}"
                f", hits after HIT_PENDING {m.pending_hits:,}"
            )
        notes.append(note)
    print("\n" + "\n".join(notes), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write(f"{header}\n\n{text}\n\n" + "\n".join(notes) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
