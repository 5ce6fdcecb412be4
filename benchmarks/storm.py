"""Promotion storm through a real daemon (issue #15, item 5), with and without the fs tier.

Usage::

    python -m benchmarks.storm [--requests 200] [--engines 16] [--concurrency 2]
                               [--budget 2] [--rows 64] [--step-ms 20]
                               [--recompute-ms 2] [--bound 120]

The issue's scenario at the daemon's level: one pool of ``--rows`` rows of 64 KiB,
20 shared documents of 11 blocks, ``--requests`` requests for random documents
(fixed seed) taken by ``--engines`` engines sharing the pool (one thread and one
session each). Each engine is a :class:`Scheduler` (vLLM's scheduler with the
kvtierd plug-in, reduced to its calls) with up to ``--concurrency`` requests in
flight; every step (``--step-ms``) it looks its waiting requests up in order
(``lookup_and_pin``, prefix):

* a key HIT_PENDING: the request waits; its pins are released at the step's end;
* otherwise the request runs (at most ``--budget`` per step; the requests after
  a full step are not looked up): the pinned leading HITs are loaded, the rest
  is recomputed (``--recompute-ms`` per block, a sleep: the engine's compute,
  not the client's CPU) and stored (PrepareStore + CompleteStore).

Every document is stored first, cascaded and flushed from the primary, so each
run starts with the primary empty. Three daemons, one after the other:

* ``primary only``: no ``[[tiers]]``; what is evicted is gone, so it is recomputed;
* ``fs, no holds``: an fs tier with ``limits.promotion_hold = "0s"`` (the daemon
  before promotion holds: promotions evict blocks promoted for others);
* ``fs, holds``: an fs tier with the default ``promotion_hold`` (2 s).

The fs root is a directory under ``$KVTIERD_BENCH_FS_ROOT`` (default /var/tmp);
the files were just written, so promotions mostly read the page cache. A run that
has not served every request after ``--bound`` seconds stops (the table says how
many were served). Benchmarks are not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks.common import BenchDaemon, machine
from kvtierd_client.client import Client, LookupResult, Session

POOL = "bench/storm"
BLOCK = 64 << 10
DOCS = 20
DOC_BLOCKS = 11
SEED = 0
PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY


def document(index: int) -> list[bytes]:
    return [f"doc{index:02d}-{i:02d}".encode() for i in range(DOC_BLOCKS)]


@dataclass
class Tally:
    """The scheduler's counts."""

    requests: int = 0
    steps: int = 0
    lookups: int = 0
    loaded: int = 0  # blocks loaded from the primary (promoted or not)
    recomputed: int = 0
    stores_refused: int = 0  # PrepareStore without room: recomputed blocks not kept


@dataclass(frozen=True)
class Result:
    name: str
    seconds: float
    served: int
    steps: int
    lookups: int
    loaded: int
    recomputed: int
    promoted: int
    no_room: int
    evictions: int
    stores_refused: int


def config_text(root: str | None, hold: str | None) -> str:
    if root is None:
        return "# no [[tiers]]: the primary tier alone\n"
    text = f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{root}"\n'
    if hold is not None:
        text += f'[limits]\npromotion_hold = "{hold}"\n'
    return text


def wait_cascades(client: Client, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while any(t.jobs_in_flight for t in client.get_stats(POOL).pools[0].tiers[1:]):
        if time.monotonic() > deadline:
            raise RuntimeError("cascades still in flight")
        time.sleep(0.005)


def populate(client: Client, session: Session) -> None:
    """Stores every document (each cascade done before the next needs rows), then
    flushes the primary."""
    for index in range(DOCS):
        keys = document(index)
        if session.prepare_store(keys) is None:
            raise RuntimeError("no room to store a document")
        session.complete_store(keys)
        wait_cascades(client)
    client.flush_pool(POOL)


class Work:
    """The requests not started yet (document numbers), shared by the engines."""

    def __init__(self, docs: list[int]) -> None:
        self._docs = deque(docs)
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._docs.popleft() if self._docs else None


class Scheduler:
    """vLLM's scheduler with the kvtierd plug-in, reduced to the calls it makes.

    Every step looks up each waiting request in order (``lookup_and_pin``,
    prefix). A request with a key HIT_PENDING keeps waiting (its pins are
    released at the end of the step); the others run, at most ``budget`` per
    step (the requests after a full step are not looked up): their pinned
    leading HITs are loaded, the rest is recomputed (``recompute_s`` per block,
    the step's compute) and stored. Finished requests make room for new ones
    from the shared :class:`Work`, at most ``concurrency`` in flight.
    """

    def __init__(self, session: Session, work: Work, args: argparse.Namespace) -> None:
        self.session = session
        self.work = work
        self.concurrency = args.concurrency
        self.budget = args.budget
        self.step_s = args.step_ms / 1000
        self.recompute_s = args.recompute_ms / 1000
        self.waiting: list[list[bytes]] = []
        self.tally = Tally()

    def run(self, deadline: float) -> None:
        self.admit()
        while self.waiting and time.monotonic() < deadline:
            self.step()
            self.admit()

    def admit(self) -> None:
        while len(self.waiting) < self.concurrency:
            doc = self.work.take()
            if doc is None:
                return
            self.waiting.append(document(doc))

    def step(self) -> None:
        release: list[bytes] = []
        still: list[list[bytes]] = []
        stores: list[list[bytes]] = []
        for position, keys in enumerate(self.waiting):
            if len(stores) == self.budget:  # the step is full: the rest is not looked at
                still += self.waiting[position:]
                break
            self.tally.lookups += 1
            results, rows = self.session.lookup_and_pin(keys, prefix=True)
            pinned = [key for key, row in zip(keys, rows, strict=True) if row >= 0]
            release += pinned  # a load or an unclaimed lookup pin: released at step end
            if any(result in (PENDING, RETRY) for result in results):
                still.append(keys)
                continue
            self.tally.requests += 1
            self.tally.loaded += len(pinned)
            stores.append(keys[len(pinned) :])
        self.waiting = still
        pins = Counter(release)
        while pins:  # one call per round of distinct keys (a call names a key once)
            keys = list(pins)
            self.session.complete_load(keys)
            pins -= Counter(keys)
        recomputed = sum(len(keys) for keys in stores)
        self.tally.recomputed += recomputed
        time.sleep(self.step_s + self.recompute_s * recomputed)  # the step's compute
        for keys in stores:
            if keys:
                self.store(keys)
        self.tally.steps += 1

    def store(self, keys: list[bytes]) -> None:
        grant = self.session.prepare_store(keys)
        if grant is None:
            self.tally.stores_refused += 1
        elif grant.keys_to_store:
            self.session.complete_store(grant.keys_to_store)


def engine(address: str, work: Work, args: argparse.Namespace, deadline: float) -> Tally:
    with Client(address) as client:
        session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=args.rows, layout="storm")
        scheduler = Scheduler(session, work, args)
        scheduler.run(deadline)
        return scheduler.tally


def storm(address: str, args: argparse.Namespace) -> tuple[float, list[Tally]]:
    """Runs ``--engines`` engines (threads) until every request is served or the
    bound passes; returns the seconds it took and each engine's tally."""
    rng = random.Random(SEED)
    work = Work([rng.randrange(DOCS) for _ in range(args.requests)])
    start = time.monotonic()
    with ThreadPoolExecutor(args.engines) as pool:
        futures = [
            pool.submit(engine, address, work, args, start + args.bound)
            for _ in range(args.engines)
        ]
        tallies = [future.result() for future in futures]
    return time.monotonic() - start, tallies


def run_one(name: str, root: str | None, hold: str | None, args: argparse.Namespace) -> Result:
    workdir = tempfile.mkdtemp(prefix="kvtierd-bench-storm-")
    config = os.path.join(workdir, "storm.toml")
    with open(config, "w") as handle:
        handle.write(config_text(root, hold))
    try:
        daemon = BenchDaemon("--config", config, "--memory-budget", "256MiB")
        with daemon, Client(daemon.address) as client:
            session = client.open_session(
                POOL, block_bytes=BLOCK, num_blocks=args.rows, layout="storm"
            )
            populate(client, session)
            seconds, tallies = storm(daemon.address, args)
            stats = client.get_stats(POOL).pools[0].tiers
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    fs = stats[1] if len(stats) > 1 else None

    def total(name: str) -> int:
        return sum(getattr(tally, name) for tally in tallies)

    return Result(
        name=name,
        seconds=seconds,
        served=total("requests"),
        steps=total("steps"),
        lookups=total("lookups"),
        loaded=total("loaded"),
        recomputed=total("recomputed"),
        promoted=fs.promoted_blocks if fs else 0,
        no_room=fs.promotion_no_room if fs else 0,
        evictions=stats[0].evictions,
        stores_refused=total("stores_refused"),
    )


def table(results: Sequence[Result], requests: int) -> str:
    header = ["run", "served", "seconds", "req/s", "steps", "lookups", "loaded", "recomputed",
              "promoted", "promoted/loaded", "disk MiB read", "no room", "evictions",
              "stores refused"]  # fmt: skip
    rows = [header]
    for r in results:
        ratio = f"{r.promoted / r.loaded:.2f}" if r.loaded else "-"
        rows.append([
            r.name, f"{r.served}/{requests}", f"{r.seconds:.2f}", f"{r.served / r.seconds:.1f}",
            f"{r.steps:,}", f"{r.lookups:,}", f"{r.loaded:,}", f"{r.recomputed:,}",
            f"{r.promoted:,}", ratio, f"{r.promoted * BLOCK / (1 << 20):,.0f}", f"{r.no_room:,}",
            f"{r.evictions:,}", f"{r.stores_refused:,}",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.storm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--engines", type=int, default=16, help="engines sharing the pool")
    parser.add_argument("--concurrency", type=int, default=2, help="requests per engine")
    parser.add_argument("--rows", type=int, default=64, help="primary rows of 64 KiB")
    parser.add_argument("--recompute-ms", type=float, default=2.0, help="per recomputed block")
    parser.add_argument("--budget", type=int, default=2, help="requests started per step")
    parser.add_argument("--step-ms", type=float, default=20.0, help="between two lookups")
    parser.add_argument("--bound", type=float, default=120.0, help="seconds per run at most")
    args = parser.parse_args(argv)
    for name in ("requests", "engines", "concurrency", "rows", "budget"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.recompute_ms < 0 or args.step_ms < 0 or args.bound <= 0:
        parser.error("--recompute-ms and --step-ms must be >= 0, --bound > 0")
    parent = os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp")
    results = []
    for name, with_fs, hold in (("primary only", False, None), ("fs, no holds", True, "0s"),
                                ("fs, holds", True, None)):  # fmt: skip
        root = tempfile.mkdtemp(prefix="kvtierd-bench-storm-fs-", dir=parent) if with_fs else None
        try:
            results.append(run_one(name, root, hold, args))
        finally:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
    print(f"\nmachine: {machine()}")
    print(
        f"{args.requests} requests, {args.engines} engines x {args.concurrency} at a time "
        f"({args.budget} started per step), {args.rows} rows of 64 KiB, "
        f"{DOCS} documents of {DOC_BLOCKS} blocks, steps of {args.step_ms:g} ms, recompute "
        f"{args.recompute_ms:g} ms/block\n"
    )
    print(table(results, args.requests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
