"""Keyed integrity of shared tiers: the keyed hashes, and what a MAC costs the tiers.

Three parts, one run (``python -m benchmarks integrity``):

* **hashes**: one core hashing one block of 64 KiB and of 2 MiB (random bytes), best
  of ROUNDS, every candidate in each round in turn: today's xxh3-64 (the unkeyed
  checksum), BLAKE3 keyed (``blake3``, what the tiers use), HMAC-SHA256 (OpenSSL
  through ``hmac``; the CPU's SHA extensions are named in the row when it has them)
  and BLAKE2b keyed (``hashlib``).
* **per block**: the tiers' own functions on one block -- the store path's
  header (:func:`~kvtierd.tiers.blockformat.block_header`: xxh3, plus the MAC with a
  key) and the promotion path's check (``decode_header`` + ``check_payload``:
  xxh3 without a key, the MAC with one) -- unkeyed and keyed side by side.
* **through a daemon** (2 MiB blocks): the redis tier's cascade and promotion
  (:func:`benchmarks.redis.tier_run`: a real redis-server, 128 blocks a pass) and the
  fs tier's cascade and warm promotion (:func:`benchmarks.fs.tier_run`, on
  ``$KVTIERD_BENCH_FS_ROOT`` or /var/tmp; skipped on tmpfs), each run with and without
  ``integrity_key_file``, alternating (unkeyed, keyed, unkeyed, keyed: a busy spell of
  a shared machine falls on both), best of all passes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import blake3
import xxhash

from benchmarks import fs as fs_bench
from benchmarks import redis as redis_bench
from benchmarks.common import Row
from kvtierd.tiers import blockformat
from kvtierd.tiers.integrity import IntegrityKey, KeyRing

SIZES = (64 << 10, 2 << 20)
ROUNDS = 7
TIER_ROUNDS = 2  # unkeyed/keyed pairs of daemon runs
GROUP = "keyed integrity"
FINGERPRINT = b"\x01" * blockformat.FINGERPRINT_BYTES


def sha_extensions() -> bool:
    try:
        with open("/proc/cpuinfo") as handle:
            return any(line.startswith("flags") and " sha_ni" in line for line in handle)
    except OSError:
        return False


def _best_us(calls: dict[str, Callable[[], object]], size: int) -> dict[str, float]:
    """Best microseconds per call of each, ROUNDS rounds, the candidates in turn."""
    repeat = max(4, (64 << 20) // size // 4)
    best: dict[str, float] = {}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(repeat):
                call()
            seconds = (time.perf_counter() - started) / repeat
            best[name] = min(best.get(name, seconds), seconds)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def hash_rows() -> list[Row]:
    secret = os.urandom(32)
    rows = []
    sha = "with SHA extensions" if sha_extensions() else "no SHA extensions"
    for size in SIZES:
        data = os.urandom(size)
        times = _best_us(
            {
                "xxh3-64 (unkeyed, today's)": lambda d=data: xxhash.xxh3_64_intdigest(d),
                "BLAKE3 keyed (blake3)": lambda d=data: blake3.blake3(
                    d, key=secret, max_threads=1
                ).digest(),
                f"HMAC-SHA256 (OpenSSL, {sha})": lambda d=data: hmac.new(
                    secret, d, hashlib.sha256
                ).digest(),
                "BLAKE2b keyed (hashlib)": lambda d=data: hashlib.blake2b(
                    d, key=secret, digest_size=32
                ).digest(),
            },
            size,
        )
        xxh3 = times["xxh3-64 (unkeyed, today's)"]
        for name, us in times.items():
            rows.append(Row(f"{GROUP}: one {_size(size)} block, one core", name,
                            size / us / 1e3, "GB/s", f"{us:.1f} us a block; xxh3 {xxh3:.1f} us",
                            us / xxh3))  # fmt: skip
    return rows


def path_rows() -> list[Row]:
    """The tiers' own header and check functions, unkeyed and keyed."""
    own = IntegrityKey.of(os.urandom(32))
    keys = KeyRing(own, (own,))
    rows = []
    for size in SIZES:
        times = _best_us(_path_calls(memoryview(bytearray(os.urandom(size))), keys), size)
        group = f"{GROUP}: the tiers' functions, one {_size(size)} block"
        for path in ("store: header", "promotion: check"):
            unkeyed, keyed = times[f"{path}, unkeyed"], times[f"{path}, keyed"]
            rows.append(Row(group, f"{path}, keyed", keyed, "us", f"unkeyed {unkeyed:.1f} us",
                            keyed / unkeyed))  # fmt: skip
    return rows


def _path_calls(payload: memoryview, keys: KeyRing) -> dict[str, Callable[[], object]]:
    def header(ring: KeyRing | None) -> bytes:
        return blockformat.block_header(
            key=b"k", fingerprint=FINGERPRINT, payload=payload, keys=ring
        )

    plain, sealed = header(None), header(keys)

    def check(head: bytes, ring: KeyRing | None) -> None:
        blockformat.check_payload(head, blockformat.decode_header(head), payload, ring)

    return {
        "store: header, unkeyed": lambda: header(None),
        "store: header, keyed": lambda: header(keys),
        "promotion: check, unkeyed": lambda: check(plain, None),
        "promotion: check, keyed": lambda: check(sealed, keys),
    }


def tier_rows() -> list[Row]:
    work = tempfile.mkdtemp(prefix="kvtb-integrity-", dir="/tmp")
    key = os.path.join(work, "integrity.key")
    with open(key, "wb") as handle:
        handle.write(os.urandom(32))
    os.chmod(key, 0o600)
    rows: list[Row] = []
    try:
        rows += _redis_rows(work, key)
        rows += _fs_rows(key)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _redis_rows(work: str, key: str) -> list[Row]:
    binary = shutil.which("redis-server")
    group = f"{GROUP}: redis tier, {redis_bench.BLOCKS} x 2 MiB"
    if binary is None:
        return [Row(group, "redis-server not installed (`make test-tools`): skipped", 0.0, "")]
    server = redis_bench._Server(binary)
    best: dict[str, dict[str, float]] = {"unkeyed": {}, "keyed": {}}
    try:
        for r in range(TIER_ROUNDS):
            for kind in best:
                config = redis_bench._config(work, server.url, f"kvtb-{kind}-{r}")
                if kind == "keyed":
                    with open(config, "a") as handle:
                        handle.write(f'integrity_key_file = "{key}"\n')
                seconds, _ = redis_bench.tier_run(config, lambda _r: None)
                fs_bench.keep_best(best[kind], seconds)
                with redis_bench.redis.Redis(port=server.port) as client:
                    client.flushall()
    finally:
        server.close()
    return _ab_rows(group, best, redis_bench.BLOCKS * redis_bench.BLOCK,
                    {"store": "cascade (store)", "promotion": "promotion"})  # fmt: skip


def _fs_rows(key: str) -> list[Row]:
    parent = os.environ.get("KVTIERD_BENCH_FS_ROOT", "/var/tmp")
    kind = fs_bench.fs_type(parent)
    group = f"{GROUP}: fs tier, {kind}, {fs_bench.BLOCKS} x 2 MiB, I/O worker processes"
    if kind in fs_bench.NOT_DISK:
        return [Row(group, f"skipped: {parent} is {kind}, not a disk", 0.0, "")]
    base = tempfile.mkdtemp(prefix="kvtierd-bench-integrity-", dir=parent)
    best: dict[str, dict[str, float]] = {"unkeyed": {}, "keyed": {}}
    try:
        for r in range(TIER_ROUNDS):
            for kind_ in best:
                root = os.path.join(base, f"{kind_}-{r}")
                os.makedirs(root)
                extra = f'integrity_key_file = "{key}"\n' if kind_ == "keyed" else ""
                seconds = fs_bench.tier_run(root, "off", False, extra=extra)
                fs_bench.keep_best(best[kind_], seconds)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _ab_rows(group, best, fs_bench.BLOCKS * fs_bench.BLOCK,
                    {"store": "cascade (store)", "warm": "promotion, page cache"})  # fmt: skip


def _ab_rows(
    group: str, best: dict[str, dict[str, float]], nbytes: int, phases: dict[str, str]
) -> list[Row]:
    rows = []
    for phase, name in phases.items():
        keyed = nbytes / best["keyed"][phase] / 1e9
        unkeyed = nbytes / best["unkeyed"][phase] / 1e9
        rows.append(Row(group, f"{name}, keyed (BLAKE3 MAC)", keyed, "GB/s",
                        f"unkeyed (xxh3) {unkeyed:.2f} GB/s", keyed / unkeyed))  # fmt: skip
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def run() -> list[Row]:
    return hash_rows() + path_rows() + tier_rows()


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run())
