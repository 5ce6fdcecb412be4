"""One engine of the fleet benchmark: a process replaying its node's requests (vLLM's steps).

Each engine has one session on its node's daemon (the fast lane, as the vLLM
plug-in) and its region attached. Per request, in trace order:

1. a prefix ``Lookup`` of the request's chain; while the answer's leading run
   ends at a HIT_PENDING or RETRY block, the engine asks again one scheduler step
   (``step_s``) later, as vLLM's scheduler does (at most ``max_steps`` times);
2. ``PrepareLoad`` of the leading HITs; every loaded row is compared with the
   bytes stored under its key (a mismatch is counted: it must never happen);
   ``CompleteLoad`` and ``Touch``;
3. ``PrepareStore`` of the rest, the rows written (a function of the key),
   ``CompleteStore``: the daemon cascades them to its shared tier.

A request starts at its arrival time (its trace timestamp divided by
``speedup``, from a start time common to every engine; ``speedup`` 0: at once)
and only when every other engine has reached the request ``window`` places
before it in trace order (``benchmarks.replay``'s rule), so the fleet replays
the trace nearly in its order, as the model does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.replay import DONE, leading_hits

MAX_LOOKUP_SAMPLES = 1 << 16


@dataclass(frozen=True)
class EngineArgs:
    address: str
    engine: int
    pool: str
    block_bytes: int
    node_blocks: int
    requests: list[tuple[int, float, list[bytes]]]  # (trace index, timestamp ms, chain)
    window: int
    step_s: float
    max_steps: int
    speedup: float = 0.0  # trace time / replay time; 0: as fast as the fleet goes


@dataclass
class EngineResult:
    requests: int = 0
    looked_up: int = 0
    hits: int = 0
    pending_hits: int = 0  # hits whose first answer was HIT_PENDING (promotions)
    first_pending: int = 0  # blocks the first lookup of a request answered HIT_PENDING
    mismatches: int = 0  # loaded rows whose bytes were not their key's: must stay 0
    loaded: int = 0
    stored: int = 0
    store_refused: int = 0
    load_races: int = 0
    extra_steps: int = 0  # lookups asked again a step later
    gave_up: int = 0  # requests still pending after max_steps
    rpcs: int = 0
    first_lookup_s: list[float] = field(default_factory=list)  # each request's first Lookup
    # (trace index, blocks hit, the first lookup's answers: H, P, M, R per block)
    per_request: list[tuple[int, int, str]] = field(default_factory=list)
    wall: float = 0.0

    def merge(self, other: EngineResult) -> None:
        for name in (
            "requests", "looked_up", "hits", "pending_hits", "first_pending", "mismatches",
            "loaded", "stored", "store_refused", "load_races", "extra_steps", "gave_up", "rpcs",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.first_lookup_s += other.first_lookup_s
        self.per_request += other.per_request
        self.wall = max(self.wall, other.wall)


def block_payload(key: bytes, block_bytes: int) -> bytes:
    """The bytes stored under ``key``: the key repeated (8-byte keys)."""
    return (key * (block_bytes // len(key) + 1))[:block_bytes]


def engine_main(args: EngineArgs, barrier: Any, progress: Any, start: Any, results: Any) -> None:
    """The process body: opens the session, replays, puts its EngineResult."""
    from kvtierd_client.client import Client
    from kvtierd_client.region import attach_announced

    client = Client(args.address, timeout=60)
    session = client.open_session(
        args.pool, block_bytes=args.block_bytes, num_blocks=args.node_blocks,
        eviction_policy="lru", client_name=f"fleet-e{args.engine}",
    )  # fmt: skip
    attached = attach_announced(
        session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
    )
    try:
        barrier.wait()
        progress[args.engine] = args.requests[0][0] if args.requests else DONE
        barrier.wait()
        # trace time 0: time.monotonic() is system-wide on Linux
        result = _replay(args, session, attached.numpy(), progress, start.value)
        result.rpcs = session.rpcs
        results.put((args.engine, result))
    finally:
        attached.close()
        session.close()
        client.close()


def _wait_turn(progress: Any, engine: int, index: int, window: int) -> None:
    while True:
        slowest = min((progress[j] for j in range(len(progress)) if j != engine), default=index)
        if slowest >= index - window:
            return
        time.sleep(0.0002)


def _replay(
    args: EngineArgs, session: Any, region: Any, progress: Any, start: float
) -> EngineResult:
    out = EngineResult()
    started = time.perf_counter()
    for step, (index, timestamp, keys) in enumerate(args.requests):
        if args.speedup:
            late = time.monotonic() - (start + timestamp / 1000 / args.speedup)
            if late < 0:
                time.sleep(-late)
        _wait_turn(progress, args.engine, index, args.window)
        k, first = _look_up(args, session, keys, out)
        k = _load(args, session, region, keys, k, out)
        out.per_request.append((index, k, first))
        _store(args, session, region, keys[k:], out)
        out.requests += 1
        out.looked_up += len(keys)
        out.hits += k
        nxt = args.requests[step + 1][0] if step + 1 < len(args.requests) else DONE
        progress[args.engine] = nxt
    out.wall = time.perf_counter() - started
    return out


def _look_up(
    args: EngineArgs, session: Any, keys: list[bytes], out: EngineResult
) -> tuple[int, str]:
    """The request's lookups until its leading run is settled: the HITs it loads, and
    the first lookup's answers (one letter per block)."""
    from kvtierd_client.client import LookupResult

    hit, waiting = LookupResult.HIT, (LookupResult.HIT_PENDING, LookupResult.RETRY)
    t0 = time.perf_counter()
    results = session.lookup(keys, prefix=True)
    if len(out.first_lookup_s) < MAX_LOOKUP_SAMPLES:
        out.first_lookup_s.append(time.perf_counter() - t0)
    out.first_pending += results.count(LookupResult.HIT_PENDING)
    answers = "".join(r.name[0] if r != LookupResult.HIT_PENDING else "P" for r in results)
    k = first = leading_hits(results, hit)
    steps = 0
    while k < len(keys) and results[k] in waiting:
        if steps >= args.max_steps:
            out.gave_up += 1
            break
        time.sleep(args.step_s)  # the scheduler's next step
        steps += 1
        results = session.lookup(keys, prefix=True)
        k = leading_hits(results, hit)
    out.extra_steps += steps
    out.pending_hits += max(0, k - first)
    return k, answers


def _load(
    args: EngineArgs, session: Any, region: Any, keys: list[bytes], k: int, out: EngineResult
) -> int:
    """Loads the ``k`` leading HITs, verifying each row; how many it loaded."""
    import numpy as np

    from kvtierd_client.client import LookupResult
    from kvtierd_client.errors import FailedPrecondition

    if not k:
        return 0
    try:
        rows = session.prepare_load(keys[:k])
    except FailedPrecondition:  # evicted by a promotion or store since the lookup
        out.load_races += 1
        k = leading_hits(session.lookup(keys, prefix=True), LookupResult.HIT)
        try:
            rows = session.prepare_load(keys[:k]) if k else []
        except FailedPrecondition:
            return 0
    for key, row in zip(keys[:k], rows, strict=True):
        expected = np.frombuffer(block_payload(key, args.block_bytes), dtype=np.uint8)
        if not np.array_equal(region[row], expected):
            out.mismatches += 1
    if k:
        session.complete_load(keys[:k])
        session.touch(keys[:k])
    out.loaded += k
    return k


def _store(
    args: EngineArgs, session: Any, region: Any, keys: list[bytes], out: EngineResult
) -> None:
    import numpy as np

    if not keys:
        return
    grant = session.prepare_store(keys)
    if grant is None:
        out.store_refused += 1
        return
    for key, row in zip(grant.keys_to_store, grant.block_ids, strict=True):
        region[row] = np.frombuffer(block_payload(key, args.block_bytes), dtype=np.uint8)
    if grant.keys_to_store:
        session.complete_store(grant.keys_to_store)
    out.stored += len(grant.keys_to_store)
