"""Cross-daemon HIT latency on a shared fs root (``shared = true``), a row of the fs suite.

Two real daemons ("nodes": own sockets, shm dirs, pools) with one ``[[tiers]]
type = "fs"`` tier each, ``shared = true``, on one root under
``$KVTIERD_BENCH_FS_ROOT`` (default ``/var/tmp``). Per trial node A stores
``keys`` fresh 2 MiB blocks and its cascade is waited for (the files are on
disk); then node B looks the keys up, one Lookup every :data:`STEP_S` (an
engine's scheduler step is this order or longer), and the trial records

* *found*: from B's first Lookup (its index does not hold the keys: they are
  queued for the off-loop check, which that Lookup waits for, at most
  ``limits.remote_lookup_wait``) until the first Lookup that no longer answers
  MISS for any key (HIT_PENDING: the promotion started) -- the first one itself
  when the check came back within the wait;
* *served*: until every key answers HIT (promoted, verified).

The floor, same run: one Lookup round trip of keys B already holds (HIT).
``python -m benchmarks.fs_shared`` runs it alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from benchmarks.common import BenchDaemon, Row
from kvtierd_client.client import Client, LookupResult

POOL = "bench/fs-shared"
BLOCK = 2 << 20
ROWS = 64
TRIALS = 15
STEP_S = 0.002  # between two of B's Lookups
NEGATIVE_TTL = "1s"
MISS, HIT = LookupResult.MISS, LookupResult.HIT


def _config(directory: str, root: str) -> str:
    path = os.path.join(directory, "shared.toml")
    with open(path, "w") as f:
        f.write(f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{root}"\ncapacity = "4GiB"\n'
                f'shared = true\nshared_negative_ttl = "{NEGATIVE_TTL}"\n'
                'shared_rescan_interval = "60s"\no_direct = "off"\n')  # fmt: skip
    return path


def _block_files(root: str) -> int:
    return sum(name.endswith(".kvb") for _, _, names in os.walk(root) for name in names)


def _until(predicate, what: str, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fs_shared bench: timed out waiting for {what}")
        time.sleep(STEP_S)


def _trial(writer, reader, root: str, keys: list[bytes]) -> tuple[float, float, int]:  # noqa: ANN001
    """(seconds to found, seconds to served, Lookups until found) of one trial."""
    before = _block_files(root)
    grant = writer.prepare_store(keys)
    writer.complete_store(grant.keys_to_store)
    _until(lambda: _block_files(root) >= before + len(keys), "A's cascade")
    start = time.perf_counter()
    lookups, found = 0, 0.0
    while True:
        answers = reader.lookup(keys)
        lookups += 1 if not found else 0
        now = time.perf_counter() - start
        if not found and MISS not in answers:
            found = now
        if answers == [HIT] * len(keys):
            return found, now, lookups
        if now > 60:
            raise RuntimeError(f"fs_shared bench: B never served the keys: {answers}")
        time.sleep(STEP_S)


def run() -> list[Row]:
    parent = os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp")
    base = tempfile.mkdtemp(prefix="kvtierd-bench-fs-shared-", dir=parent)
    root = os.path.join(base, "root")
    os.makedirs(root)
    config = _config(base, root)
    rows: list[Row] = []
    nodes = [BenchDaemon("--config", config), BenchDaemon("--config", config)]
    clients = [Client(node.address) for node in nodes]
    try:
        writer, reader = (
            c.open_session(POOL, block_bytes=BLOCK, num_blocks=ROWS, layout="bench")
            for c in clients
        )
        group = f"fs tier, shared root (2 daemons, 2 MiB blocks, Lookup every {STEP_S * 1e3:g} ms)"
        # floor: a Lookup round trip of keys B holds
        held = [b"held-%d" % i for i in range(8)]
        grant = reader.prepare_store(held)
        reader.complete_store(grant.keys_to_store)
        rtts = []
        for _ in range(50):
            start = time.perf_counter()
            reader.lookup(held)
            rtts.append(time.perf_counter() - start)
        floor = statistics.median(rtts)
        for n in (1, 8):
            results = [_trial(writer, reader, root, [b"t%d-%d-%d" % (n, t, i) for i in range(n)])
                       for t in range(TRIALS)]  # fmt: skip
            found = statistics.median(r[0] for r in results)
            served = statistics.median(r[1] for r in results)
            lookups = statistics.median(r[2] for r in results)
            floor_text = f"Lookup RTT of held keys {floor * 1e3:.2f} ms"
            rows.append(Row(group, f"{n} key(s) A stored: B's first Lookup -> not MISS "
                            f"(median of {TRIALS}, {lookups:g} Lookups)", found * 1e3, "ms",
                            floor_text, found / floor))  # fmt: skip
            rows.append(Row(group, f"{n} key(s) A stored: B's first Lookup -> HIT (promoted)",
                            served * 1e3, "ms", floor_text, served / floor))  # fmt: skip
    finally:
        for client in clients:
            client.close()
        for node in nodes:
            node.close()
        shutil.rmtree(base, ignore_errors=True)
    return rows


if __name__ == "__main__":
    from benchmarks.common import machine, print_table

    print(f"machine: {machine()}\n")
    print_table(run())
