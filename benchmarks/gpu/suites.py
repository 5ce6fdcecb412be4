"""Sections that run what already exists: the CUDA tests of ``make test`` and the fs
tier benchmark, on the GPU machine's cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from benchmarks import fs
from benchmarks.common import Row
from benchmarks.gpu.report import CheckFailed, SectionResult

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the CUDA tests of `make test` (they skip without CUDA) and the no-CUDA one beside them
CUDA_TESTS = ("tests/unit/client/test_copy_engine.py", "tests/unit/primary/test_region.py")
CUDA_TEST_FILTER = "cuda"
EXPECTED_CUDA_TESTS = 3
TESTS_TIMEOUT_S = 300


def cuda_tests(cuda: bool) -> SectionResult:
    """``pytest -k cuda`` over the files that hold the CUDA tests; with CUDA all three
    must pass, without it they must skip (and the no-CUDA check pass)."""
    section = SectionResult("cuda-tests")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-k",
        CUDA_TEST_FILTER,
        *CUDA_TESTS,
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S, check=False
    )
    counts = parse_pytest_counts(done.stdout)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    section.notes.append(f"`{' '.join(command[1:])}`: {summary}")
    section.rows.append(
        Row(
            "cuda tests of make test",
            "passed / skipped / failed",
            counts["passed"],
            "passed",
            f"{counts['skipped']} skipped, {counts['failed']} failed",
            None,
            f"{EXPECTED_CUDA_TESTS} passed" if cuda else "skipped without CUDA",
        )
    )
    if done.returncode != 0 or counts["failed"] or counts["error"]:
        tail = "\n".join(done.stdout.splitlines()[-15:])
        raise CheckFailed(f"pytest exited with {done.returncode}: {tail}")
    if cuda and counts["passed"] < EXPECTED_CUDA_TESTS:
        raise CheckFailed(f"only {counts['passed']} of {EXPECTED_CUDA_TESTS} CUDA tests ran")
    return section


def parse_pytest_counts(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 skipped, 2 deselected in 1.2s")."""
    counts = dict.fromkeys(("passed", "skipped", "failed", "error", "deselected"), 0)
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return counts
    for number, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", lines[-1]):
        counts["error" if word.startswith("error") else word] += int(number)
    return counts


def fs_tier(fs_root: str, compare_io_processes: list[int], rounds: int) -> SectionResult:
    """``python -m benchmarks fs`` under ``fs_root``, then (when asked) the tier with
    each ``io_processes`` setting against the plain floors, round by round."""
    section = SectionResult("fs")
    previous = os.environ.get("KVTIERD_BENCH_FS_ROOT")
    os.environ["KVTIERD_BENCH_FS_ROOT"] = fs_root
    try:
        section.rows += fs.run()
        if compare_io_processes:
            section.rows += fs.compare_io_processes(compare_io_processes, rounds)
    finally:
        if previous is None:
            os.environ.pop("KVTIERD_BENCH_FS_ROOT", None)
        else:
            os.environ["KVTIERD_BENCH_FS_ROOT"] = previous
    section.notes.append(f"fs root {fs_root} ({fs.fs_type(fs_root)}), {os.cpu_count()} cores")
    return section
