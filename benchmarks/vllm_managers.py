"""vLLM's in-process offloading managers and kvtierd on the same operation sequence.

Run with ``make bench-vllm [TRACE=path]`` (or ``.venv-vllm/bin/python -m
benchmarks.vllm_managers [TRACE]``). Replays the first ``--requests`` requests of a
Mooncake-format trace (JSONL with ``hash_ids``; default: ``$KVTIERD_REPLAY_TRACE``, else the
trace shipped in ``benchmarks/traces/``, as ``benchmarks.replay``) as the manager calls
of vLLM's offloading scheduler, one request after the other, against:

* vLLM's ``CPUOffloadingManager`` (in-process, LRU);
* vLLM's ``TieringOffloadingManager`` over a ``CPUPrimaryTierOffloadingManager``
  (an mmap region in /dev/shm, no secondary tier; no GPU needed);
* kvtierd's vLLM plug-in (``KvtierdOffloadingManager``): stores asked at
  ``prepare_store`` time, and asked ahead by the lookup's round trip, in vLLM
  0.33's call order (``on_schedule_end`` after the step's ``prepare_store``) and
  in 0.32's (before it);
* kvtierd through the client: single RPCs, and with ``queue_completions``
  (completions ride on the next call that needs an answer).

All get the same capacity (``--capacity`` blocks) and the LRU policy. Per request:
the prefix chain is looked up key by key until the first miss (kvtierd: one
``Lookup`` of the chain, the hit run is its leading HITs), the hit prefix is loaded
(``prepare_load`` + ``complete_load``) and touched, the rest is stored
(``prepare_store`` + ``complete_store`` of the keys granted). Keys are vLLM's
offload keys: the 8-byte hash id and the 4-byte group index 0.

Both LRUs order blocks the same way on this sequence (a completed store and a touch
are uses; the first key of a touch ends the most recent; keys offered to a store are
never its victims), so the per-request hit counts must agree exactly: the benchmark
checks it and reports the first request where they differ.

``vLLM``'s ``on_request_finished`` is not called (kvtierd has no counterpart; for
LRU it would act as one more touch of the request's keys).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.replay import default_trace, missing_trace_message

BLOCK_BYTES = 4096  # the manager does not touch the bytes; the smallest row
TOKENS_PER_BLOCK = 16  # the key positions' unit (end token of each block)


def load_chains(path: Path, requests: int) -> list[list[bytes]]:
    """The first ``requests`` prefix chains of the trace, as offload keys (duplicates
    inside one chain dropped, first occurrence kept)."""
    chains: list[list[bytes]] = []
    with open(path) as handle:
        for line in handle:
            if len(chains) >= requests:
                break
            if not line.strip():
                continue
            ids = json.loads(line)["hash_ids"]
            keys = [int(h).to_bytes(8, "big") + (0).to_bytes(4, "big") for h in ids]
            chains.append(list(dict.fromkeys(keys)))
    return chains


@dataclass
class Run:
    """One manager's replay: wall time, per-request hits and what was moved."""

    name: str
    seconds: float = 0.0
    hits: list[int] = field(default_factory=list)  # leading hits per request
    looked_up: int = 0
    stored: int = 0
    store_refused: int = 0
    rpcs: int | None = None
    note: str = ""

    def block_ops(self) -> int:
        """Keys looked up + loaded + stored (the same for every manager that agrees)."""
        return self.looked_up + sum(self.hits) + self.stored

    def hit_rate(self) -> float:
        return sum(self.hits) / self.looked_up if self.looked_up else 0.0


# ----------------------------------------------------------------------- vLLM


def replay_vllm(
    name: str, manager: Any, chains: Sequence[list[bytes]], schedule_end_first: bool = False
) -> Run:
    """One request per scheduler step. ``schedule_end_first``: vLLM 0.32's call
    order (``on_schedule_end`` before the step's ``prepare_store``); else 0.33's."""
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

    run = Run(name)
    keyed = [[OffloadKey(k) for k in chain] for chain in chains]
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    hit = LookupResult.HIT
    start = time.perf_counter()
    for i, chain in enumerate(keyed):
        ctx = ReqContext(req_id=str(i))
        for position, key in enumerate(chain):  # as vLLM's scheduler records them
            ctx.set_offload_key_position(key, (position + 1) * TOKENS_PER_BLOCK)
        manager.on_new_request(ctx)
        n = 0
        for key in chain:
            if manager.lookup(key, ctx) is not hit:
                break
            n += 1
        if n:
            loaded = chain[:n]
            manager.prepare_load(loaded, ctx)
            manager.complete_load(loaded, ctx)
            manager.touch(loaded, ctx)
        if schedule_end_first:
            manager.on_schedule_end(end)
        rest = chain[n:]
        if rest:
            out = manager.prepare_store(rest, ctx)
            if out is None:
                run.store_refused += 1
            elif out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
                run.stored += len(out.keys_to_store)
        if not schedule_end_first:
            manager.on_schedule_end(end)
        run.hits.append(n)
        run.looked_up += len(chain)
    run.seconds = time.perf_counter() - start
    return run


def cpu_manager(capacity: int) -> tuple[Any, Callable[[], None]]:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=capacity, cache_policy="lru"), lambda: None


def tiering_manager(capacity: int) -> tuple[Any, Callable[[], None]]:
    """vLLM's tiering manager over its CPU primary tier (an mmap region in /dev/shm)
    and no secondary tier."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    region = SharedOffloadRegion(
        engine_id=f"kvtierd-bench-{uuid.uuid4().hex[:8]}",
        num_chunks=capacity,
        rank=None,
        kv_bytes_per_chunk=BLOCK_BYTES,
        cpu_page_size=BLOCK_BYTES,
    )
    primary = CPUPrimaryTierOffloadingManager(capacity, region, cache_policy="lru")
    manager = TieringOffloadingManager(primary, [])
    return manager, manager.shutdown


# -------------------------------------------------------------------- kvtierd


def plugin_manager(
    address: str,
    pool: str,
    capacity: int,
    store_ahead: bool,
    calls: Any = None,
    flush_after: float | None = None,
) -> tuple[Any, Callable[[], int]]:
    """kvtierd's vLLM plug-in manager (``KvtierdOffloadingManager``, as vLLM's
    scheduler gets it) on its own pool; the second value closes it and returns its
    round trips. ``calls``: the ``VllmCalls`` it expects (default: the installed
    vLLM's); ``flush_after``: ``kvtierd_flush_after`` (default: the plug-in's)."""
    from kvtierd_client.vllm.common import open_pool_session
    from kvtierd_client.vllm.manager import KvtierdOffloadingManager
    from kvtierd_client.vllm.settings import PluginSettings, PoolPlan

    settings = PluginSettings.from_extra_config(
        {"kvtierd_address": address, "eviction_policy": "lru", "kvtierd_stats_interval": 0,
         "kvtierd_store_ahead": store_ahead, "kvtierd_flush_after": flush_after}
    )  # fmt: skip
    plan = PoolPlan(
        name=pool, block_bytes=BLOCK_BYTES, num_blocks=capacity, layout="bench",
        world_size=1, blocks_per_chunk=1, sub_block_bytes=BLOCK_BYTES,
    )  # fmt: skip
    client, session = open_pool_session(settings, plan, "bench", queue_completions=True)
    manager = KvtierdOffloadingManager(
        client, session, settings, plan, events_enabled=False, client_name="bench", calls=calls
    )

    def close() -> int:
        round_trips = manager.step_stats().round_trips
        manager.shutdown()
        return round_trips

    return manager, close


def replay_plugin(address: str, capacity: int, chains: Sequence[list[bytes]]) -> list[Run]:
    """The plug-in's manager with stores asked at ``prepare_store`` time and asked
    ahead, in vLLM 0.33's call order and in 0.32's (each on its own pool)."""
    from kvtierd_client.vllm.compat import VllmCalls

    runs = []
    for store_ahead, release in ((False, (0, 33)), (True, (0, 33)), (True, (0, 32))):
        calls = VllmCalls.of_release(release)
        label = "stores asked ahead" if store_ahead else "prepare_store asks"
        order = f"{release[0]}.{release[1]} order"
        pool = f"bench/vllm-managers/plugin-{'ahead' if store_ahead else 'asks'}-{order[:4]}"
        manager, close = plugin_manager(address, pool, capacity, store_ahead, calls)
        name = f"kvtierd vLLM plug-in, {label}, {order}"
        run = replay_vllm(name, manager, chains, schedule_end_first=not calls.schedule_end_last)
        run.rpcs = close()
        runs.append(run)
    return runs


def replay_kvtierd(
    name: str, address: str, pool: str, capacity: int, chains: Sequence[list[bytes]], queue: bool
) -> Run:
    from kvtierd_client.client import Client, LookupResult

    run = Run(name)
    hit = LookupResult.HIT
    with (
        Client(address) as client,
        client.open_session(
            pool,
            block_bytes=BLOCK_BYTES,
            num_blocks=capacity,
            eviction_policy="lru",
            queue_completions=queue,
        ) as session,
    ):
        start = time.perf_counter()
        for chain in chains:
            results = session.lookup(chain)
            n = 0
            for result in results:
                if result is not hit:
                    break
                n += 1
            if n:
                loaded = chain[:n]
                session.prepare_load(loaded)
                session.complete_load(loaded)
                session.touch(loaded)
            rest = chain[n:]
            if rest:
                grant = session.prepare_store(rest)
                if grant is None:
                    run.store_refused += 1
                elif grant.keys_to_store:
                    session.complete_store(grant.keys_to_store)
                    run.stored += len(grant.keys_to_store)
            run.hits.append(n)
            run.looked_up += len(chain)
        session.flush()
        run.seconds = time.perf_counter() - start
        run.rpcs = session.rpcs
        if session.deferred_errors:
            run.note = f"{len(session.deferred_errors)} queued ops failed"
    return run


# ---------------------------------------------------------------------- main


def set_vllm_env() -> None:
    """vLLM's CPU build, with the core binding every vLLM benchmark here uses: one reserved
    core whether or not a kv_transfer_config is given (docs/guides/vllm.md, "Tests and
    benchmarks"). Set before vLLM is imported; values the caller exported win."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def build_parser() -> argparse.ArgumentParser:
    """The command line; the trace defaults to ``benchmarks.replay.default_trace()`` as it is
    when this is called."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trace = default_trace()
    parser.add_argument(
        "trace",
        nargs="?",
        type=Path,
        default=Path(trace),
        help=f"Mooncake-format JSONL trace (default {trace})",
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--capacity", type=int, default=8192, help="blocks, every manager")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(missing_trace_message(str(args.trace)))

    set_vllm_env()
    from benchmarks.common import BenchDaemon, machine

    chains = load_chains(args.trace, args.requests)
    runs: list[Run] = []
    manager, close = cpu_manager(args.capacity)
    runs.append(replay_vllm("vLLM CPUOffloadingManager (in-process)", manager, chains))
    close()
    try:
        manager, close = tiering_manager(args.capacity)
    except Exception as err:  # noqa: BLE001 - report why, keep the other rows
        print(f"TieringOffloadingManager not constructible here: {err!r}", file=sys.stderr)
    else:
        try:
            runs.append(replay_vllm("vLLM TieringOffloadingManager (in-process)", manager, chains))
        finally:
            close()
    with BenchDaemon("--memory-budget", "256MiB") as daemon:
        runs.extend(replay_plugin(daemon.address, args.capacity, chains))
        for queue, label in ((False, "single RPCs"), (True, "queue_completions")):
            pool = f"bench/vllm-managers/{'queued' if queue else 'single'}"
            runs.append(
                replay_kvtierd(
                    f"kvtierd, {label}", daemon.address, pool, args.capacity, chains, queue
                )
            )

    print(
        f"Same operation sequence: first {len(chains)} requests of {args.trace.name}, "
        f"{runs[0].looked_up} keys looked up, capacity {args.capacity} blocks, LRU"
    )
    print(f"machine: {machine()}")
    header = (
        f"{'manager':<56} {'block ops/s':>12} {'us/request':>11} {'hit rate':>9} "
        f"{'stored':>7} {'refused':>8} {'RPCs/request':>13}"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        rpcs = "" if run.rpcs is None else f"{run.rpcs / len(chains):.2f}"
        print(
            f"{run.name:<56} {run.block_ops() / run.seconds:>12,.0f} "
            f"{run.seconds / len(chains) * 1e6:>11.1f} {run.hit_rate():>9.4f} "
            f"{run.stored:>7} {run.store_refused:>8} {rpcs:>13}"
            + (f"  ({run.note})" if run.note else "")
        )
    reference = runs[0]
    agree = True
    for run in runs[1:]:
        diff = first_difference(reference.hits, run.hits)
        if diff is not None:
            agree = False
            print(
                f"HIT MISMATCH: {run.name} differs from {reference.name} first at request "
                f"{diff}: {run.hits[diff]} vs {reference.hits[diff]} leading hits"
            )
    if agree:
        print(
            f"hits agree request by request across all {len(runs)} managers "
            f"({sum(reference.hits)} hit blocks)"
        )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
