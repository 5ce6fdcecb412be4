"""Redis tier GB/s and remote-lookup latency through a real daemon and a real redis-server.

One run, one ``redis-server`` started here (loopback TCP, no persistence, no
maxmemory), one daemon with one ``[[tiers]] type = "redis"`` tier (2 MiB
blocks, the default 8 I/O threads). Without a ``redis-server`` binary (``make
test-tools`` installs it as root with apt) the suite prints a skip row.

* store (cascade): a client reserves BLOCKS rows, writes them with numpy, then
  completes them STORE_BATCH keys per ``CompleteStore``; timed from the first
  CompleteStore until the redis tier's stored events name every key.
* promotion: ``FlushPool``, then ``Lookup`` of every key (LOOKUP_BATCH keys per
  call), timed from the first Lookup until the primary's stored events name
  every key (the moment each answers HIT).
* floors, same run, same server, same bytes (4 KiB header + 2 MiB row per
  value): plain redis-py (+ hiredis) ``SET`` of each value (one ``bytes``
  object) and ``GET`` of each key from 1 thread and from THREADS threads (one
  connection each, the tier's thread count), commands packed by hiredis
  (redis-py's default when hiredis is installed: it copies the value into one
  buffer) and by redis-py's Python packer (the value sent as its own buffer, as
  the tier sends its row); the floor is the fastest variant. Best of REPEATS
  for tier and floor alike, the floors' rounds run between the tier's passes
  (on a machine shared with other work, a busy spell then hits both).
* client library: valkey-glide's sync client (``valkey-glide-sync``, when
  installed) ``SET`` / ``GET`` of the same values from 1 and THREADS threads
  (one client: it multiplexes one connection per node), in the same rounds,
  against the redis-py floor.
* remote lookup: a second daemon, same server and key prefix, whose tier knows
  nothing of the keys the first stored. One key at a time: the first Lookup (it
  asks the server, one EXISTS round trip, and answers HIT_PENDING: the promotion
  started; ``limits.remote_lookup_wait``), then Lookups every POLL_S until HIT
  (promotion GET, copy into the row): "until HIT". The first Lookup's RPC time
  against a Lookup of a missing key on a primary-only daemon running alongside,
  timed just before each first Lookup: the difference is what asking the server
  in the lookup adds (one ``EXISTS`` round trip of redis-py from this process,
  timed alongside, is its floor).

* fleet LRU: the store and promotion passes again on a daemon with ``fleet_capacity``
  (far above the bytes stored: every store job's admission script and every
  promotion's touch, nothing evicted) and on one without, alternating (with,
  without, without, with; the server emptied before each): what keeping the
  fleet's LRU index costs each path.

``python -m benchmarks redis`` runs it alone.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import redis

from benchmarks.common import BenchDaemon, Row, percentile
from benchmarks.fs import StoredEvents, _fill, _gbs, _wait
from kvtierd.tiers.blockformat import HEADER_SIZE
from kvtierd.tiers.redis.settings import DEFAULTS
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.region import AttachedRegion

POOL = "bench/redis"
BLOCK = 2 << 20
BLOCKS = 128  # 256 MiB per pass
THREADS = DEFAULTS.threads
FLOOR_THREADS = (1, THREADS)  # the floor is the fastest variant (on few cores: often 1)
FLOOR_PACKERS = ("hiredis", "python")
STORE_BATCH = 16
LOOKUP_BATCH = 32
REPEATS = 3
REMOTE_KEYS = 100  # single-key remote lookups timed
POLL_S = 0.0005
IDLE_S = 0.005  # pause before each timed first Lookup and its floor
VALUE_BYTES = HEADER_SIZE + BLOCK
TARGET = ">= 0.8x"
FLEET_BOUND = 'fleet_capacity = "64GiB"\n'  # far above a pass's bytes: nothing evicted
GROUP = "redis tier (2 MiB blocks)"


class _Server:
    """A standalone redis-server on a free loopback port (no persistence)."""

    def __init__(self, binary: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvtb-redis-")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
             "--save", "", "--appendonly", "no", "--protected-mode", "no",
             "--logfile", os.path.join(self.directory, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.01)
        self.close()
        raise RuntimeError("redis-server did not answer")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _keys(tag: str, n: int = BLOCKS) -> list[bytes]:
    return [f"redis-bench-{tag}-{i:06d}".encode() for i in range(n)]


# -- plain redis-py floor -------------------------------------------------------------------


def _python_packer() -> redis.connection.PythonRespSerializer:
    """redis-py's own RESP packer: a large value goes out as its own buffer, not joined
    (with hiredis installed redis-py packs with hiredis, which copies it into one)."""
    encoder = redis.connection.Encoder("utf-8", "strict", False)
    return redis.connection.PythonRespSerializer(6000, encoder.encode)


def floor_pass(
    server: _Server, values: list[bytes], tag: str, threads: int, packer: str
) -> dict[str, float]:
    """Seconds for ``threads`` threads (one connection each) to SET then GET every value,
    commands packed by hiredis (redis-py's default when installed) or by redis-py."""
    extra = {} if packer == "hiredis" else {"command_packer": _python_packer()}
    pool = redis.ConnectionPool(port=server.port, max_connections=threads, **extra)
    client = redis.Redis(connection_pool=pool)
    keys = [f"floor:{tag}:{i:06d}".encode() for i in range(len(values))]
    out: dict[str, float] = {}
    with ThreadPoolExecutor(threads) as executor:
        list(executor.map(lambda _: client.ping(), range(threads)))  # connections open
        t0 = time.perf_counter()
        list(executor.map(lambda i: client.set(keys[i], values[i]), range(len(values))))
        out["store"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(executor.map(client.get, keys))
        out["promotion"] = time.perf_counter() - t0
    if any(g is None or len(g) != VALUE_BYTES for g in got):
        raise RuntimeError("redis bench: a floor GET came back short")
    client.delete(*keys)
    pool.disconnect()
    return out


# -- valkey-glide, the other client library ---------------------------------------------


def _glide() -> Any:
    """The ``glide_sync`` module (``pip install valkey-glide-sync``), None without it."""
    try:
        return importlib.import_module("glide_sync")
    except ImportError:
        return None


def glide_pass(
    glide: Any, server: _Server, values: list[bytes], tag: str, threads: int
) -> dict[str, float]:
    """Seconds for valkey-glide's sync client (one client: it multiplexes its one
    connection per node) called from ``threads`` threads to SET then GET every value."""
    config = glide.GlideClientConfiguration(
        [glide.NodeAddress("127.0.0.1", server.port)], request_timeout=30_000
    )
    client = glide.GlideClient.create(config)
    keys = [f"glide:{tag}:{i:06d}".encode() for i in range(len(values))]
    out: dict[str, float] = {}
    try:
        with ThreadPoolExecutor(threads) as executor:
            t0 = time.perf_counter()
            list(executor.map(lambda i: client.set(keys[i], values[i]), range(len(values))))
            out["store"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = list(executor.map(client.get, keys))
            out["promotion"] = time.perf_counter() - t0
        if any(g is None or len(g) != VALUE_BYTES for g in got):
            raise RuntimeError("redis bench: a glide GET came back short")
        client.delete(keys)
    finally:
        client.close()
    return out


# -- the tier through a daemon ------------------------------------------------------------


def _config(directory: str, url: str, prefix: str, extra: str = "") -> str:
    path = os.path.join(directory, f"redis-{prefix}.toml")
    with open(path, "w") as f:
        f.write(f'[[tiers]]\ntype = "redis"\nname = "redis"\nurls = ["{url}"]\n'
                f'key_prefix = "{prefix}"\n{extra}')  # fmt: skip
    return path


def _tier_stats(client: Client):  # noqa: ANN202
    return client.get_stats(POOL).pools[0].tiers[1]


def _release(session, keys: list[bytes]) -> None:  # noqa: ANN001
    """As an engine does: pin the promoted blocks and release them (ends promotion holds)."""
    for i in range(0, len(keys), LOOKUP_BATCH):
        batch = keys[i : i + LOOKUP_BATCH]
        session.prepare_load(batch)
        session.complete_load(batch, unused=True)


def tier_run(config: str, between: Callable[[int], None]) -> tuple[dict[str, float], list[bytes]]:
    """Best seconds of REPEATS store + promotion passes; the keys of the last pass.
    ``between(r)`` runs after pass ``r`` (untimed here: the floors' passes, so that
    tier and floors take turns on a machine whose load changes)."""
    out: dict[str, float] = {}
    keys: list[bytes] = []
    with BenchDaemon("--config", config, "--memory-budget", "1GiB") as daemon:
        client = Client(daemon.address)
        session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=BLOCKS)
        _wait(lambda: _tier_stats(client).ready, "the redis tier")
        events = StoredEvents(client, POOL)
        info = session.region
        region = AttachedRegion.attach(info.path, info.num_blocks, info.block_bytes)
        stored = 0
        for r in range(REPEATS):
            keys = _keys(f"tier-{r}")
            grant = session.prepare_store(keys)
            if grant is None or len(grant.keys_to_store) != BLOCKS:
                raise RuntimeError("redis bench: the primary refused the store")
            rows = region.numpy()
            _fill(rows, list(grant.block_ids))
            del rows
            events.expect("redis", keys)
            t0 = time.perf_counter()
            for i in range(0, BLOCKS, STORE_BATCH):
                session.complete_store(grant.keys_to_store[i : i + STORE_BATCH])
            store = events.wait() - t0
            _wait(lambda: _tier_stats(client).jobs_in_flight == 0, "cascade jobs")
            stored += BLOCKS
            stats = _tier_stats(client)
            if stats.cascade_blocks != stored or stats.dropped_blocks or stats.cascade_failures:
                raise RuntimeError(f"redis bench: cascade incomplete: {stats}")
            out["store"] = min(out.get("store", store), store)
            if client.flush_pool(POOL) != BLOCKS:
                raise RuntimeError("redis bench: flush_pool did not evict every block")
            events.expect("primary", keys)
            t0 = time.perf_counter()
            for i in range(0, BLOCKS, LOOKUP_BATCH):
                answers = session.lookup(keys[i : i + LOOKUP_BATCH])
                if LookupResult.MISS in answers or LookupResult.RETRY in answers:
                    raise RuntimeError(f"redis bench: promotion not started: {answers}")
            promotion = events.wait() - t0
            if not all(a == LookupResult.HIT for a in session.lookup(keys)):
                raise RuntimeError("redis bench: a promoted key does not answer HIT")
            out["promotion"] = min(out.get("promotion", promotion), promotion)
            _release(session, keys)
            between(r)
        stats = _tier_stats(client)
        if stats.promotion_failures or stats.checksum_failures:
            raise RuntimeError(f"redis bench: promotions failed: {stats}")
        events.close()
        region.close()
        session.close()
        client.close()
    return out, keys


def remote_lookups(config: str, keys: list[bytes]) -> dict[str, list[float]]:
    """A fresh daemon on the same server and prefix: per key, the first Lookup's RPC
    seconds, the seconds from the first Lookup until one answers other than MISS (the
    probe's EXISTS came back and the promotion started) and until one answers HIT. Just
    before each first Lookup, the floor: a Lookup of an unknown key on a primary-only
    daemon running alongside (so drift falls on both alike)."""
    out: dict[str, list[float]] = {
        "first": [], "probed": [], "hit": [], "primary": [], "exists": [], "waited": []
    }  # fmt: skip
    with (
        BenchDaemon("--config", config, "--memory-budget", "1GiB") as daemon,
        BenchDaemon("--memory-budget", "1GiB") as plain,
    ):
        client, plain_client = Client(daemon.address), Client(plain.address)
        session = client.open_session(POOL, block_bytes=BLOCK, num_blocks=BLOCKS)
        plain_session = plain_client.open_session(POOL, block_bytes=BLOCK, num_blocks=BLOCKS)
        _wait(lambda: _tier_stats(client).ready, "the redis tier")
        for key in _keys("warm-up", 20):  # first calls of each channel, not timed
            session.lookup([key])
            plain_session.lookup([key])
        time.sleep(0.1)  # the warm-up's probes back
        raw = redis.Redis.from_url(_server_url(config))
        for i, key in enumerate(keys[:REMOTE_KEYS]):
            time.sleep(IDLE_S)
            t0 = time.perf_counter()
            raw.exists(b"kvtb-floor")
            out["exists"].append(time.perf_counter() - t0)
            time.sleep(IDLE_S)  # both timed calls come after the same idle pause
            t0 = time.perf_counter()
            plain_session.lookup(_keys(f"primary-only-{i}", 1))
            out["primary"].append(time.perf_counter() - t0)
            time.sleep(IDLE_S)
            t0 = time.perf_counter()
            answer = session.lookup([key])[0]
            out["first"].append(time.perf_counter() - t0)
            if answer not in (LookupResult.MISS, LookupResult.HIT_PENDING):
                raise RuntimeError(f"redis bench: first Lookup of an unknown key answered {answer}")
            out["waited"].append(float(answer == LookupResult.HIT_PENDING))
            probed = answer == LookupResult.HIT_PENDING
            if probed:
                out["probed"].append(time.perf_counter() - t0)
            while answer != LookupResult.HIT:
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError(f"redis bench: {key!r} never answered HIT ({answer})")
                time.sleep(POLL_S)
                answer = session.lookup([key])[0]
                if not probed and answer != LookupResult.MISS:
                    probed = True
                    out["probed"].append(time.perf_counter() - t0)
            out["hit"].append(time.perf_counter() - t0)
            _release(session, [key])
        for closing in (session, plain_session, client, plain_client, raw):
            closing.close()
    return out


def fleet_ab(server: _Server, work: str) -> tuple[dict[str, float], dict[str, float]]:
    """The tier's passes with the fleet's LRU kept (a bound far above the bytes: every
    admission and touch, no eviction) and without, in the order with, without,
    without, with, the server emptied before each: the best of each."""
    best: dict[str, dict[str, float]] = {"fleet": {}, "plain": {}}
    configs = {
        "fleet": _config(work, server.url, "kvtb-fleet", FLEET_BOUND),
        "plain": _config(work, server.url, "kvtb-plain"),
    }
    for which in ("fleet", "plain", "plain", "fleet"):
        with redis.Redis(port=server.port) as admin:
            admin.flushall()
        seconds, _ = tier_run(configs[which], lambda r: None)
        for phase, value in seconds.items():
            best[which][phase] = min(best[which].get(phase, value), value)
    return best["fleet"], best["plain"]


def _server_url(config: str) -> str:
    with open(config) as handle:
        text = handle.read()
    return text.split('urls = ["', 1)[1].split('"', 1)[0]


def run() -> list[Row]:
    binary = shutil.which("redis-server")
    if binary is None:
        return [Row(GROUP, "redis-server not installed (`make test-tools`): skipped", 0.0, "")]
    server = _Server(binary)
    work = tempfile.mkdtemp(prefix="kvtb-redis-", dir="/tmp")
    rows: list[Row] = []
    try:
        pattern = np.random.default_rng(0).integers(0, 256, size=VALUE_BYTES, dtype=np.uint8)
        values = []
        for i in range(BLOCKS):
            value = pattern.copy()
            value[HEADER_SIZE : HEADER_SIZE + 8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            values.append(value.tobytes())
        floor: dict[str, tuple[float, str]] = {}  # phase -> (best seconds, which floor)
        glide = _glide()
        glide_best: dict[str, tuple[float, str]] = {}

        def floors(r: int) -> None:  # one round of every floor, between two tier passes
            for threads in FLOOR_THREADS:
                plural = "s" if threads > 1 else ""
                for packer in FLOOR_PACKERS:
                    tag = f"{r}-{threads}-{packer}"
                    which = f"x{threads} thread{plural}, {packer} packer"
                    for phase, seconds in floor_pass(server, values, tag, threads, packer).items():
                        floor[phase] = min(floor.get(phase, (seconds, which)), (seconds, which))
                if glide is None:
                    continue
                which = f"x{threads} thread{plural}"
                for phase, seconds in glide_pass(
                    glide, server, values, f"{r}-{threads}", threads
                ).items():
                    glide_best[phase] = min(
                        glide_best.get(phase, (seconds, which)), (seconds, which)
                    )

        config = _config(work, server.url, "kvtb")
        tier, keys = tier_run(config, floors)
        remote = remote_lookups(config, keys)
        fleet, plain = fleet_ab(server, work)
        first, until_hit, primary = remote["first"], remote["hit"], remote["primary"]

        payload = BLOCKS * BLOCK  # GB/s of rows; both move the same values (header + row)
        names = {"store": ("cascade (store)", "redis-py SET"),
                 "promotion": ("promotion", "redis-py GET")}  # fmt: skip
        for phase, (name, floor_name) in names.items():
            floor_s, which = floor[phase]
            gbs, floor_gbs = _gbs(payload, tier[phase]), _gbs(payload, floor_s)
            rows.append(Row(GROUP, f"{name}, {BLOCKS} blocks, {THREADS} threads", gbs, "GB/s",
                            f"{floor_name} {which} {floor_gbs:.2f} GB/s",
                            gbs / floor_gbs, TARGET))  # fmt: skip
        for phase, (name, _) in names.items():
            gbs, plain_gbs = _gbs(payload, fleet[phase]), _gbs(payload, plain[phase])
            rows.append(Row(GROUP, f"{name} with fleet_capacity (its LRU index kept)", gbs,
                            "GB/s", f"without, same server {plain_gbs:.2f} GB/s",
                            gbs / plain_gbs, ">= 0.95x"))  # fmt: skip
        cgroup = "client library (2 MiB values, same server)"
        if glide is None:
            rows.append(Row(cgroup, "valkey-glide-sync not installed: skipped", 0.0, ""))
        for phase, command in (("store", "SET"), ("promotion", "GET")):
            if glide is None:
                break
            seconds, which = glide_best[phase]
            floor_s, floor_which = floor[phase]
            gbs, floor_gbs = _gbs(payload, seconds), _gbs(payload, floor_s)
            rows.append(Row(cgroup, f"valkey-glide-sync {command}, {which}", gbs, "GB/s",
                            f"redis-py {command} {floor_which} {floor_gbs:.2f} GB/s",
                            gbs / floor_gbs, ""))  # fmt: skip
        lgroup = "redis tier, Lookup reaching the remote tier"
        p50_first, p50_primary = percentile(first, 0.5), percentile(primary, 0.5)
        p50_exists = percentile(remote["exists"], 0.5)
        rows.append(Row(lgroup, "first Lookup of a key only redis holds (asks it), RPC p50",
                        p50_first * 1e6, "us",
                        f"primary-only Lookup p50 {p50_primary * 1e6:.0f} us",
                        p50_first / p50_primary, ""))  # fmt: skip
        rows.append(Row(lgroup, "... what asking the server added, p50", (p50_first - p50_primary)
                        * 1e6, "us", f"redis-py EXISTS round trip p50 {p50_exists * 1e6:.0f} us",
                        (p50_first - p50_primary) / p50_exists, ""))  # fmt: skip
        rows.append(Row(lgroup, "first Lookup, RPC p99", percentile(first, 0.99) * 1e6, "us"))
        rows.append(Row(lgroup, "first Lookups answered HIT_PENDING (within the wait)",
                        100 * sum(remote["waited"]) / len(remote["waited"]), "%"))  # fmt: skip
        rows.append(Row(lgroup, f"first Lookup until one answers HIT, p50 ({REMOTE_KEYS} keys, "
                        f"1 at a time, polled every {POLL_S * 1e3:g} ms)",
                        percentile(until_hit, 0.5) * 1e3, "ms"))  # fmt: skip
        rows.append(Row(lgroup, "first Lookup until HIT, max", max(until_hit) * 1e3, "ms"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.close()
    return rows


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run())
