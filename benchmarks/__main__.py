"""`make bench`: every benchmark of the project in one table, with the floors of the same run."""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import (
    admission,
    authz,
    bounds,
    buffers,
    copy,
    fastlane,
    fs,
    integrity,
    kv_events,
    memory,
    metrics_flood,
    redis,
    replay,
    rpc,
    stall,
    tls,
    warm,
)
from benchmarks.common import machine, print_table

SUITES = {"rpc": rpc.run, "copy": copy.run, "memory": memory.run, "replay": replay.run,
          "fs": fs.run, "stall": stall.run, "buffers": buffers.run,
          "tls": tls.run, "authz": authz.run, "redis": redis.run,
          "warm": warm.run, "fastlane": fastlane.run, "integrity": integrity.run,
          "bounds": bounds.run, "metrics-flood": metrics_flood.run,
          "kv-events": kv_events.run, "admission": admission.run}  # fmt: skip


def main() -> int:
    if sys.argv[1:2] == ["admission"]:  # its own table and options (--trace, --json, ...)
        return admission.main(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("suites", nargs="*", help=f"suites to run: {', '.join(SUITES)} (all)")
    parser.add_argument(
        "--out", default="bench-results/latest.md", help="also write the table here"
    )
    args = parser.parse_args()
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}")
    rows = []
    started = time.time()
    for name in args.suites or SUITES:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows.extend(SUITES[name]())
    print(f"\nmachine: {machine()}; {time.time() - started:.0f}s\n")
    text = print_table(rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(f"machine: {machine()}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
