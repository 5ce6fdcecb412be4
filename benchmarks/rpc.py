"""Control-plane latency over the Unix socket, next to an empty RPC on the same server.

The empty RPC is the standard health Check: same server, same transport, no
daemon work. Each manager operation is timed per call in 1 and 8 client
processes; the daemon's CPU cost per key is measured from /proc at 1,024 keys.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from benchmarks.replay import EngineResult, pipelined_step
from kvtierd_client.client import Client

POOL = "bench/rpc"
BLOCK = 4096
ITERATIONS = {1: 1500, 8: 300}
WARMUP = 100


def _keys(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{prefix}-{i:012d}-".encode().ljust(36, b"k") for i in range(start, start + n)]


def _timed(fn: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def _worker(address: str, worker: int, iterations: int, barrier, results) -> None:  # noqa: ANN001
    client = Client(address)
    session = client.open_session(POOL, block_bytes=BLOCK)
    channel = grpc.insecure_channel("unix:" + address[len("unix://") :])
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    hot = _keys("hot", 32)
    load16 = hot[:16]
    counter = iter(range(10**9))

    def store16() -> None:
        batch = _keys(f"w{worker}-{next(counter)}", 16)
        grant = session.prepare_store(batch)
        session.complete_store(grant.keys_to_store if grant else batch)

    def load() -> None:
        session.prepare_load(load16)
        session.complete_load(load16)

    ops = {
        "empty RPC (health Check)": lambda: health.Check(request, timeout=5),
        "Lookup(32 keys)": lambda: session.lookup(hot),
        "PrepareStore+CompleteStore(16 keys)": store16,
        "PrepareLoad+CompleteLoad(16 keys)": load,
    }
    out = {}
    for name, fn in ops.items():
        barrier.wait()
        t0 = time.perf_counter()
        samples = _timed(fn, iterations)
        out[name] = (samples, time.perf_counter() - t0)
    results.put(out)
    session.close()
    client.close()


def _run_clients(address: str, processes: int) -> dict[str, tuple[list[float], float]]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    iterations = ITERATIONS[processes]
    procs = [ctx.Process(target=_worker, args=(address, w, iterations, barrier, results))
             for w in range(processes)]  # fmt: skip
    for proc in procs:
        proc.start()
    merged: dict[str, tuple[list[float], float]] = {}
    for _ in procs:
        for name, (samples, elapsed) in results.get(timeout=600).items():
            old_samples, old_elapsed = merged.get(name, ([], 0.0))
            merged[name] = (old_samples + samples, max(old_elapsed, elapsed))
    for proc in procs:
        proc.join()
    return merged


def _daemon_cpu_per_key(daemon: BenchDaemon, session, keys: int, calls: int = 200) -> float:
    """Added daemon CPU seconds per key of Lookup at ``keys`` keys vs 1 key."""
    many, one = _keys("cpu", keys), _keys("cpu", 1)

    def cost(batch: list[bytes]) -> float:
        before = cpu_seconds(daemon.proc.pid)
        for _ in range(calls):
            session.lookup(batch)
        return cpu_seconds(daemon.proc.pid) - before

    cost(one)  # warm up
    return (cost(many) - cost(one)) / (calls * (keys - 1))


def _daemon_cpu_per_key_store(daemon: BenchDaemon, session, keys: int, calls: int = 50) -> float:
    counter = iter(range(10**9))

    def cost(n: int) -> float:
        before = cpu_seconds(daemon.proc.pid)
        for _ in range(calls):
            batch = _keys(f"st{next(counter)}", n)
            grant = session.prepare_store(batch)
            session.complete_store(grant.keys_to_store)
        return cpu_seconds(daemon.proc.pid) - before

    cost(1)
    return (cost(keys) - cost(1)) / (calls * (keys - 1))


BATCH_OPS = 32  # ops per Batch: e.g. 8 requests x (lookup, prepare, complete, touch)


def _batched_vs_single(daemon: BenchDaemon, rounds: int = 200) -> list[Row]:
    """Block operations per second at 16 keys per op: single RPCs vs one Batch of
    BATCH_OPS ops. Same ops, same order: Lookup, PrepareLoad, CompleteLoad, Touch."""
    from kvtierd_client.wire.proto import pb2, pb2_grpc

    client = Client(daemon.address)
    session = client.open_session(POOL, block_bytes=BLOCK)
    keys16 = _keys("hot", 16)
    steps = BATCH_OPS // 4

    def single() -> None:
        for _ in range(steps):
            session.lookup(keys16)
            session.prepare_load(keys16)
            session.complete_load(keys16)
            session.touch(keys16)

    ops = []
    for _ in range(steps):
        ops += [
            pb2.BatchOp(lookup=pb2.LookupRequest(keys=keys16)),
            pb2.BatchOp(prepare_load=pb2.PrepareLoadRequest(keys=keys16)),
            pb2.BatchOp(complete_load=pb2.CompleteLoadRequest(keys=keys16)),
            pb2.BatchOp(touch=pb2.TouchRequest(keys=keys16)),
        ]
    request = pb2.BatchRequest(session_id=session.session_id, ops=ops)
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        stub = pb2_grpc.KVTierStub(channel)

        def batched() -> None:
            results = stub.Batch(request, timeout=10).results
            if any(r.code for r in results):
                raise RuntimeError(f"batch op failed: {next(r.error for r in results if r.code)}")

        single_s = sum(_timed(single, rounds // 4))
        batched_s = sum(_timed(batched, rounds))
    block_ops = BATCH_OPS * 16
    single_rate = (rounds // 4) * block_ops / single_s
    batched_rate = rounds * block_ops / batched_s
    session.close()
    client.close()
    group = "batch, 1 client"
    return [
        Row(group, f"single RPCs, 16 keys/op ({BATCH_OPS} ops)", single_rate, "block ops/s"),
        Row(group, f"one Batch of {BATCH_OPS} ops x 16 keys", batched_rate, "block ops/s",
            "single RPCs", batched_rate / single_rate, ">= 5x"),
    ]  # fmt: skip


STEP_KEYS = 25  # a replayed request's typical prefix chain (synthetic trace mean)
CPU_CALLS = 1500


def _cpu_per_call(daemon: BenchDaemon) -> list[Row]:
    """Daemon and client CPU (``/proc``, ``process_time``) per empty RPC and per
    pipelined engine step: one ``Batch`` carrying the previous step's queued
    completions, the PrepareStore of its missing keys and a ``lookup_and_pin`` of
    STEP_KEYS keys, the replay's pipelined call pattern. What a step costs beyond
    an empty call is the control plane's own price; the rest is gRPC's."""
    client = Client(daemon.address)
    session = client.open_session("bench/step", block_bytes=BLOCK, num_blocks=4096,
                                  queue_completions=True)  # fmt: skip
    previous: list[bytes] = []
    tally = EngineResult()

    def step(i: int) -> None:
        nonlocal previous
        keys = [((i * 7919 + j) % 20000).to_bytes(8, "big") for j in range(STEP_KEYS)]
        previous = keys[pipelined_step(session, keys, previous, tally) :]

    rows: list[Row] = []
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest()
        calls = {
            "empty RPC (health Check)": lambda i: health.Check(check, timeout=10),
            f"pipelined step, {STEP_KEYS} keys": step,
        }
        for name, fn in calls.items():
            for i in range(WARMUP):
                fn(i)
            daemon0, client0 = cpu_seconds(daemon.proc.pid), time.process_time()
            for i in range(CPU_CALLS):
                fn(i)
            daemon_us = (cpu_seconds(daemon.proc.pid) - daemon0) / CPU_CALLS * 1e6
            client_us = (time.process_time() - client0) / CPU_CALLS * 1e6
            rows.append(Row("cpu per call, 1 client", f"{name}: daemon CPU", daemon_us, "us"))
            rows.append(Row("cpu per call, 1 client", f"{name}: client CPU", client_us, "us"))
    session.close()
    client.close()
    return rows


def run() -> list[Row]:
    rows: list[Row] = []
    with BenchDaemon("--memory-budget", "2GiB") as daemon:
        client = Client(daemon.address)
        setup = client.open_session(POOL, block_bytes=BLOCK, num_blocks=262144)
        hot = _keys("hot", 32)
        setup.complete_store(setup.prepare_store(hot).keys_to_store)
        rows += _batched_vs_single(daemon)
        rows += _cpu_per_call(daemon)
        for processes in (1, 8):
            results = _run_clients(daemon.address, processes)
            empty_p50 = percentile(results["empty RPC (health Check)"][0], 0.5)
            for name, (samples, elapsed) in results.items():
                rpcs = 2 if "+" in name else 1
                p50 = percentile(samples, 0.5)
                p99 = percentile(samples, 0.99)
                group = f"rpc, {processes} client{'s' if processes > 1 else ''}"
                is_empty = name.startswith("empty")
                ratio = None if is_empty else p50 / (rpcs * empty_p50)
                target = "" if is_empty else "<= 1.3x"
                floor = "" if is_empty else f"{rpcs} x empty p50 {rpcs * empty_p50 * 1e6:.0f} us"
                rows.append(Row(group, f"{name} p50", p50 * 1e6, "us", floor, ratio, target))
                rows.append(Row(group, f"{name} p99", p99 * 1e6, "us"))
                rows.append(Row(group, f"{name} calls/s", len(samples) / elapsed, "calls/s"))
        cpu_key = _daemon_cpu_per_key(daemon, setup, 1024)
        rows.append(Row("daemon cpu", "Lookup, added CPU per key at 1,024 keys", cpu_key * 1e6,
                        "us/key", target="< 1 us"))  # fmt: skip
        cpu_store = _daemon_cpu_per_key_store(daemon, setup, 1024)
        rows.append(Row("daemon cpu", "PrepareStore+CompleteStore, CPU per key at 1,024",
                        cpu_store * 1e6, "us/key", target="< 1 us"))  # fmt: skip
        setup.close()
        client.close()
    return rows


if __name__ == "__main__":
    from benchmarks.common import print_table

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print_table(run())
