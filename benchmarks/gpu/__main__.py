"""`make gpu-check` / `python -m benchmarks.gpu`: the GPU path checked and measured (issue #22).

Prints each section's table as it finishes and rewrites the markdown file after
each one. Exit status 1 when a section failed (wrong bytes, a failing test, an
error), 2 for bad arguments, else 0. See :mod:`benchmarks.gpu` for the sections.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

from benchmarks.common import format_table
from benchmarks.gpu import bandwidth, candidates, correctness, environment, registration, suites
from benchmarks.gpu.report import CheckFailed, Report, SectionResult

SECTIONS = ("environment", "correctness", "cuda-tests", "bandwidth", "candidates", "register", "fs")
DEFAULT_SHM_DIR = "/dev/shm"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = environment.cuda_device() is not None
    report = Report(
        args.out,
        header=[
            "# kvtierd GPU check (issue #22)",
            "",
            f"Command: `python -m benchmarks.gpu {' '.join(argv or sys.argv[1:])}`".rstrip(),
            f"Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            "",
            *[f"- {fact}" for fact in environment.describe(args.shm_dir)],
        ],
    )
    print("\n".join(report.header), flush=True)
    runners: dict[str, Callable[[], SectionResult]] = {
        "environment": lambda: SectionResult("environment"),
        "correctness": lambda: correctness.run(quick=args.quick),
        "cuda-tests": lambda: suites.cuda_tests(cuda),
        "bandwidth": lambda: bandwidth.run(args.shm_dir, quick=args.quick),
        "candidates": lambda: candidates.run(args.shm_dir),
        "register": lambda: registration.run(args.shm_dir, tuple(args.register_gib)),
        "fs": lambda: suites.fs_tier(args.fs_root, args.fs_compare, args.fs_rounds),
    }
    for name in args.sections:
        print(f"\n## {name}", file=sys.stderr, flush=True)
        section = _run_isolated(name, runners[name])
        report.add(section)
        if section.rows:
            print(format_table(section.rows), flush=True)
        for note in section.notes:
            print(f"- {note}", flush=True)
        if section.failed:
            print(f"FAILED: {section.error}", flush=True)
    failed = report.failed
    print(
        f"\nwritten to {args.out}; "
        + (
            f"FAILED sections: {', '.join(s.name for s in failed)}"
            if failed
            else "every section ok"
        ),
        flush=True,
    )
    return 1 if failed else 0


def _run_isolated(name: str, runner: Callable[[], SectionResult]) -> SectionResult:
    """The section's result, or a failed one carrying the error, timed: never raises."""
    started = time.perf_counter()
    try:
        section = runner()
    except CheckFailed as failure:
        section = SectionResult(name, error=str(failure))
    except Exception as error:  # a crash of the section is reported, the rest still runs
        traceback.print_exc()
        section = SectionResult(name, error=f"{type(error).__name__}: {error}")
    section.seconds = time.perf_counter() - started
    return section


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description="The GPU path checked and measured: correctness through a real daemon, "
        "the CUDA tests, CopyEngine GB/s against pinned-copy floors, cudaHostRegister costs, "
        "the fs tier on this machine's cores. Without CUDA: the CPU parts only.",
    )
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated sections to run, in this order (default: all): {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--out",
        default="bench-results/gpu.md",
        help="markdown file rewritten after every section (default bench-results/gpu.md)",
    )
    parser.add_argument(
        "--shm-dir",
        default=DEFAULT_SHM_DIR,
        help="tmpfs directory for the regions (default /dev/shm); the 64 GiB registration "
        "needs that much free there",
    )
    parser.add_argument(
        "--register-gib",
        type=_sizes,
        default=list(registration.SIZES_GIB),
        help="region sizes in GiB whose cudaHostRegister is timed (default 4,16,64); "
        "sizes the shm directory cannot hold are reported as not measured",
    )
    parser.add_argument(
        "--fs-root",
        default="/var/tmp",
        help="directory on a real disk for the fs tier benchmark (default /var/tmp; tmpfs "
        "is refused by that benchmark)",
    )
    parser.add_argument(
        "--fs-compare",
        type=_sizes,
        default=[],
        help="also run the fs tier with each of these io_processes settings against the "
        "plain floors, e.g. 2,4,8 (default: not run)",
    )
    parser.add_argument(
        "--fs-rounds", type=int, default=3, help="rounds of --fs-compare (default 3)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a dry run's speed, not figures: bandwidth over 32 MiB per size instead of 1 GiB, "
        "correctness with 24 keys per set read once",
    )
    return parser


def _sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section {unknown[0]!r}; choose from {','.join(SECTIONS)}"
            if unknown
            else "no section named"
        )
    return names


def _sizes(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 4,16,64, got {text!r}") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"sizes must not be negative, got {text!r}")
    return values


if __name__ == "__main__":
    raise SystemExit(main())
