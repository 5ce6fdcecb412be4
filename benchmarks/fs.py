"""FS tier GB/s through a real daemon, next to plain Python moving the same bytes.

One run, one disk: a daemon with one ``[[tiers]] type = "fs"`` tier (2 MiB
blocks, 8 read-priority + 8 write-priority I/O threads) under a directory on a
real disk (``$KVTIERD_BENCH_FS_ROOT``, default ``/var/tmp``; tmpfs is refused).

* store (cascade): a client reserves BLOCKS rows, writes them with numpy, then
  completes them STORE_BATCH keys per ``CompleteStore``; timed from the first
  CompleteStore until the fs tier's stored events (``WatchEvents``, read on a
  thread) name every key, i.e. until every cascade job reported.
* promotion: ``FlushPool``, then ``Lookup`` of every key (LOOKUP_BATCH keys per
  call, all fit the primary), timed from the first Lookup until the primary's
  stored events name every key (the moment each answers HIT). *cold*: after
  ``sync`` + ``drop_caches`` (root only); *warm*: the files still in the page
  cache from the write. Waiting on the event stream costs the daemon nothing
  while the I/O runs (polling GetStats or Lookup every millisecond did: on 2
  vCPUs that is CPU the I/O threads need).
* floors, same run, same directory, same bytes: 16 Python threads
  (``ThreadPoolExecutor``) writing header + row to a temp file and renaming it
  (no fsync, as the tier's default), and 16 threads reading each file with
  ``readinto`` into a preallocated buffer.
* the tier runs twice, ``o_direct = "off"`` and ``"on"`` (fresh root each), with
  the default ``io_processes`` (block I/O in worker processes), and a third
  time with ``o_direct = "off"`` and ``io_processes = 0`` (block I/O on the
  daemon's I/O threads, under its interpreter lock) for comparison.
* vLLM's ``FileSystemTierManager`` (same threads, same block size) when
  ``.venv-vllm`` (or ``$KVTIERD_BENCH_VLLM_PYTHON``) has vLLM; else a skip row.
* two daemons on one shared root: how soon a block one stored is found and
  served by the other (:mod:`benchmarks.fs_shared`).

``python -m benchmarks fs`` runs it alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from benchmarks import fs_shared
from benchmarks.common import BenchDaemon, Row
from kvtierd.tiers.blockformat import HEADER_SIZE
from kvtierd.tiers.fs.settings import DEFAULTS
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.region import AttachedRegion

POOL = "bench/fs"
BLOCK = 2 << 20
BLOCKS = 256  # 512 MiB per pass
READ_THREADS = 8
WRITE_THREADS = 8
THREADS = READ_THREADS + WRITE_THREADS
STORE_BATCH = 16  # keys per CompleteStore (one engine step's worth)
LOOKUP_BATCH = 32  # keys per Lookup
POLL_S = 0.001  # polling of vLLM's get_finished_jobs (in process) and of untimed waits
REPEATS = 3  # best of
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_BYTES = HEADER_SIZE + BLOCK
TARGET = ">= 0.9x"
NOT_DISK = {"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs"}


# -- environment ---------------------------------------------------------------------


def fs_type(path: str) -> str:
    """File-system type of the mount holding ``path`` (longest mount-point prefix)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mounts") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


def drop_caches() -> bool:
    """``sync`` and drop the page cache; False when not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError:
        return False
    return True


def o_direct_supported(directory: str) -> bool:
    """What ``o_direct = "auto"`` would find: one aligned page written with O_DIRECT."""
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, ".bench-o-direct-probe")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _keys(tag: str) -> list[bytes]:
    return [f"fs-bench-{tag}-{i:06d}".encode() for i in range(BLOCKS)]


def _fill(rows: np.ndarray, block_ids: list[int]) -> None:
    """Distinct incompressible payloads: one random block, a counter at the front."""
    pattern = np.random.default_rng(0).integers(0, 256, size=BLOCK, dtype=np.uint8)
    for i, block_id in enumerate(block_ids):
        rows[block_id][:] = pattern
        rows[block_id][:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)


# -- plain Python floor ------------------------------------------------------------------


def baseline_write(
    directory: str, rows: np.ndarray, fsync: bool = False, checksum: bool = False
) -> float:
    """Seconds for THREADS threads to write every row as header + payload, temp + rename
    (``checksum``: xxh3-64 of each row first, as the tier does)."""
    header = bytes(HEADER_SIZE)
    os.makedirs(directory, exist_ok=True)

    def one(i: int) -> None:
        path = os.path.join(directory, f"{i:06d}.kvb")
        tmp = path + ".tmp"
        if checksum:
            xxhash.xxh3_64_intdigest(memoryview(rows[i]))
        with open(tmp, "wb", buffering=0) as f:
            f.write(header)
            f.write(memoryview(rows[i]))
            if fsync:
                os.fdatasync(f.fileno())
        os.rename(tmp, path)

    with ThreadPoolExecutor(THREADS) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(len(rows))))
        return time.perf_counter() - t0


def baseline_read(directory: str, buffers: np.ndarray, verify: bool = False) -> float:
    """Seconds for THREADS threads to read every file into its preallocated buffer
    (``verify``: then xxh3-64 of the payload, as the tier checks it)."""

    def one(i: int) -> None:
        with open(os.path.join(directory, f"{i:06d}.kvb"), "rb", buffering=0) as f:
            if f.readinto(memoryview(buffers[i])) != FILE_BYTES:
                raise RuntimeError("short read")
        if verify:
            xxhash.xxh3_64_intdigest(memoryview(buffers[i])[HEADER_SIZE:])

    with ThreadPoolExecutor(THREADS) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(len(buffers))))
        return time.perf_counter() - t0


def keep_best(best: dict[str, float], seconds: dict[str, float]) -> None:
    """Keeps in ``best`` the smallest seconds seen for each name."""
    for name, value in seconds.items():
        best[name] = min(best.get(name, value), value)


def floor_pass(
    plain: str, source: np.ndarray, buffers: np.ndarray, can_drop: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """One pass of the plain-Python floors in directory ``plain`` (removed after):
    seconds of store, warm and (``can_drop``) cold reads, and of store and warm
    read with the tier's xxh3 of each block."""
    drop_caches()
    seconds = {"store": baseline_write(plain, source)}
    os.sync()
    seconds["warm"] = baseline_read(plain, buffers)
    verified = {"warm": baseline_read(plain, buffers, verify=True)}
    shutil.rmtree(plain, ignore_errors=True)
    drop_caches()
    verified["store"] = baseline_write(plain, source, checksum=True)
    os.sync()
    if can_drop:
        drop_caches()
        seconds["cold"] = baseline_read(plain, buffers)
    shutil.rmtree(plain, ignore_errors=True)
    return seconds, verified


# -- the tier through a daemon -------------------------------------------------------------


def _config(path: str, root: str, o_direct: str, io_processes: int | None, extra: str = "") -> str:
    with open(path, "w") as f:
        f.write(
            f'[[tiers]]\ntype = "fs"\nname = "fs"\nroot = "{root}"\n'
            f"capacity = {(2 * REPEATS + 1) * BLOCKS * FILE_BYTES}\n"  # no pass evicts
            f"read_threads = {READ_THREADS}\nwrite_threads = {WRITE_THREADS}\n"
            f'o_direct = "{o_direct}"\nfsync = false\n{extra}'
        )
        if io_processes is not None:  # else the daemon's default
            f.write(f"io_processes = {io_processes}\n")
    return path


def _fs_stats(client: Client):  # noqa: ANN202
    return client.get_stats(POOL).pools[0].tiers[1]


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fs bench: timed out waiting for {what}")
        time.sleep(POLL_S)


class StoredEvents:
    """Follows a pool's ``WatchEvents`` stream on a thread and tells when every key
    of an expected set has appeared in a stored event of one tier."""

    def __init__(self, client: Client, pool: str) -> None:
        self._stream = client.watch_events(pool, after_seq=-1)
        self._cond = threading.Condition()
        self._tier = ""
        self._pending: set[bytes] = set()
        self._last = 0.0
        self._thread = threading.Thread(target=self._follow, name="bench-events", daemon=True)
        self._thread.start()

    def expect(self, tier: str, keys: list[bytes]) -> None:
        """Starts waiting for stored events of ``tier`` naming ``keys`` (later ones only)."""
        with self._cond:
            self._tier, self._pending = tier, set(keys)

    def wait(self, timeout: float = 120.0) -> float:
        """``perf_counter()`` when the last expected key arrived."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout):
                raise RuntimeError(
                    f"fs bench: {len(self._pending)} keys never reported by tier {self._tier}"
                )
            return self._last

    def _follow(self) -> None:
        for event in self._stream:
            if event.removed:
                continue
            with self._cond:
                if event.tier != self._tier or not self._pending:
                    continue
                self._pending.difference_update(event.keys)
                if not self._pending:
                    self._last = time.perf_counter()
                    self._cond.notify_all()

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=5)


def tier_run(
    root: str, o_direct: str, can_drop: bool, io_processes: int | None = None, extra: str = ""
) -> dict[str, float]:
    """Best seconds of REPEATS passes (store, warm and cold promotion) of one daemon
    (``extra``: more lines of its ``[[tiers]]`` table)."""
    work = tempfile.mkdtemp(prefix="kvtb-fs-", dir="/tmp")
    config = _config(os.path.join(work, "fs.toml"), root, o_direct, io_processes, extra)
    out: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        out[name] = min(out.get(name, seconds), seconds)

    try:
        with BenchDaemon("--config", config, "--memory-budget", "1GiB") as daemon:
            client = Client(daemon.address)
            session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=BLOCKS)
            info = session.region
            region = AttachedRegion.attach(info.path, info.num_blocks, info.block_bytes)
            _wait(lambda: _fs_stats(client).ready, "the fs tier's index scan")
            events = StoredEvents(client, POOL)
            stored = 0
            for r in range(2 * REPEATS):
                one_call = r >= REPEATS  # diagnostic: one CompleteStore of every key
                keys = _keys(f"{o_direct}-{r}")
                grant = session.prepare_store(keys)
                if grant is None or len(grant.keys_to_store) != BLOCKS:
                    raise RuntimeError("fs bench: the primary refused the store")
                rows = region.numpy()
                _fill(rows, list(grant.block_ids))
                del rows
                drop_caches()  # nothing dirty from earlier phases
                step = BLOCKS if one_call else STORE_BATCH
                events.expect("fs", keys)
                t0 = time.perf_counter()
                for i in range(0, BLOCKS, step):
                    session.complete_store(grant.keys_to_store[i : i + step])
                rpcs = time.perf_counter() - t0
                seconds = events.wait() - t0
                _wait(lambda: _fs_stats(client).jobs_in_flight == 0, "cascade jobs")
                stored += BLOCKS
                stats = _fs_stats(client)
                if stats.cascade_blocks != stored or stats.dropped_blocks or stats.cascade_failures:
                    raise RuntimeError(f"fs bench: cascade incomplete: {stats}")
                if one_call:
                    keep("store_one_call", seconds)
                    continue
                keep("store", seconds)
                keep("complete_rpcs", rpcs)
                os.sync()
                for phase in ("warm", "cold"):
                    if phase == "cold" and not can_drop:
                        continue
                    if client.flush_pool(POOL) != BLOCKS:
                        raise RuntimeError("fs bench: flush_pool did not evict every block")
                    if phase == "cold":
                        drop_caches()
                    seconds, first = _promote(session, events, keys)
                    keep(phase, seconds)
                    keep(f"{phase}_first_lookups", first)
            stats = _fs_stats(client)
            if stats.promotion_failures or stats.checksum_failures:
                raise RuntimeError(f"fs bench: promotions failed: {stats}")
            events.close()
            region.close()
            session.close()
            client.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _promote(session, events: StoredEvents, keys: list[bytes]) -> tuple[float, float]:  # noqa: ANN001
    """Seconds from the first Lookup until every key is HIT, and for the first Lookups."""
    events.expect("primary", keys)
    t0 = time.perf_counter()
    for i in range(0, len(keys), LOOKUP_BATCH):
        answers = session.lookup(keys[i : i + LOOKUP_BATCH])
        if LookupResult.MISS in answers or LookupResult.RETRY in answers:
            raise RuntimeError(f"fs bench: promotion not started: {answers}")
    first = time.perf_counter() - t0
    seconds = events.wait() - t0
    if not all(a == LookupResult.HIT for a in session.lookup(keys)):
        raise RuntimeError("fs bench: a promoted key does not answer HIT")
    # as an engine does: pin the promoted blocks and release them, which ends their
    # promotion holds (held blocks are never evicted, so the next FlushPool would keep them)
    for i in range(0, len(keys), LOOKUP_BATCH):
        batch = keys[i : i + LOOKUP_BATCH]
        session.prepare_load(batch)
        session.complete_load(batch, unused=True)
    return seconds, first


# -- vLLM's FileSystemTierManager (optional, run by the vLLM venv's Python) ----------------


def _vllm_python() -> str | None:
    candidate = os.environ.get("KVTIERD_BENCH_VLLM_PYTHON") or os.path.join(
        REPO, ".venv-vllm", "bin", "python"
    )
    return candidate if os.path.exists(candidate) else None


def vllm_run(root: str, can_drop: bool) -> dict[str, dict[str, float]] | str:
    """Best seconds of vLLM's FS tier per I/O mode, or why it was skipped."""
    python = _vllm_python()
    if python is None:
        return "vLLM not installed (no .venv-vllm)"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [python, "-m", "benchmarks.fs", "--vllm-worker", root, "1" if can_drop else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return "vLLM run timed out"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"vLLM not installed or not usable ({last[:100]})"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _vllm_jobs(tier, job_ids, context, keys, batch: int, promote: bool) -> float:  # noqa: ANN001
    """Seconds to submit ``keys`` in jobs of ``batch`` rows 0.. and poll until all are done."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    t0 = time.perf_counter()
    pending = set()
    for i in range(0, len(keys), batch):
        rows = np.arange(i, min(i + batch, len(keys)))
        job = TransferJob(next(job_ids), keys[i : i + batch], rows, promote, context)
        pending.add(job.job_id)
        (tier.submit_load if promote else tier.submit_store)(job)
    while pending:
        for result in tier.get_finished_jobs():
            if not result.success:
                raise RuntimeError(f"vLLM fs tier job {result.job_id} failed")
            pending.discard(result.job_id)
        if pending:
            time.sleep(POLL_S)
    return time.perf_counter() - t0


def _vllm_worker(root: str, can_drop: bool) -> dict[str, dict[str, float]]:
    """vLLM's FileSystemTierManager, unmodified, on a primary of BLOCKS rows: store jobs
    of STORE_BATCH keys, load jobs of LOOKUP_BATCH keys (the daemon's call sizes),
    polled every POLL_S like the daemon's client. Only its spec is a stand-in."""
    import mmap
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    mapping = mmap.mmap(-1, BLOCKS * BLOCK)
    rows = np.frombuffer(mapping, dtype=np.uint8).reshape(BLOCKS, BLOCK)
    _fill(rows, list(range(BLOCKS)))
    parallel = SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                               is_parallelism_agnostic=True)  # fmt: skip
    config = SimpleNamespace(
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["bench"])],
        model=SimpleNamespace(name="bench", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16),
        parallel=parallel, canonical_layout=False, replicated_layout=False,
        kv_cache_layout=None,
    )  # fmt: skip
    events = SimpleNamespace(enable_kv_cache_events=False)
    spec = SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=events)
    context = ReqContext(req_id="bench")
    job_ids = iter(range(1, 1 << 30))
    results: dict[str, dict[str, float]] = {}
    for buffered in (False, True):
        tier = FileSystemTierManager(
            spec, memoryview(rows), "fs", os.path.join(root, f"buffered-{buffered}"),
            n_read_threads=READ_THREADS, n_write_threads=WRITE_THREADS,
        )  # fmt: skip
        if buffered:
            tier._use_o_direct = False  # its probe picks O_DIRECT wherever it works
        mode = "on" if tier._use_o_direct else "off"
        out = results.setdefault(mode, {})
        for r in range(REPEATS):
            keys = [make_offload_key(f"vllm-{mode}-{r}-{i:06d}".encode().ljust(32, b"k"), 0)
                    for i in range(BLOCKS)]  # fmt: skip
            drop_caches()
            seconds = {"store": _vllm_jobs(tier, job_ids, context, keys, STORE_BATCH, False)}
            os.sync()
            seconds["warm"] = _vllm_jobs(tier, job_ids, context, keys, LOOKUP_BATCH, True)
            if can_drop:
                drop_caches()
                seconds["cold"] = _vllm_jobs(tier, job_ids, context, keys, LOOKUP_BATCH, True)
            keep_best(out, seconds)
        tier.shutdown()
    return results  # the mapping goes with the process (the tier keeps views of it)


# -- the suite ------------------------------------------------------------------------------

NAMES = {
    "store": "store (cascade: first CompleteStore -> all jobs done)",
    "warm": "promotion, warm page cache (first Lookup -> all HIT)",
    "cold": "promotion, cold page cache (first Lookup -> all HIT)",
}
FLOOR_NAMES = {"store": "python write", "warm": "python read warm", "cold": "python read cold"}
COMPARED = {"store": "store", "store_one_call": "store", "warm": "warm", "cold": "cold"}
"""Phases of a tier run compared with a floor phase by --compare-io-processes."""


def _short(phase: str) -> str:
    return NAMES[phase].split(" (")[0]


def run() -> list[Row]:
    parent = os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp")
    kind = fs_type(parent)
    if kind in NOT_DISK:
        return [Row("fs tier", f"skipped: {parent} is {kind}, not a disk", 0.0, "")]
    base = tempfile.mkdtemp(prefix="kvtierd-bench-fs-", dir=parent)
    payload = BLOCKS * BLOCK  # GB/s of KV bytes (files hold a 4 KiB header more)
    group = f"fs tier, {kind}, {BLOCKS} x 2 MiB, {READ_THREADS}r+{WRITE_THREADS}w threads"
    rows: list[Row] = []
    try:
        can_drop = drop_caches()
        auto = "on" if o_direct_supported(base) else "off"
        # floor: plain Python, same directory, same bytes, best of REPEATS
        source = np.empty((BLOCKS, BLOCK), dtype=np.uint8)
        _fill(source, list(range(BLOCKS)))
        buffers = np.ones((BLOCKS, FILE_BYTES), dtype=np.uint8)  # prefaulted
        floor: dict[str, float] = {}
        verified: dict[str, float] = {}  # the same plus the tier's xxh3 of each block
        for r in range(REPEATS):
            seconds, check = floor_pass(os.path.join(base, f"plain-{r}"), source, buffers, can_drop)
            keep_best(verified, check)
            keep_best(floor, seconds)
        del source, buffers

        tiers: dict[str, dict[str, float]] = {}
        for mode in ("off", "on"):
            if mode == "on" and auto == "off":
                rows.append(Row(group, "o_direct=on: not supported here, skipped", 0.0, ""))
                continue
            root = os.path.join(base, f"tier-o_direct-{mode}")
            os.makedirs(root)
            tiers[mode] = tier_run(root, mode, can_drop)
            shutil.rmtree(root, ignore_errors=True)
        root = os.path.join(base, "tier-inline-io")
        os.makedirs(root)
        inline = tier_run(root, "off", can_drop, io_processes=0)  # I/O on the daemon's threads
        shutil.rmtree(root, ignore_errors=True)

        for phase in NAMES:
            if phase not in floor:
                rows.append(Row(group, f"{NAMES[phase]}: skipped, cannot drop caches", 0.0, ""))
                continue
            floor_gbs = _gbs(payload, floor[phase])
            for mode, result in tiers.items():
                gbs = _gbs(payload, result[phase])
                rows.append(Row(group, f"{NAMES[phase]}, o_direct={mode}", gbs, "GB/s",
                                f"{FLOOR_NAMES[phase]} {floor_gbs:.2f} GB/s", gbs / floor_gbs,
                                TARGET))  # fmt: skip
        for phase, seconds in verified.items():  # how much of the gap is verification
            floor_gbs = _gbs(payload, seconds)
            gbs = _gbs(payload, tiers["off"][phase])
            rows.append(Row(group, f"{_short(phase)}, o_direct=off, vs a floor with xxh3",
                            gbs, "GB/s",
                            f"{FLOOR_NAMES[phase]} + xxh3 {floor_gbs:.2f} GB/s", gbs / floor_gbs,
                            TARGET))  # fmt: skip
        if "on" in tiers:
            for phase in floor:
                on, off = _gbs(payload, tiers["on"][phase]), _gbs(payload, tiers["off"][phase])
                rows.append(Row("fs tier, O_DIRECT on vs off", f"{_short(phase)}, o_direct=on",
                                on, "GB/s", f"o_direct=off {off:.2f} GB/s", on / off,
                                "auto: on only if faster"))  # fmt: skip
        wgroup = f"fs tier, block I/O in {DEFAULTS.io_processes} worker processes vs in the daemon"
        for phase in (p for p in NAMES if p in inline):
            gbs, base_gbs = _gbs(payload, tiers["off"][phase]), _gbs(payload, inline[phase])
            rows.append(Row(wgroup, f"{_short(phase)}, o_direct=off", gbs, "GB/s",
                            f"io_processes=0 {base_gbs:.2f} GB/s", gbs / base_gbs,
                            ">= 1.0x"))  # fmt: skip
        rpcs, base_rpcs = tiers["off"]["complete_rpcs"], inline["complete_rpcs"]
        rows.append(Row(wgroup, f"{BLOCKS // STORE_BATCH} CompleteStore RPCs during the cascade",
                        rpcs * 1e3, "ms", f"io_processes=0 {base_rpcs * 1e3:.1f} ms",
                        rpcs / base_rpcs, "< 1.0x"))  # fmt: skip
        for mode, result in tiers.items():
            gbs = _gbs(payload, result["store_one_call"])
            rows.append(Row("fs tier, phases", f"store, ONE CompleteStore of {BLOCKS} keys, "
                            f"o_direct={mode}", gbs, "GB/s",
                            f"python write {_gbs(payload, floor['store']):.2f} GB/s",
                            gbs / _gbs(payload, floor["store"])))  # fmt: skip
            rows.append(Row("fs tier, phases", f"{BLOCKS // STORE_BATCH} CompleteStore RPCs "
                            f"of {STORE_BATCH} keys, o_direct={mode}",
                            result["complete_rpcs"] * 1e3, "ms"))  # fmt: skip
            rows.append(Row("fs tier, phases", f"{BLOCKS // LOOKUP_BATCH} first Lookups "
                            f"(promotions started), cold, o_direct={mode}",
                            result.get("cold_first_lookups", 0.0) * 1e3, "ms"))  # fmt: skip

        vroot = os.path.join(base, "vllm")
        os.makedirs(vroot)
        vllm = vllm_run(vroot, can_drop)
        shutil.rmtree(vroot, ignore_errors=True)
        vgroup = "fs tier vs vLLM FileSystemTierManager"
        if isinstance(vllm, str):
            rows.append(Row(vgroup, f"{vllm}: skipped", 0.0, ""))
        else:
            for phase in NAMES:
                for mode, result in tiers.items():
                    if mode not in vllm or phase not in vllm[mode]:
                        continue
                    vgbs = _gbs(payload, vllm[mode][phase])
                    gbs = _gbs(payload, result[phase])
                    rows.append(Row(vgroup, f"{_short(phase)}, both o_direct={mode}", gbs, "GB/s",
                                    f"vLLM {vgbs:.2f} GB/s", gbs / vgbs, ">= 1.0x"))  # fmt: skip
        rows.extend(fs_shared.run())  # cross-daemon HIT latency on a shared root
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def compare_io_processes(settings: list[int], rounds: int) -> list[Row]:
    """Median of ``rounds`` tier runs (o_direct=off) per ``io_processes`` setting, the
    settings alternated within each round so the machine's drift hits them alike. Each
    round then runs the plain-Python floors (best of REPEATS passes, as a tier run is),
    and every ratio is the median of the per-round ratios (tier / floor of the same
    round), which this VM's drift moves far less than a ratio of two best-ofs taken
    minutes apart."""
    parent = os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp")
    can_drop = drop_caches()
    source = np.empty((BLOCKS, BLOCK), dtype=np.uint8)
    _fill(source, list(range(BLOCKS)))
    buffers = np.ones((BLOCKS, FILE_BYTES), dtype=np.uint8)  # prefaulted
    results: dict[int, list[dict[str, float]]] = {n: [] for n in settings}
    floors: list[dict[str, float]] = []
    for r in range(rounds):
        for n in settings:
            root = tempfile.mkdtemp(prefix="kvtierd-bench-fs-io-", dir=parent)
            try:
                results[n].append(tier_run(root, "off", can_drop, io_processes=n))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"round {r + 1}/{rounds}, io_processes={n}: done", file=sys.stderr, flush=True)
        best: dict[str, float] = {}  # best of REPEATS, like the tier's passes
        for _ in range(REPEATS):
            directory = tempfile.mkdtemp(dir=parent)
            try:
                plain, verified = floor_pass(directory, source, buffers, can_drop)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            keep_best(best, {**plain, **{f"{k}+xxh3": v for k, v in verified.items()}})
        floors.append(best)
    return _compare_rows(results, floors, rounds)


def _compare_rows(
    results: dict[int, list[dict[str, float]]], floors: list[dict[str, float]], rounds: int
) -> list[Row]:
    payload = BLOCKS * BLOCK

    def median(values: list[float]) -> tuple[float, str]:
        values = sorted(values)
        return values[len(values) // 2], f"range {values[0]:.2f}-{values[-1]:.2f}"

    rows = []
    fgroup = f"plain-Python floors, median of {rounds}"
    for name in floors[0]:
        value, spread = median([_gbs(payload, f[name]) for f in floors])
        phase = name.removesuffix("+xxh3")
        label = FLOOR_NAMES[phase] + (" + xxh3" if name != phase else "")
        rows.append(Row(fgroup, label, value, "GB/s", spread))
    for n, runs in results.items():
        group = f"fs tier, io_processes={n}, median of {rounds}"
        for phase, floor in COMPARED.items():
            if phase not in runs[0]:
                continue
            label = f"{_short(floor)}, one CompleteStore" if phase != floor else _short(phase)
            value, spread = median([_gbs(payload, run[phase]) for run in runs])
            rows.append(Row(group, f"{label}, o_direct=off", value, "GB/s", spread))
            for name in (floor, f"{floor}+xxh3"):
                if name not in floors[0]:
                    continue
                pairs = zip(floors, runs, strict=True)  # floor seconds / tier seconds
                ratio, spread = median([f[name] / run[phase] for f, run in pairs])
                rows.append(Row(group, f"{label} / {name} floor of the same round", ratio, "x",
                                f"ratio {spread}", ratio, TARGET))  # fmt: skip
        value, spread = median([run["complete_rpcs"] * 1e3 for run in runs])
        rows.append(Row(group, f"{BLOCKS // STORE_BATCH} CompleteStore RPCs during the cascade",
                        value, "ms", spread))  # fmt: skip
    return rows


def _main(argv: list[str]) -> None:
    import argparse

    from benchmarks.common import print_table

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fs",
        description="The fs tier's GB/s next to plain Python and vLLM (the make bench suite).",
    )
    parser.add_argument(
        "--compare-io-processes", metavar="N,N,...",
        help="instead: run the tier (o_direct=off) with each io_processes setting, "
             "alternating, plus the plain-Python floors, each round; print medians and "
             "the median of per-round tier/floor ratios (e.g. 0,2, or 2 alone)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds for --compare-io-processes (default 5)"
    )
    args = parser.parse_args(argv)
    if args.compare_io_processes is None:
        print_table(run())
        return
    try:
        settings = [int(n) for n in args.compare_io_processes.split(",")]
    except ValueError:
        parser.error(f"--compare-io-processes: expected integers like 0,2; got "
                     f"{args.compare_io_processes!r}")  # fmt: skip
    if args.rounds < 1 or any(n < 0 for n in settings):
        parser.error("--rounds must be at least 1 and io_processes settings at least 0")
    print_table(compare_io_processes(settings, args.rounds))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vllm-worker"]:  # run by vllm_run() with the vLLM venv's Python
        print(json.dumps(_vllm_worker(sys.argv[2], sys.argv[3] == "1")))
    else:
        _main(sys.argv[1:])
