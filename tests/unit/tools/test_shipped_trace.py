"""The replay benchmarks run in a fresh clone with no arguments (issue #16 item 5).

Scenario: a new user runs `make replay` or `make bench-vllm` without TRACE=. Both commands
default to a trace that must be shipped inside the repository (tracked by git, so a clone
has it) and must parse: `benchmarks.replay` with 2,000 requests, `benchmarks.vllm_managers`
with as many prefix chains. A trace that is not there gets exit 2 and a message naming
the ways to give one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import replay, vllm_managers  # noqa: E402

SHIPPED_REQUESTS = 2000


@pytest.fixture(autouse=True)
def _no_trace_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults as a fresh shell sees them."""
    monkeypatch.delenv(replay.DEFAULT_TRACE_ENV, raising=False)


def assert_shipped(path: Path) -> None:
    """``path`` is a regular file inside this checkout that git tracks (a clone has it)."""
    resolved = path.resolve()
    assert resolved.is_relative_to(REPO), f"{resolved} is outside the repository {REPO}"
    assert resolved.is_file(), f"{resolved} is missing"
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        return  # not a git checkout: inside the tree is all that can be checked
    tracked = subprocess.run(
        [git, "-C", str(REPO), "ls-files", "--error-unmatch", str(resolved.relative_to(REPO))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert tracked.returncode == 0, f"{resolved} is not tracked by git: {tracked.stderr}"


def test_replay_defaults_to_the_shipped_trace_and_it_parses() -> None:
    trace = Path(replay.build_parser().parse_args([]).trace)
    assert trace == replay.SHIPPED_TRACE
    assert_shipped(trace)
    requests = replay.load_trace(trace)
    assert len(requests) == SHIPPED_REQUESTS
    assert all(request.hash_ids for request in requests)
    assert replay.distinct_blocks(requests) > SHIPPED_REQUESTS  # prefixes to share, and more


def test_vllm_managers_defaults_to_the_shipped_trace_and_it_parses() -> None:
    trace = vllm_managers.build_parser().parse_args([]).trace
    assert trace == replay.SHIPPED_TRACE
    assert_shipped(trace)
    chains = vllm_managers.load_chains(trace, SHIPPED_REQUESTS + 1)
    assert len(chains) == SHIPPED_REQUESTS
    assert all(chains)


def test_the_environment_variable_names_another_trace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text('{"hash_ids": [1, 2]}\n')
    monkeypatch.setenv(replay.DEFAULT_TRACE_ENV, str(other))
    assert Path(replay.build_parser().parse_args([]).trace) == other
    assert vllm_managers.build_parser().parse_args([]).trace == other


@pytest.mark.parametrize("main", [replay.main, vllm_managers.main], ids=["replay", "managers"])
def test_a_missing_trace_is_exit_2_naming_how_to_give_one(
    main: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit) as exited:
        main([str(missing)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err
    assert "TRACE=" in err and replay.DEFAULT_TRACE_ENV in err
