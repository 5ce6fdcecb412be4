"""The admission benchmark's pure parts (benchmarks/admission.py): its reuse-heavy trace
is the same at every run and reuse-heavy, its daemon configuration names each tier's
policy, and ``make bench`` runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import admission  # noqa: E402
from benchmarks.replay import SHIPPED_TRACE, load_trace  # noqa: E402
from kvtierd.tiers.fs.settings import parse_fs_settings  # noqa: E402
from kvtierd.tiers.redis.settings import parse_redis_settings  # noqa: E402


def test_the_reuse_heavy_trace_is_deterministic_and_mostly_reused() -> None:
    first, again = admission.reuse_heavy_trace(500), admission.reuse_heavy_trace(500)
    assert first == again and len(first) == 500
    assert admission.reused_fraction(first) > 0.8
    assert admission.reuse_heavy_trace(500, seed=1) != first
    # the shipped trace, for contrast: most distinct blocks are asked for once
    assert admission.reused_fraction(load_trace(SHIPPED_TRACE)) < 0.4


def test_each_turn_extends_its_conversation() -> None:
    """A conversation's turns come in order, each its previous chain plus new blocks."""
    trace = admission.reuse_heavy_trace(300, turns=3, blocks_per_turn=2)
    chains = [request.hash_ids for request in trace]
    for chain in chains:
        if len(chain) > 8 + 2:  # a later turn: its previous turn came before it
            assert any(chain[:-2] == earlier for earlier in chains[: chains.index(chain)])


def test_the_daemon_configuration_gives_both_tiers_the_policy() -> None:
    text = admission._config("/x", 100, "tinylfu", "redis://127.0.0.1:1")
    fs, redis = tomllib.loads(text)["tiers"]
    assert fs["admission"] == redis["admission"] == "tinylfu"
    assert fs["capacity"] == 3 * 100 * admission.TIER_BYTES
    assert redis["capacity"] == 6 * 100 * admission.TIER_BYTES
    strip = {"type", "name"}
    parse_fs_settings({k: v for k, v in fs.items() if k not in strip})
    parse_redis_settings({k: v for k, v in redis.items() if k not in strip})
    assert "admission" not in admission._config("/x", 100, None, None)


def test_make_bench_runs_the_admission_suite() -> None:
    assert bench_main.SUITES["admission"] is admission.run
    assert admission.admission_supported()
