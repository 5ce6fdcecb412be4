"""Rows, journals and restarts for the warm-restart integration tests: ``content`` of a
key, rows written and read straight in a region file, a store through a session, a
daemon restarted on the same state directory, a storm of writer processes
(:class:`StormWriters`) and a CPU hog on every core (:func:`cpu_hogs`)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from daemon_harness import DaemonProcess

from kvtierd_client.client import LookupResult

BLOCK = 8192


HIT = LookupResult.HIT


MISS = LookupResult.MISS


def content(key: bytes, block_bytes: int = BLOCK) -> bytes:
    """The bytes a test stores under ``key``: derived from it, so any mix-up shows."""
    seed = hashlib.sha256(key).digest()
    return (seed * (block_bytes // len(seed) + 1))[:block_bytes]


def write_rows(path: str, rows: dict[int, bytes], block_bytes: int = BLOCK) -> None:
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as region:
        for row, data in rows.items():
            region[row * block_bytes : (row + 1) * block_bytes] = data


def read_row(path: str, row: int, block_bytes: int = BLOCK) -> bytes:
    with open(path, "rb") as file:
        file.seek(row * block_bytes)
        return file.read(block_bytes)


def store(session, keys: list[bytes], block_bytes: int = BLOCK) -> dict[bytes, int]:
    grant = session.prepare_store(keys)
    assert grant is not None and grant.keys_to_store == keys
    write_rows(
        session.region.path,
        {row: content(key, block_bytes) for key, row in zip(keys, grant.block_ids, strict=True)},
        block_bytes,
    )
    session.complete_store(keys)
    return dict(zip(keys, grant.block_ids, strict=True))


def assert_bit_exact(session, keys: list[bytes], block_bytes: int = BLOCK) -> None:
    rows = session.prepare_load(keys)
    for key, row in zip(keys, rows, strict=True):
        assert read_row(session.region.path, row, block_bytes) == content(key, block_bytes), key
    session.complete_load(keys)


def journal_of(region_path: str) -> Path:
    return Path(region_path[: -len(".region")] + ".journal")


def restart(daemon: DaemonProcess, sig: int = signal.SIGTERM) -> DaemonProcess:
    daemon.stop(sig)
    return daemon.restart()


BLOCKS = 64


# -- a storm of writers ------------------------------------------------------------------

STORM_WRITER = """
    import mmap, sys, hashlib, time
    from kvtierd_client.client import Client

    address, n, log_path, pool = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    NUM_ROWS, BLOCK, LAYOUT = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]

    def content(key):
        seed = hashlib.sha256(key).digest()
        return (seed * (BLOCK // len(seed) + 1))[:BLOCK]

    log = open(log_path, "w", buffering=1)
    try:
        client = Client(address)
        session = client.open_session(pool, block_bytes=BLOCK, num_blocks=NUM_ROWS, layout=LAYOUT)
        file = open(session.region.path, "r+b")
        region = mmap.mmap(file.fileno(), 0)
        i = 0
        while True:
            keys = [f"w{n}-{i}-{j}".encode() for j in range(4)]
            i += 1
            grant = session.prepare_store(keys)
            if grant is None:
                continue
            abandon = i % 7 == 0
            for key, row in zip(grant.keys_to_store, grant.block_ids):
                data = b"\\xee" * BLOCK if abandon else content(key)
                region[row * BLOCK:(row + 1) * BLOCK] = data
            if abandon:
                for key in grant.keys_to_store:
                    log.write(f"abandon {key.decode()}\\n")
                if i > 40:  # the early ones stay reserved (bounded: the pool fills)
                    session.complete_store(grant.keys_to_store, success=False)
                continue
            sent = time.monotonic()
            session.complete_store(grant.keys_to_store)
            done = time.monotonic()
            for key in grant.keys_to_store:
                log.write(f"done {key.decode()} {sent:.6f} {done:.6f}\\n")
    except Exception as exc:  # the daemon was killed: the storm ends
        log.write(f"# ended: {type(exc).__name__}\\n")
"""


@dataclass(frozen=True, slots=True)
class Completion:
    """A store a writer saw completed: the key, when its CompleteStore was sent and
    when its answer came back (time.monotonic, the daemon's clock too)."""

    key: bytes
    sent: float
    answered: float


class StormWriters:
    """``count`` client processes storing into ``pool`` as fast as they can, each
    block's bytes derived from its key (:func:`content`). Every seventh batch is
    filled with garbage and never completed: the first few stay reserved, the
    later ones are aborted (``abandoned``). Each writer logs what it completed."""

    def __init__(
        self, daemon: DaemonProcess, pool: str, rows: int, directory: Path, *,
        count: int = 3, block: int = BLOCK, layout: str = "s",
    ) -> None:  # fmt: skip
        script = directory / "storm.py"
        script.write_text(textwrap.dedent(STORM_WRITER))
        self.logs = [directory / f"writer-{n}.log" for n in range(count)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        args = [pool, str(rows), str(block), layout]
        self.processes = [
            subprocess.Popen(
                [sys.executable, str(script), daemon.address, str(n), str(self.logs[n]), *args],
                cwd=str(Path(__file__).resolve().parents[1]),
                env=env,
            )
            for n in range(count)
        ]

    def lines(self, kind: str) -> list[list[str]]:
        return [
            line.split()[1:]
            for log in self.logs
            if log.exists()
            for line in log.read_text().splitlines()
            if line.startswith(kind + " ")
        ]

    def completed(self) -> list[Completion]:
        """Every completion the writers logged, in the order their answers came."""
        done = [Completion(k.encode(), float(s), float(a)) for k, s, a in self.lines("done")]
        return sorted(done, key=lambda c: c.answered)

    def abandoned(self) -> list[bytes]:
        return [fields[0].encode() for fields in self.lines("abandon")]

    def each_completed(self, at_least: int) -> bool:
        """Whether every writer has logged at least ``at_least`` completions."""
        return all(log.exists() and log.read_text().count("done ") >= at_least for log in self.logs)

    def stop(self) -> None:
        """Waits for the writers (they end when the daemon dies); kills any left."""
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def resident_after(
    completions: list[Completion], rows: int, kill: float, age: float
) -> list[bytes]:
    """The keys completed at least ``age`` seconds before ``kill`` that must still be
    in an LRU primary of ``rows`` rows that nothing but stores touched: fewer than
    ``rows`` blocks completed after each (``rows`` less the writers' outstanding
    reservations and a margin for the order of answers across writers)."""
    room = rows - 512
    answered = [c.answered for c in completions]
    kept: list[bytes] = []
    for index, completion in enumerate(completions):
        later = len(answered) - index - 1
        if completion.answered <= kill - age and later < room:
            kept.append(completion.key)
    return kept


# -- load --------------------------------------------------------------------------------

HOG = "while True: pass"
# eight runnable busy loops per core (`stress-ng --cpu 16` on a 2-core node): a
# helper niced to 10 then gets ~1% of a core
HOGS_PER_CORE = 8


@contextlib.contextmanager
def cpu_hogs(per_core: int = HOGS_PER_CORE) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Busy loops taking every core for the duration (``per_core`` on each, at the
    same priority as everything else): a node whose CPUs are all taken, as
    ``stress-ng --cpu`` makes one, with a queue of runnable work on each core."""
    count = per_core * (os.cpu_count() or 1)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        time.sleep(0.2)  # let them take the cores before the work under test starts
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
