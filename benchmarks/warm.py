"""Warm restart (issue #20): how long a restarted daemon takes to serve its first
HIT from an adopted region, and what the journal costs on the store path.

restart-to-first-HIT: a pool of 1 or 4 GiB (``KVTIERD_BENCH_WARM_GIB`` adds
sizes, e.g. ``1,4,16``) is filled with ready blocks, the daemon gets SIGTERM,
and a new daemon is started on the same shm_dir; the time runs from its spawn
to the first Lookup answering HIT (start-up + OpenSession, which adopts: reads
the journal, hashes every ready row). The floor of the same run is the cold
path with ``memory.warm_restart = false``: spawn to an empty pool of the same
size opened (region allocated and prefaulted), nothing to serve.

store path: PrepareStore + CompleteStore of 16 keys per call in one client
process into a 256-row pool kept full, so that every call evicts (each row is
handed out again every 16 calls, a few ms: most completions are handed out
again before the journal could record them, which the "journaled" row counts),
warm restart on vs off, runs interleaved (off, on, off, on, ...:
``KVTIERD_BENCH_WARM_ROUNDS`` pairs, default 2; the best run of each side) in
the same run; 16 KiB and 2 MiB blocks (every completed block is hashed by the
pool's hash worker process), with the default checksum coverage (64 KiB) and
whole rows. The client writes no bytes: the daemon-side cost is all there is
(the judged rows). A ``:copy`` case adds what a real store does, the client
writing each granted row through its mapping (context). CPU per call is the
client's plus the daemon's and its hash worker's (/proc), over the measured
calls. ``KVTIERD_BENCH_WARM_STORE`` picks the cases (``block:checksum_bytes[:copy],...``,
default ``16KiB:64KiB,2MiB:64KiB,2MiB:0,2MiB:64KiB:copy``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import BenchDaemon, Row
from kvtierd.util.units import parse_size
from kvtierd_client.client import Client, LookupResult

POOL = "bench/warm"
RESTART_BLOCK = 1 << 20  # 1 MiB rows
KEYS_PER_CALL = 16
STORE_SECONDS = 4.0


def _key(i: int) -> bytes:
    return f"warm-{i:012d}".encode().ljust(40, b"k")


def _fill(address: str, num_blocks: int) -> None:
    with Client(address, timeout=300) as client:
        session = client.open_session(POOL, block_bytes=RESTART_BLOCK, num_blocks=num_blocks)
        for start in range(0, num_blocks, 256):
            keys = [_key(i) for i in range(start, min(num_blocks, start + 256))]
            grant = session.prepare_store(keys)
            assert grant is not None and len(grant.keys_to_store) == len(keys)
            session.complete_store(keys)
        session.close()


def _first_hit(shm_dir: str, num_blocks: int, *args: str) -> tuple[float, float, BenchDaemon]:
    """(spawn to first HIT or to the pool opened, the OpenSession's part, daemon)."""
    budget = f"{num_blocks * RESTART_BLOCK + (64 << 20)}"
    t0 = time.perf_counter()
    daemon = BenchDaemon("--memory-budget", budget, *args, shm_dir=shm_dir)
    with Client(daemon.address, timeout=300) as client:  # a 16 GiB region: tens of seconds
        t1 = time.perf_counter()
        session = client.open_session(POOL, block_bytes=RESTART_BLOCK, num_blocks=num_blocks)
        t2 = time.perf_counter()
        if "false" not in args:
            result = session.lookup([_key(0)])[0]
            assert result is LookupResult.HIT, result
        elapsed = time.perf_counter() - t0
        session.close()
    return elapsed, t2 - t1, daemon


def _restart_rows(gib: int) -> list[Row]:
    num_blocks = (gib << 30) // RESTART_BLOCK
    budget = f"{num_blocks * RESTART_BLOCK + (64 << 20)}"
    shm_dir = tempfile.mkdtemp(prefix="kvtierd-bench-warm-", dir="/dev/shm")
    try:
        cold, cold_open, daemon = _first_hit(shm_dir, num_blocks, "--warm-restart", "false")
        daemon.close()
        first = BenchDaemon("--memory-budget", budget, shm_dir=shm_dir)
        _fill(first.address, num_blocks)
        t0 = time.perf_counter()
        first.close()  # SIGTERM: the journal's queue drains, the files stay
        stop = time.perf_counter() - t0
        warm, warm_open, daemon = _first_hit(shm_dir, num_blocks)
        daemon.close()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    group = "warm restart"
    return [
        Row(group, f"{gib} GiB pool: restart to first HIT (spawn -> HIT)", warm, "s",
            f"cold start to an empty pool {cold:.2f} s", warm / cold, "adopts every block"),
        Row(group, f"{gib} GiB pool: OpenSession adopting {num_blocks} ready blocks", warm_open,
            "s", f"creating the region cold {cold_open:.2f} s", warm_open / cold_open),
        Row(group, f"{gib} GiB pool: SIGTERM to exit (journal drained)", stop, "s"),
    ]  # fmt: skip


_STORE_CLIENT = """
import mmap, os, sys, time
from kvtierd_client.client import Client
address, block, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
copy, daemon_pid = sys.argv[4] == "copy", int(sys.argv[5])

def tree_cpu(pid):  # seconds of CPU of the daemon and its children (the hash worker)
    pids, ticks = [pid], 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(child) for child in f.read().split()]
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except FileNotFoundError:
            pass
    return ticks / os.sysconf("SC_CLK_TCK")

with Client(address) as client:
    session = client.open_session("bench/warm-store", block_bytes=block, num_blocks=256)
    rows = None
    if copy:  # what a real store adds: the engine writes each granted row
        with open(session.region.path, "r+b") as f:
            rows = mmap.mmap(f.fileno(), 256 * block)
        source = os.urandom(block)
    n = 0
    def call():
        global n
        keys = [f"s-{n}-{j}".encode().ljust(40, b"k") for j in range(16)]
        n += 1
        grant = session.prepare_store(keys)
        if grant and rows is not None:
            for row in grant.block_ids:
                rows[row * block : (row + 1) * block] = source
        session.complete_store(grant.keys_to_store if grant else keys)
    for _ in range(64):  # fill the pool: every measured call evicts
        call()
    calls, t0, c0, d0 = 0, time.perf_counter(), time.process_time(), tree_cpu(daemon_pid)
    while time.perf_counter() - t0 < seconds:
        call()
        calls += 1
    elapsed = time.perf_counter() - t0
    print(calls / elapsed, (time.process_time() - c0) / calls, (tree_cpu(daemon_pid) - d0) / calls)
"""


_JOURNAL_CLOSED = re.compile(r"(\d+) completed blocks journaled, (\d+) handed out again")


def _store_rate(
    block: int, warm: bool, checksum_bytes: int, copy: bool
) -> tuple[float, float, float | None]:
    """(calls/s, CPU seconds per call of the client + the daemon and its hash
    worker, the fraction of the completed blocks that the journal recorded ready:
    the others were handed out again before they were hashed; None with warm
    restart off)."""
    budget = f"{256 * block + (64 << 20)}"
    with BenchDaemon(
        "--memory-budget", budget, "--warm-restart", str(warm).lower(),
        "--warm-restart-checksum-bytes", str(checksum_bytes), "--log-level", "info",
    ) as daemon:  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", _STORE_CLIENT, daemon.address, str(block), str(STORE_SECONDS),
             "copy" if copy else "rpc", str(daemon.proc.pid)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        daemon.proc.send_signal(signal.SIGTERM)  # the journal's closing line: its counts
        daemon.proc.wait(60)
        with open(daemon.log.name, errors="replace") as log:
            closed = _JOURNAL_CLOSED.search(log.read())
    journaled = None
    if closed is not None:
        done, missed = int(closed.group(1)), int(closed.group(2))
        journaled = done / max(1, done + missed)
    rate, client_cpu, daemon_cpu = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return rate, client_cpu + daemon_cpu, journaled


def _store_rows() -> list[Row]:
    rows = []
    # block:checksum_bytes[:copy]: the default coverage (64 KiB: whole 16 KiB rows,
    # 16 pages of a 2 MiB row), whole 2 MiB rows, and (context, not the target's
    # definition) the same calls with the client writing every granted row
    cases = os.environ.get(
        "KVTIERD_BENCH_WARM_STORE", "16KiB:64KiB,2MiB:64KiB,2MiB:0,2MiB:64KiB:copy"
    )
    rounds = int(os.environ.get("KVTIERD_BENCH_WARM_ROUNDS", "2"))  # off, on alternated
    for case in cases.split(","):
        parts = case.split(":")
        block, checksum_bytes = parse_size(parts[0]), parse_size(parts[1])
        copy = parts[2:] == ["copy"]
        rates: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        journaled: list[float] = []
        for warm in (False, True) * rounds:
            rate, cpu_per_call, fraction = _store_rate(block, warm, checksum_bytes, copy)
            rates[warm].append(rate)
            cpu[warm].append(cpu_per_call)
            if warm and fraction is not None:
                journaled.append(fraction)
        off, on = max(rates[False]), max(rates[True])
        cpu_off, cpu_on = statistics.median(cpu[False]), statistics.median(cpu[True])
        label = f"{block >> 10} KiB" if block < (1 << 20) else f"{block >> 20} MiB"
        covered = (
            "whole rows"
            if checksum_bytes in (0, block) or block <= checksum_bytes
            else (f"{checksum_bytes >> 10} KiB of each row")
        )
        what = f"{KEYS_PER_CALL} x {label}{', client writes the rows' if copy else ''}"
        rows.extend([
            Row("warm restart", f"PrepareStore+CompleteStore({what}) calls/s, warm_restart on "
                f"(checksum: {covered})", on, "calls/s", f"off {off:,.0f} calls/s", on / off,
                "" if copy else ">= 0.95x"),
            Row("warm restart", f"... CPU per call, client + daemon + hash worker, on (median of "
                f"{rounds})", 1e6 * cpu_on, "us", f"off {1e6 * cpu_off:,.0f} us",
                cpu_on / cpu_off),
        ])  # fmt: skip
        if journaled:  # the others were handed out again before they were hashed
            rows.append(
                Row("warm restart", "... completed blocks journaled, min of the on runs",
                    100 * min(journaled), "%")
            )  # fmt: skip
    return rows


def run() -> list[Row]:
    sizes = [int(s) for s in os.environ.get("KVTIERD_BENCH_WARM_GIB", "1,4").split(",") if s]
    rows = []
    for gib in sizes:
        rows.extend(_restart_rows(gib))
    rows.extend(_store_rows())
    return rows
