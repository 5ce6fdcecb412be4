"""What a row copy costs when the daemon never touches a region mapping.

``python -m benchmarks.rowcopy``: one 2 MiB-row region in ``/dev/shm`` (a real
:class:`kvtierd.primary.region.Region`, pre-faulted), and per row, best of ROUNDS x
BATCH copies, one thread, next to the floors of the same run:

* the redis tier's store: before, the row was hashed in place (xxh3) and sent
  from the mapping; now :meth:`RegionRows.read` (``preadv`` of the region's
  descriptor) into the bounce buffer, then hashed: the added cost is the copy;
* the promotion: before, ``row[:] = payload`` (a memcpy into the mapping, the
  interpreter lock held); now :meth:`RegionRows.write` (``process_vm_writev``);
  ``pwrite`` on the descriptor (not used: it would grow a truncated file back)
  and ``/proc/self/mem`` (the fallback where seccomp refuses process_vm_writev)
  beside it.

Not part of ``make bench``'s suite list (docs/benchmarks/history.md, "Truncated regions").
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

import xxhash

from benchmarks.common import Row, machine, print_table
from kvtierd.primary import safecopy
from kvtierd.primary.region import Region
from kvtierd.primary.rows import scratch

ROW_BYTES = 2 << 20
ROWS = 32
ROUNDS = 15
BATCH = 20
HEADER = 4096


def _best_us(op: Callable[[int], object]) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for i in range(BATCH):
            op(i % ROWS)
        best = min(best, (time.perf_counter() - start) / BATCH)
    return best * 1e6


def run() -> list[Row]:
    directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    region = Region.create(directory, "rowcopy", ROWS, ROW_BYTES)
    rows = region.safe_rows()
    mapping = region.buffer()
    value = os.urandom(HEADER + ROW_BYTES)
    into = scratch(ROW_BYTES)
    fd = region.fileno()
    base = safecopy.address_of(mapping)

    def hash_in_place(r: int) -> None:
        xxhash.xxh3_64_intdigest(mapping[r * ROW_BYTES : (r + 1) * ROW_BYTES])

    def copy_then_hash(r: int) -> None:
        rows.read(r, into)
        xxhash.xxh3_64_intdigest(into)

    def memcpy_in(r: int) -> None:
        mapping[r * ROW_BYTES : (r + 1) * ROW_BYTES] = memoryview(value)[HEADER:]

    try:
        measured = {
            "store: hash in place (before)": _best_us(hash_in_place),
            "store: preadv copy + hash (now)": _best_us(copy_then_hash),
            "promotion: memcpy into the mapping (before)": _best_us(memcpy_in),
            "promotion: process_vm_writev (now)": _best_us(lambda r: rows.write(r, value, HEADER)),
            "promotion: pwrite on the descriptor (not used)": _best_us(
                lambda r: os.pwrite(fd, memoryview(value)[HEADER:], r * ROW_BYTES)
            ),
            "promotion: /proc/self/mem (seccomp fallback)": _best_us(
                lambda r: safecopy.ProcSelfMem.write(base + r * ROW_BYTES, value, HEADER)
            ),
        }
    finally:
        mapping.release()
        region.close()
        shutil.rmtree(directory, ignore_errors=True)
    store_floor = measured["store: hash in place (before)"]
    promotion_floor = measured["promotion: memcpy into the mapping (before)"]
    out = []
    for name, micros in measured.items():
        floor = store_floor if name.startswith("store") else promotion_floor
        before = f"before: {floor:.0f} us"
        out.append(Row("row copy, 2 MiB row", name, micros, "us", before, micros / floor))
    return out


if __name__ == "__main__":
    table = run()
    print(f"\nmachine: {machine()}\n")
    print_table(table)
