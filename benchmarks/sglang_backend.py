"""The SGLang backend's data path: ``batch_set_v1`` / ``batch_get_v1`` against a plain copy.

``make bench-sglang`` (``python -m benchmarks.sglang_backend`` in ``.venv-sglang``):
a real daemon, a real ``MHATokenToKVPoolHost`` (``page_first``, bf16, 32 layers of 8
heads of 128 for the 2 and 8 MiB pages, Llama-8B's geometry at 16 and 64 tokens per
page; 4 layers of 2 heads for 64 KiB) and the backend from SGLang's factory. Per
page size, in alternating rounds:

* *floor*: ``numpy.copyto`` of the batch's host pages (a contiguous run of the
  host pool's K and V buffers) into a pre-faulted host buffer of the same size, one
  memcpy per page as the copy engine does: what moving those bytes costs with no
  daemon, no pool rows and no layout work;
* ``batch_set_v1`` of a batch of new keys (PrepareStore, the copy into the pool's
  rows, CompleteStore queued), the pool sized so that stores evict;
* ``batch_get_v1`` of those keys into other host pages (pinning Lookup, the copy,
  CompleteLoad queued).

With ``--ab`` every round also runs ``batch_set_v1`` / ``batch_get_v1`` with the copy
engine's previous CPU copy (torch ``copy_`` / ``index_select``, before the numpy path),
alternating which goes first: the before/after of docs/benchmarks/history.md
("SGLang backend").

Reported: the median round's pages/s and GB/s, the ratio to the floor's median
(target >= 0.8x at 2 MiB), and the daemon round trips per batch (the backend's
sessions' calls): for a batch alone (its queued completion then goes alone after
5 ms: 2) and for 8 batches back to back (the completion rides on the next batch's
call: 1 per batch, plus the last one's). SGLang batches 128 pages; the 8 MiB rows
use 32-page batches (128 x 8 MiB would need 2 GiB of host pool per side).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks import sglang_env as env
from benchmarks.common import BenchDaemon, Row, machine, print_table
from kvtierd_client._shm import copies

ROUNDS = 7


@dataclass(frozen=True)
class Size:
    label: str
    layers: int
    heads: int
    tokens: int
    batch: int

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * 128 * 2


SIZES = (
    Size("64 KiB", layers=4, heads=2, tokens=16, batch=128),
    Size("2 MiB", layers=32, heads=8, tokens=16, batch=128),
    Size("8 MiB", layers=32, heads=8, tokens=64, batch=32),
)


def _median_seconds(samples: list[float]) -> float:
    return statistics.median(samples)


_NUMPY_COPY = copies.copy_cpu


def _torch_copy(src, dst, plan, staging, src_np=None, dst_np=None):  # noqa: ANN001, ANN202
    """The copy engine's CPU copy as it was before its numpy path (the A/B's "before")."""
    return _NUMPY_COPY(src, dst, plan, staging)


def measure(address: str, size: Size, rounds: int, ab: bool = False) -> list[Row]:
    """The rows of one page size (see the module doc)."""
    batch = size.batch
    pool = env.mha_host_pool(
        "page_first", layers=size.layers, heads=size.heads, head_dim=128, page_size=size.tokens,
        device_tokens=size.tokens, host_tokens=2 * batch * size.tokens,
    )  # fmt: skip
    config = env.storage_config(
        address, model=f"bench/{size.label}", kvtierd_pool_bytes=2 * batch * size.page_bytes
    )
    backend = env.create_backend(config, pool)
    src_pages, dst_pages = list(range(batch)), list(range(batch, 2 * batch))
    env.fill_pages(pool, src_pages[:4], seed=1)  # the rest is zeros, faulted in by SGLang
    src, dst = env.token_slots(pool, src_pages), env.token_slots(pool, dst_pages)
    page_elems = size.page_bytes // 2 // 8  # one K (or V) page as int64
    floor_src = pool.kv_buffer.view(torch.int64).view(2, -1, page_elems)[:, :batch].numpy()
    floor_dst = np.zeros((2, batch, page_elems), dtype=np.int64)
    times: dict[str, list[float]] = {
        "floor": [], "set": [], "get": [], "set before": [], "get before": []
    }  # fmt: skip
    trips: dict[str, float] = {"set": 0, "get": 0}
    for r in range(rounds + 1):  # round 0 warms up (first faults, engines)
        start = time.perf_counter()
        for page in range(batch):
            np.copyto(floor_dst[:, page], floor_src[:, page])
        floor = time.perf_counter() - start
        variants = [("", _NUMPY_COPY), (" before", _torch_copy)] if ab else [("", _NUMPY_COPY)]
        if r % 2:
            variants.reverse()
        for suffix, copy in variants:
            copies.copy_cpu = copy  # type: ignore[assignment]
            keys = env.page_keys(f"bench-{size.label}-{r}{suffix}", batch)
            set_s, set_trips, ok_set = _timed(backend, backend.batch_set_v1, keys, src)
            get_s, get_trips, ok_get = _timed(backend, backend.batch_get_v1, keys, dst)
            copies.copy_cpu = _NUMPY_COPY  # type: ignore[assignment]
            if not (all(ok_set) and all(ok_get)):
                raise RuntimeError(f"{size.label}: a batch failed (set {ok_set}, get {ok_get})")
            if r:
                times["set" + suffix].append(set_s)
                times["get" + suffix].append(get_s)
                if not suffix:
                    trips["set"] += set_trips
                    trips["get"] += get_trips
        if r:
            times["floor"].append(floor)
    if env.page_bytes(pool, dst_pages[3]) != env.page_bytes(pool, src_pages[3]):
        raise RuntimeError(f"{size.label}: a loaded page differs from the stored one")
    trips = {op: n / rounds for op, n in trips.items()}
    trips.update(_back_to_back(backend, size, src, dst))
    backend.close()
    return _rows(size, times, trips)


def _timed(backend: object, call: object, keys: list[str], slots: torch.Tensor) -> tuple:
    """(seconds, round trips, answers) of one batch alone: its queued completion goes
    within 5 ms (by itself, no call follows) before the round trips are counted."""
    stats = env.unwrap(backend).statistics
    before = stats().round_trips
    start = time.perf_counter()
    ok = call(keys, slots)  # type: ignore[operator]
    elapsed = time.perf_counter() - start
    time.sleep(0.02)
    return elapsed, stats().round_trips - before, ok


def _back_to_back(backend: object, size: Size, src: torch.Tensor, dst: torch.Tensor) -> dict:
    """Round trips per batch of 8 stores, then 8 loads, back to back."""
    stats = env.unwrap(backend).statistics
    out = {}
    keys = [env.page_keys(f"b2b-{size.label}-{i}", size.batch) for i in range(8)]
    for op, call, slots in (("set", backend.batch_set_v1, src), ("get", backend.batch_get_v1, dst)):  # type: ignore[attr-defined]
        before = stats().round_trips
        for batch in keys:
            call(batch, slots)
        time.sleep(0.02)
        out[f"{op} back to back"] = (stats().round_trips - before) / len(keys)
    return out


def _rows(size: Size, times: dict[str, list[float]], trips: dict[str, float]) -> list[Row]:
    nbytes = size.batch * size.page_bytes
    floor_gbs = nbytes / _median_seconds(times["floor"]) / 1e9
    group = f"sglang {size.label} x{size.batch}"
    rows = [Row(group, "floor: numpy.copyto host -> host", floor_gbs, "GB/s")]
    for op, name in (("set", "batch_set_v1"), ("get", "batch_get_v1")):
        seconds = _median_seconds(times[op])
        gbs = nbytes / seconds / 1e9
        target = ">= 0.8x" if size.label == "2 MiB" else ""
        rows.append(Row(group, f"{name} GB/s", gbs, "GB/s", f"{floor_gbs:.2f} GB/s",
                        gbs / floor_gbs, target))  # fmt: skip
        rows.append(Row(group, f"{name} pages/s", size.batch / seconds, "pages/s"))
        if times[f"{op} before"]:
            before = nbytes / _median_seconds(times[f"{op} before"]) / 1e9
            rows.append(Row(group, f"{name} GB/s, torch copy (before)", before, "GB/s",
                            f"{floor_gbs:.2f} GB/s", before / floor_gbs))  # fmt: skip
        rows.append(Row(group, f"{name} round trips, alone", trips[op], "per batch"))
        rows.append(Row(group, f"{name} round trips, 8 back to back",
                        trips[f"{op} back to back"], "per batch"))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--ab", action="store_true", help="also the copy engine's torch copy")
    parser.add_argument("--sizes", default=",".join(s.label for s in SIZES),
                        help="page sizes, of: " + ", ".join(s.label for s in SIZES))  # fmt: skip
    args = parser.parse_args()
    wanted = {label.strip() for label in args.sizes.split(",")}
    print(f"# SGLang backend data path; {machine()}; torch threads {torch.get_num_threads()}")
    rows: list[Row] = []
    with BenchDaemon("--memory-budget", "2GiB") as daemon:
        for size in SIZES:
            if size.label in wanted:
                rows += measure(daemon.address, size, args.rounds, args.ab)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
