"""`make bench`: every benchmark of the project in one table, with the floors of the same run.

``python -m benchmarks admission [options]`` and ``python -m benchmarks routing [options]``
run one benchmark alone, with its own options (``--help``); routing runs in `make
install-dynamo`'s venv, which has no torch: the suites are imported only for `make bench`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable

from benchmarks.common import Row, machine, print_table

COMMANDS = {"admission": "benchmarks.admission", "routing": "benchmarks.routing"}
"""Benchmarks with options of their own (their own table, --trace, --json, ...), run alone:
name -> module with ``main(argv)``."""


def suites() -> dict[str, Callable[[], list[Row]]]:
    """The suites of `make bench`, by name (imported here: some need torch)."""
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

    return {"rpc": rpc.run, "copy": copy.run, "memory": memory.run, "replay": replay.run,
            "fs": fs.run, "stall": stall.run, "buffers": buffers.run,
            "tls": tls.run, "authz": authz.run, "redis": redis.run,
            "warm": warm.run, "fastlane": fastlane.run, "integrity": integrity.run,
            "bounds": bounds.run, "metrics-flood": metrics_flood.run,
            "kv-events": kv_events.run, "admission": admission.run}  # fmt: skip


def __getattr__(name: str) -> object:
    """``SUITES``: :func:`suites`, imported when first asked for (PEP 562)."""
    if name == "SUITES":
        return suites()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = importlib.import_module(COMMANDS[sys.argv[1]])
        return int(command.main(sys.argv[2:]))
    available = suites()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suites", nargs="*", help=f"suites to run: {', '.join(available)} (all)")
    parser.add_argument(
        "--out", default="bench-results/latest.md", help="also write the table here"
    )
    args = parser.parse_args()
    unknown = [s for s in args.suites if s not in available]
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; choose from {', '.join(available)}")
    rows = []
    started = time.time()
    for name in args.suites or available:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows.extend(available[name]())
    print(f"\nmachine: {machine()}; {time.time() - started:.0f}s\n")
    text = print_table(rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(f"machine: {machine()}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
