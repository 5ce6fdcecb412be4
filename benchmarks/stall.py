"""Does the daemon answer while it creates a big pool? Health Check latency on an
idle daemon, then the same Check (and a Lookup of another pool) while a 4 GiB
pool is created (region allocation and pre-faulting run off the event loop)."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import BenchDaemon, Row, percentile
from kvtierd_client.client import Client

BIG_POOL_BYTES = 4 << 30
BLOCK = 2 << 20
IDLE_SAMPLES = 500


def _timed_ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def run() -> list[Row]:
    with BenchDaemon("--memory-budget", "5GiB", "--lease", "2s") as daemon:
        client = Client(daemon.address, timeout=120)
        small = client.open_session("bench/small", block_bytes=4096, num_blocks=16)
        small.prepare_store([b"k"])
        small.complete_store([b"k"])
        channel = grpc.insecure_channel(daemon.address.replace("unix://", "unix:"))
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()

        def check() -> None:
            health.Check(request, timeout=30)

        idle = [_timed_ms(check) for _ in range(IDLE_SAMPLES)]
        created = threading.Event()
        took: list[float] = []

        def create() -> None:
            start = time.perf_counter()
            client.open_session("bench/big", block_bytes=BLOCK, num_blocks=BIG_POOL_BYTES // BLOCK)
            took.append(time.perf_counter() - start)
            created.set()

        creator = threading.Thread(target=create)
        creator.start()
        busy: list[float] = []
        lookups: list[float] = []
        while not created.is_set():
            busy.append(_timed_ms(check))
            lookups.append(_timed_ms(lambda: small.lookup([b"k"])))
            time.sleep(0.002)
        creator.join()
        channel.close()
        client.close()
    p50_idle, p99_idle = percentile(idle, 0.5), percentile(idle, 0.99)
    p50_busy, p99_busy = percentile(busy, 0.5), percentile(busy, 0.99)
    during = f"during a 4 GiB pool's creation ({took[0]:.1f} s, {len(busy)} checks)"
    return [
        Row("stall", "health Check p50, idle daemon", p50_idle, "ms"),
        Row("stall", "health Check p99, idle daemon", p99_idle, "ms"),
        Row("stall", f"health Check p50 {during}", p50_busy, "ms", "idle p50",
            p50_busy / p50_idle),
        Row("stall", f"health Check p99 {during}", p99_busy, "ms", "idle p99",
            p99_busy / p99_idle, target="< 100 ms"),
        Row("stall", "Lookup of another pool p99, same time", percentile(lookups, 0.99), "ms",
            target="< 100 ms"),
    ]  # fmt: skip
