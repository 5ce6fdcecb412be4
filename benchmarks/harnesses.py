"""The tests' harnesses (tests/*.py) for the benchmarks: one place puts tests/ on
``sys.path``, so a benchmark starts Redis nodes and proxies the way the tests do."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))

from redis_harness import TrickleProxy, free_cluster_port  # noqa: E402

__all__ = ["TrickleProxy", "free_cluster_port"]
