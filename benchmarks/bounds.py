"""Daemon memory under a churn of new keys, against what the configuration bounds
(issue #33 item 3; docs/design/memory.md).

A daemon with the default limits (64 MiB of events, 16 MiB of removals a pool)
and the default warm-restart journal; one 65,536-row pool refilled 20 times with
brand-new 256-byte keys, PrepareStore + CompleteStore of 4,096 keys at a time and
of 65,536 (the largest call). Per call size: RssAnon before the churn (the base),
after each cycle, and after the 20th once the heap trimmer had two seconds; the
bound base + 1.25 x (the pool's heap by its limits,
``kvtierd.primary.footprint.pool_heap_bytes``, + one call's keys); and the
figure as a multiple of the pool's heap: (settled - base) / (pool + call).

``--before DIR``: the same churn against the daemon of another checkout
(``PYTHONPATH=DIR:DIR/client``; copy ``client/kvtierd_client/_proto`` there),
alternating with this one's, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import os
import time

import grpc

from benchmarks.common import BenchDaemon, Row, print_table, rss_anon_bytes
from kvtierd.primary.footprint import pool_heap_bytes
from kvtierd.util.heap import allocated_bytes
from kvtierd_client.wire.proto import pb2, pb2_grpc

MIB = 1 << 20
ROWS = 65536
KEY_BYTES = 256
CYCLES = 20
CALL_SIZES = (4096, 65536)
SETTLE_SECONDS = 2.0  # the trimmer looks once a second
SLACK = 1.25


def _keys(start: int, count: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * (KEY_BYTES // 8) for i in range(start, start + count)]


def churn(keys_per_call: int, env: dict[str, str] | None) -> tuple[float, list[float], float]:
    """(base, after each cycle, settled) RssAnon in MiB."""
    with BenchDaemon("--memory-budget", "512MiB", env=env) as daemon:
        options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel("unix:" + daemon.socket, options=options) as channel:
            stub = pb2_grpc.KVTierStub(channel)
            spec = pb2.PoolSpec(name="bench/bounds", block_bytes=4096, num_blocks=ROWS)
            session = stub.OpenSession(pb2.OpenSessionRequest(pool=spec)).session_id
            base = rss_anon_bytes(daemon.proc.pid) / MIB
            figures = []
            for cycle in range(CYCLES):
                for start in range(cycle * ROWS, (cycle + 1) * ROWS, keys_per_call):
                    keys = _keys(start, keys_per_call)
                    grant = stub.PrepareStore(
                        pb2.PrepareStoreRequest(session_id=session, keys=keys)
                    )
                    stub.CompleteStore(pb2.CompleteStoreRequest(
                        session_id=session, keys=grant.keys_to_store, success=True
                    ))  # fmt: skip
                figures.append(rss_anon_bytes(daemon.proc.pid) / MIB)
            time.sleep(SETTLE_SECONDS)
            settled = rss_anon_bytes(daemon.proc.pid) / MIB
    return base, figures, settled


def rows_of(
    name: str, keys_per_call: int, base: float, figures: list[float], settled: float
) -> list[Row]:
    pool = (
        pool_heap_bytes(
            ROWS, "lru", events_bytes=64 * MIB, removals_bytes=16 * MIB, warm_restart=True
        )
        / MIB
    )
    call = keys_per_call * allocated_bytes(33 + KEY_BYTES) / MIB
    bound = base + SLACK * (pool + call)
    label = f"{name}, calls of {keys_per_call:,} keys"
    return [
        Row("bounds", f"{label}: RssAnon before the churn (base)", base, "MiB"),
        Row("bounds", f"{label}: RssAnon, most after any cycle", max(figures), "MiB"),
        Row("bounds", f"{label}: RssAnon after 20 cycles, settled", settled, "MiB",
            floor=f"bound {bound:.1f} MiB", ratio=settled / bound, target="<= 1.00x"),
        Row("bounds", f"{label}: (settled - base) / (pool {pool:.1f} + call {call:.1f} MiB)",
            (settled - base) / (pool + call), "x", target=f"<= {SLACK}"),
    ]  # fmt: skip


def run(before: str | None = None, rounds: int = 1) -> list[Row]:
    builds: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
    if before:
        env = dict(os.environ, PYTHONPATH=f"{before}:{before}/client")
        builds.insert(0, ("before", env))
    rows: list[Row] = []
    for round_number in range(rounds):
        for keys_per_call in CALL_SIZES:
            for name, env in builds:
                base, figures, settled = churn(keys_per_call, env)
                label = name if rounds == 1 else f"{name} (round {round_number + 1})"
                rows += rows_of(label, keys_per_call, base, figures, settled)
                print(label, keys_per_call, [round(f, 1) for f in figures], flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", help="another checkout, run alternately with this one")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print_table(run(args.before, args.rounds))
