"""Bytes through the real path: a daemon, worker processes, ``CopyEngine``, compared.

The pool's rows hold vLLM's canonical layout: ``LAYERS`` int8 tensors of shape
``(ENGINE_BLOCKS, PAGE_BYTES)``, one per layer, so a row is ``LAYERS`` pages side
by side and every block moves as ``LAYERS`` strided copies. Each key's pages are
a pure function of the key (:func:`expected_pages`), so any process can tell
what a loaded block must hold without asking the one that stored it.

The run, against one daemon, each worker a spawned process (CUDA cannot fork):

1. a writer stores the keys of set A at shuffled engine block ids;
2. at the same time: two readers load set A (each several times, at new shuffled
   ids, into tensors filled with a sentinel first) while a second writer stores set B;
3. a reader loads set B.

A reader compares every loaded page with the key's pages and every block it did
not load with the sentinel (a copy that lands in the wrong block is caught too).
A job that ends past its lease fence counts as a failure, as the plug-in would
treat it. Any difference fails the section (:class:`CheckFailed`) with the first
few differences named.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from benchmarks.common import BenchDaemon, Row
from benchmarks.gpu.environment import kv_device
from benchmarks.gpu.report import CheckFailed, SectionResult

POOL = "gpu-check/correctness"
LAYERS = 8
PAGE_BYTES = 64 << 10  # one layer's page of one block (vLLM: 2 x 16 tokens x 8 heads x 128 x 2 B)
ROW_BYTES = LAYERS * PAGE_BYTES
ROWS = 256  # holds sets A and B without eviction
ENGINE_BLOCKS = 96
KEYS_PER_JOB = 24
SET_SIZE = 96
READS_PER_READER = 3
QUICK_SET_SIZE = 24  # --quick: one job per worker, one read per reader
SENTINEL = 0x5A
WORKER_TIMEOUT_S = 300.0
LAYOUT = f"gpu-check:{LAYERS}x{PAGE_BYTES}:int8"


def key_set(name: str, n: int = SET_SIZE) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(n)]


def expected_pages(key: bytes, layers: int = LAYERS, page_bytes: int = PAGE_BYTES) -> torch.Tensor:
    """The ``(layers, page_bytes)`` int8 pages stored under ``key``: seeded by its hash."""
    generator = torch.Generator().manual_seed(xxhash.xxh64_intdigest(key) >> 1)
    return torch.randint(-128, 128, (layers, page_bytes), dtype=torch.int8, generator=generator)


def compare_loaded(
    kv: list[torch.Tensor], placements: list[tuple[bytes, int]], sentinel: int = SENTINEL
) -> list[str]:
    """Differences between ``kv`` (one tensor per layer) and what it must hold after a
    load: ``expected_pages(key)`` at each placed engine block, ``sentinel`` in every
    other block. Returns one line per wrong block (empty: every byte right)."""
    layers, page_bytes = len(kv), kv[0].shape[1]
    differences: list[str] = []
    placed = {block for _, block in placements}
    for key, block in placements:
        expected = expected_pages(key, layers, page_bytes)
        for layer, tensor in enumerate(kv):
            got = tensor[block].cpu()
            if not torch.equal(got, expected[layer]):
                wrong = int((got != expected[layer]).sum())
                differences.append(
                    f"{key!r} in engine block {block}, layer {layer}: {wrong} of {page_bytes} "
                    "bytes differ"
                )
    untouched = [b for b in range(kv[0].shape[0]) if b not in placed]
    if untouched:
        index = torch.tensor(untouched, device=kv[0].device)
        for layer, tensor in enumerate(kv):
            rows = tensor.index_select(0, index)
            bad = (rows != _signed(sentinel)).any(dim=1).nonzero().flatten().tolist()
            differences += [
                f"engine block {untouched[i]}, layer {layer}: written by a load that did "
                "not name it"
                for i in bad
            ]
    return differences


def _signed(byte: int) -> int:
    return byte - 256 if byte > 127 else byte


@dataclass
class WorkerReport:
    role: str
    blocks: int = 0
    bytes_compared: int = 0
    seconds: float = 0.0
    differences: list[str] = field(default_factory=list)
    error: str = ""


def run(quick: bool = False) -> SectionResult:
    section = SectionResult("correctness")
    device = kv_device()
    size, reads = (QUICK_SET_SIZE, 1) if quick else (SET_SIZE, READS_PER_READER)
    with BenchDaemon("--memory-budget", f"{ROWS * ROW_BYTES >> 20}MiB") as daemon:
        context = multiprocessing.get_context("spawn")
        set_a, set_b = key_set("a", size), key_set("b", size)
        reports = _run_workers(context, daemon.address, [("store", set_a, 1, 1)])
        reports += _run_workers(
            context,
            daemon.address,
            [("load", set_a, 2, reads), ("load", set_a, 3, reads), ("store", set_b, 4, 1)],
        )
        reports += _run_workers(context, daemon.address, [("load", set_b, 5, reads)])
    failures = [r for r in reports if r.error or r.differences]
    loaded = [r for r in reports if r.role == "load"]
    compared = sum(r.bytes_compared for r in loaded)
    stored = sum(r.blocks for r in reports if r.role == "store")
    section.rows.append(
        Row(
            "correctness",
            f"{len(reports)} worker processes, {LAYERS} layers x {PAGE_BYTES >> 10} KiB pages "
            f"on {device.type}: blocks stored / loaded",
            stored + sum(r.blocks for r in loaded),
            "blocks",
            "",
            None,
            "every byte equal",
        )
    )
    section.rows.append(
        Row(
            "correctness",
            "bytes compared after loads (pages + untouched blocks)",
            compared / (1 << 20),
            "MiB",
            "",
            None,
            "0 differences",
        )
    )
    section.notes.append(
        f"store of set A; then two readers load A ({reads} times each, new shuffled engine ids, "
        "sentinel-filled tensors) while a writer stores B; then B is loaded: "
        + ", ".join(f"{r.role} {r.blocks} blocks in {r.seconds:.2f} s" for r in reports)
    )
    if failures:
        lines = [f"{r.role}: {r.error or '; '.join(r.differences[:3])}" for r in failures]
        raise CheckFailed("wrong or failed copies: " + " | ".join(lines))
    return section


def _run_workers(
    context: Any, address: str, jobs: list[tuple[str, list[bytes], int, int]]
) -> list[WorkerReport]:
    """Runs one process per ``(role, keys, seed, passes)`` at once; their reports, in order."""
    results: Any = context.Queue()
    processes = [
        context.Process(target=_worker_main, args=(index, job, address, results))
        for index, job in enumerate(jobs)
    ]
    for process in processes:
        process.start()
    reports: dict[int, WorkerReport] = {}
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while len(reports) < len(processes) and time.monotonic() < deadline:
        try:
            index, report = results.get(timeout=1.0)
            reports[index] = report
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if i not in reports and p.exitcode]
            for i in dead:
                reports[i] = WorkerReport(jobs[i][0], error=f"exited with {processes[i].exitcode}")
    for index, process in enumerate(processes):
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            reports.setdefault(index, WorkerReport(jobs[index][0], error="did not finish"))
    return [reports.get(i, WorkerReport(jobs[i][0], error="no report")) for i in range(len(jobs))]


def _worker_main(
    index: int, job: tuple[str, list[bytes], int, int], address: str, results: Any
) -> None:
    role, keys, seed, passes = job
    report = WorkerReport(role)
    try:
        _worker(role, address, keys, random.Random(seed), passes, report)
    except Exception as error:  # reported to the parent, which fails the section
        report.error = f"{type(error).__name__}: {error}"
    results.put((index, report))


def _worker(
    role: str,
    address: str,
    keys: list[bytes],
    rng: random.Random,
    passes: int,
    report: WorkerReport,
) -> None:
    from kvtierd_client.client import Client
    from kvtierd_client.copy_engine import CopyEngine
    from kvtierd_client.region import attach_announced

    device = kv_device()
    started = time.perf_counter()
    with Client(address) as client:
        session = client.open_session(POOL, block_bytes=ROW_BYTES, num_blocks=ROWS, layout=LAYOUT)
        region = attach_announced(
            session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
        )
        kv = [
            torch.zeros(ENGINE_BLOCKS, PAGE_BYTES, dtype=torch.int8, device=device)
            for _ in range(LAYERS)
        ]
        try:
            with CopyEngine(region, kv) as engine:
                for _ in range(passes):
                    for start in range(0, len(keys), KEYS_PER_JOB):
                        chunk = keys[start : start + KEYS_PER_JOB]
                        if role == "store":
                            _store(session, engine, kv, chunk, rng, report)
                        else:
                            _load(session, engine, kv, chunk, rng, report)
        finally:
            region.close()
        session.close()
    report.seconds = time.perf_counter() - started


def _store(
    session: Any,
    engine: Any,
    kv: list[torch.Tensor],
    keys: list[bytes],
    rng: random.Random,
    report: WorkerReport,
) -> None:
    blocks = rng.sample(range(ENGINE_BLOCKS), len(keys))
    for key, block in zip(keys, blocks, strict=True):
        pages = expected_pages(key).to(kv[0].device)
        for layer, tensor in enumerate(kv):
            tensor[block].copy_(pages[layer])
    grant = _prepare_store(session, keys)
    block_of = dict(zip(keys, blocks, strict=True))
    pairs = [
        (block_of[k], row) for k, row in zip(grant.keys_to_store, grant.block_ids, strict=True)
    ]
    job = engine.submit_store(pairs, lease_deadline=session.lease_deadline)
    engine.wait([job])
    late = job in engine.late_jobs()
    session.complete_store(grant.keys_to_store, success=not late)
    if late:
        raise CheckFailed(f"a store of {len(pairs)} blocks ended past its lease fence")
    report.blocks += len(pairs)


def _prepare_store(session: Any, keys: list[bytes]) -> Any:
    deadline = time.monotonic() + 30
    while (grant := session.prepare_store(keys)) is None:
        if time.monotonic() > deadline:
            raise CheckFailed("PrepareStore found no room for 30 s in a pool sized for every key")
        time.sleep(0.01)
    return grant


def _load(
    session: Any,
    engine: Any,
    kv: list[torch.Tensor],
    keys: list[bytes],
    rng: random.Random,
    report: WorkerReport,
) -> None:
    from kvtierd_client.wire.results import LookupResult

    results = session.lookup(keys)
    if any(r != LookupResult.HIT for r in results):
        missing = [k for k, r in zip(keys, results, strict=True) if r != LookupResult.HIT]
        raise CheckFailed(f"{len(missing)} stored keys are not HIT, first {missing[0]!r}")
    rows = session.prepare_load(keys)
    for tensor in kv:
        tensor.fill_(_signed(SENTINEL))
    blocks = rng.sample(range(ENGINE_BLOCKS), len(keys))
    job = engine.submit_load(
        list(zip(rows, blocks, strict=True)), lease_deadline=session.lease_deadline
    )
    engine.wait([job])
    late = job in engine.late_jobs()
    session.complete_load(keys)
    if late:
        raise CheckFailed(f"a load of {len(keys)} blocks ended past its lease fence")
    report.differences += compare_loaded(kv, list(zip(keys, blocks, strict=True)))
    report.blocks += len(keys)
    report.bytes_compared += ENGINE_BLOCKS * ROW_BYTES
