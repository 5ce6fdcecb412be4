"""The daemon's own stalls never cost a client its lease, and a client that lost
its lease never makes another session load wrong bytes (issue #15, items 1-2).

Real daemon processes; real client processes stopped with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from daemon_harness import DaemonProcess, eventually, start_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtierd.primary.region import region_file_name
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import FailedPrecondition
from kvtierd_client.region import AttachedRegion

BLOCK = 64 << 10
BIG_POOL_BLOCKS = (3 << 30) // BLOCK  # a 3 GiB region: seconds to allocate and fault in


def primary(client: Client, pool: str):
    return client.get_stats(pool).pools[0].tiers[0]


@pytest.fixture
def short_lease_daemon() -> Iterator[DaemonProcess]:
    proc = start_daemon(
        "--memory-budget", "4GiB", "--lease", "1s", "--write-quarantine", "2s",
    )  # fmt: skip
    try:
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        proc.cleanup()


def test_creating_a_big_pool_stalls_nobody(short_lease_daemon):
    """While a 3 GiB pool is created, health and another pool's Lookup answer
    within 100 ms (p99), and a 1 s lease held by another client survives."""
    daemon = short_lease_daemon
    with Client(daemon.address) as holder, Client(daemon.address) as creator:
        small = holder.open_session("small", block_bytes=4096, num_blocks=4)  # keepalive on
        small.prepare_store([b"pinned"])
        small.complete_store([b"pinned"])
        assert small.prepare_load([b"pinned"]) == [0]

        created = threading.Event()
        failure: list[BaseException] = []

        def create() -> None:
            try:
                creator.open_session("big", block_bytes=BLOCK, num_blocks=BIG_POOL_BLOCKS)
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)
            finally:
                created.set()

        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.target))
        check = health_pb2.HealthCheckRequest()
        creating = threading.Thread(target=create)
        started = time.monotonic()
        creating.start()
        health_ms: list[float] = []
        lookup_ms: list[float] = []
        while not created.is_set():
            t0 = time.perf_counter()
            health.Check(check, timeout=5)
            t1 = time.perf_counter()
            assert small.lookup([b"pinned"]) == [LookupResult.HIT]
            t2 = time.perf_counter()
            health_ms.append((t1 - t0) * 1000)
            lookup_ms.append((t2 - t1) * 1000)
            created.wait(0.005)  # a sample every 5 ms until the pool exists
        creating.join()
        took = time.monotonic() - started
        assert not failure, failure
        assert took > 0.5, f"the pool was created in {took:.2f}s: too fast to prove anything"
        assert len(health_ms) >= 10

        def p99(samples: list[float]) -> float:
            return statistics.quantiles(samples, n=100)[98]

        assert p99(health_ms) < 100, f"health p99 {p99(health_ms):.1f} ms over {took:.1f}s"
        assert p99(lookup_ms) < 100, f"lookup p99 {p99(lookup_ms):.1f} ms over {took:.1f}s"
        # the holder's session and its pin lived through it
        assert not small.closed
        assert primary(holder, "small").pinned_blocks == 1
        small.complete_load([b"pinned"])
    assert "lease expired" not in daemon.log()


def test_a_loop_stall_is_credited_to_every_lease():
    """A daemon stopped (SIGSTOP) for three leases does not expire a session that
    kept itself alive: its calls waited in the socket, not in the client."""
    daemon = start_daemon("--lease", "1s")
    try:
        with Client(daemon.address) as client:
            session = client.open_session("stalled", block_bytes=4096, num_blocks=2)
            session.prepare_store([b"k"])
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            time.sleep(3.0)  # the stall being tested: three leases of no event loop
            os.kill(daemon.proc.pid, signal.SIGCONT)
            session.complete_store([b"k"])  # the reservation was not aborted
            assert session.lookup([b"k"]) == [LookupResult.HIT]
        assert "stalled for" in daemon.log()
        assert "lease expired" not in daemon.log()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_stall_shorter_than_the_credit_threshold_never_outlasts_a_short_lease():
    """With a 0.2 s lease (allowed: 0.1 s and up) a daemon stall of 0.22 s is under
    the 0.25 s a stall needs to be credited at longer leases, yet longer than the
    whole lease: sessions that keep themselves alive must survive it."""
    daemon = start_daemon("--lease", "0.2s")
    try:
        with Client(daemon.address) as client:
            sessions = [
                client.open_session("short", block_bytes=4096, num_blocks=4) for _ in range(3)
            ]
            for _ in range(3):
                os.kill(daemon.proc.pid, signal.SIGSTOP)
                time.sleep(0.22)  # the stall being tested
                os.kill(daemon.proc.pid, signal.SIGCONT)
                time.sleep(0.3)  # on purpose: running time between stalls (keepalives answered)
            for session in sessions:
                assert session.lookup([b"k"]) == [LookupResult.MISS]
        assert "lease expired" not in daemon.log()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    from kvtierd_client.client import Client
    from kvtierd_client.copy_engine import CopyEngine, LeaseLostError
    from kvtierd_client.region import AttachedRegion
    address, pool, mode = sys.argv[1:]
    session = Client(address).open_session(pool, block_bytes=4096, num_blocks=1)
    grant = session.prepare_store([b"stale-writer"])
    row = grant.block_ids[0]
    region = AttachedRegion.attach(session.region.path, 1, 4096)
    print("reserved", row, flush=True)
    sys.stdin.readline()  # stopped and resumed before this returns
    if mode == "raw":  # no fence at all: plain bytes into the row
        region.numpy()[row] = 0xAA
        print("wrote", flush=True)
    else:
        kv = torch.full((1, 4096), 0xAA, dtype=torch.uint8)
        engine = CopyEngine(region, [kv])
        try:
            engine.submit_store([(0, row)], lease_deadline=session.lease_deadline)
            print("wrote", flush=True)
        except LeaseLostError as err:
            print("refused", err, flush=True)
""")


def start_writer(daemon: DaemonProcess, pool: str, mode: str) -> subprocess.Popen[str]:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, daemon.address, pool, mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert writer.stdout.readline().split() == ["reserved", "0"]
    return writer


def store_pattern(client: Client, pool: str, key: bytes, byte: int) -> None:
    """Stores ``key`` with every byte ``byte`` into the pool's only row (waits for room)."""
    session = client.open_session(pool, block_bytes=4096, num_blocks=1)
    grant = session.prepare_store([key])
    assert grant is not None and grant.block_ids == [0]
    with AttachedRegion.attach(session.region.path, 1, 4096) as region:
        region.numpy()[0] = byte
    session.complete_store([key])


def load(client: Client, pool: str, key: bytes) -> np.ndarray:
    session = client.open_session(pool, block_bytes=4096, num_blocks=1)
    [row] = session.prepare_load([key])
    with AttachedRegion.attach(session.region.path, 1, 4096) as region:
        data = region.numpy()[row].copy()
    session.complete_load([key])
    return data


@pytest.mark.parametrize("mode", ["raw", "copy_engine"])
def test_a_writer_stopped_past_its_lease_never_overwrites_another_sessions_block(
    short_lease_daemon, mode
):
    """The stale writer reserved the pool's only row, was stopped past its lease,
    and writes when resumed. ``raw``: it resumes inside the quarantine and writes
    with no fence at all; ``copy_engine``: it resumes after another session has
    stored into the row and writes through the fenced CopyEngine. Either way the
    other session's block loads bit-exact."""
    daemon = short_lease_daemon
    pool = f"fence-{mode}"
    with Client(daemon.address) as client:
        writer = start_writer(daemon, pool, mode)
        try:
            os.kill(writer.pid, signal.SIGSTOP)
            eventually(lambda: primary(client, pool).quarantined_blocks == 1, 30, "lease expired")
            other = client.open_session(pool, block_bytes=4096, num_blocks=1)
            # the row is quarantined: nobody gets it while the stale writer may write
            assert other.prepare_store([b"M"]) is None
            if mode == "raw":
                os.kill(writer.pid, signal.SIGCONT)
                writer.stdin.write("go\n")
                writer.stdin.flush()
                assert writer.stdout.readline().strip() == "wrote"
            eventually(
                lambda: primary(client, pool).quarantined_blocks == 0, 30, "quarantine ended"
            )
            store_pattern(client, pool, b"M", 0x55)
            if mode == "copy_engine":
                os.kill(writer.pid, signal.SIGCONT)
                writer.stdin.write("go\n")
                writer.stdin.flush()
                assert writer.stdout.readline().startswith("refused")
            assert writer.wait(30) == 0
            assert np.all(load(client, pool, b"M") == 0x55), "M holds the stale writer's bytes"
        finally:
            writer.kill()
            writer.wait()


def test_the_lease_deadline_follows_the_answered_keepalives():
    """It stays ahead while keepalives are answered, falls behind while the daemon
    does not answer (the client cannot prove its lease), and recovers after."""
    daemon = start_daemon("--lease", "1s")
    try:
        with Client(daemon.address) as client:
            session = client.open_session("deadline", block_bytes=4096, num_blocks=2)
            time.sleep(1.5)  # on purpose: more than a lease, kept ahead by keepalives every 1/3 s
            assert session.lease_deadline > time.monotonic() + 0.2
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                eventually(lambda: session.lease_deadline < time.monotonic(), 30, "deadline passed")
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            eventually(lambda: session.lease_deadline > time.monotonic(), 30, "deadline renewed")
            session.close()
            assert session.lease_deadline == 0.0
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("plant", ["fifo", "symlink", "directory", "socket"])
def test_a_file_planted_at_a_region_path_is_refused_without_hanging(tmp_path, plant):
    """Anyone who can write shm_dir can plant something at a pool's future region
    path: OpenSession is refused at once naming it, the daemon keeps serving, the
    planted file is left alone, and SIGTERM completes."""
    daemon = start_daemon()
    try:
        path = os.path.join(daemon.shm_dir, region_file_name("planted"))
        target = tmp_path / "elsewhere"
        target.write_bytes(b"not a region")
        bound = socket.socket(socket.AF_UNIX)
        {
            "fifo": lambda: os.mkfifo(path, 0o666),
            "symlink": lambda: os.symlink(target, path),
            "directory": lambda: os.mkdir(path),
            "socket": lambda: bound.bind(path),  # open() fails with ENXIO, not ELOOP
        }[plant]()
        with Client(daemon.address, timeout=5) as client:
            with pytest.raises(FailedPrecondition, match=r"not a region file.*Remove it"):
                client.open_session("planted", block_bytes=4096, num_blocks=1)
            other = client.open_session("fine", block_bytes=4096, num_blocks=1)
            assert other.lookup([b"k"]) == [LookupResult.MISS]
        assert os.path.lexists(path)
        assert target.read_bytes() == b"not a region"
        assert daemon.stop(timeout=10) == 0
    finally:
        bound.close()
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        daemon.cleanup()
