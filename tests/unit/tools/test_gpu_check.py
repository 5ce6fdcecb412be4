"""The GPU check (`make gpu-check`, issue #22) as far as it runs without a GPU: its
CPU parts through a real daemon, its verdicts (a wrong byte, a failing section),
and the packing of its run for a device machine with no registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.correctness import SENTINEL, compare_loaded, expected_pages
from benchmarks.gpu.suites import parse_pytest_counts

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))
import gpu_pack  # noqa: E402


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    out = tmp_path / "gpu.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return done, out.read_text() if out.exists() else ""


def loaded_tensors(placements: list[tuple[bytes, int]], blocks: int = 6) -> list[torch.Tensor]:
    """What a correct load leaves: each key's pages at its block, the sentinel elsewhere."""
    layers, page = 3, 4096
    kv = [torch.full((blocks, page), SENTINEL, dtype=torch.int8) for _ in range(layers)]
    for key, block in placements:
        pages = expected_pages(key, layers, page)
        for layer in range(layers):
            kv[layer][block] = pages[layer]
    return kv


def test_a_correct_load_compares_equal():
    placements = [(b"k0", 4), (b"k1", 1)]
    assert compare_loaded(loaded_tensors(placements), placements) == []


def test_a_wrong_byte_and_a_stray_write_are_both_named():
    placements = [(b"k0", 4), (b"k1", 1)]
    kv = loaded_tensors(placements)
    kv[2][1, 100] += 1  # one byte of k1's last layer
    kv[0][3, 0] = 0  # block 3 was not loaded: a copy landed in the wrong block
    differences = compare_loaded(kv, placements)
    assert len(differences) == 2, differences
    assert "b'k1' in engine block 1, layer 2: 1 of 4096 bytes differ" in differences[0]
    assert differences[1].startswith("engine block 3, layer 0: written by a load")


def test_pages_are_a_function_of_the_key_alone():
    assert torch.equal(expected_pages(b"k", 2, 4096), expected_pages(b"k", 2, 4096))
    assert not torch.equal(expected_pages(b"k", 2, 4096), expected_pages(b"j", 2, 4096))


def test_pytest_counts_are_read_from_the_summary_line():
    counts = parse_pytest_counts(
        "...\n1 failed, 3 passed, 2 skipped, 1 error, 5 deselected in 2s\n"
    )
    assert counts == {"passed": 3, "skipped": 2, "failed": 1, "error": 1, "deselected": 5}
    assert parse_pytest_counts("")["passed"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA run")
def test_without_cuda_the_cpu_parts_run_and_pass(tmp_path):
    done, report = run_check(
        tmp_path, "--quick", "--sections", "environment,correctness,cuda-tests,register"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CUDA: not available here" in report
    # the correctness run moved and compared real bytes through a daemon
    assert "5 worker processes, 8 layers x 64 KiB pages on cpu" in report
    assert "| 0 differences" in report or "0 differences" in report
    assert "skipped without CUDA" in report
    assert "no CUDA here: cudaHostRegister is not measured" in report
    assert "FAILED" not in report


def test_a_failing_section_fails_the_run_and_the_others_still_run(tmp_path):
    done, report = run_check(
        tmp_path, "--quick", "--shm-dir", str(tmp_path / "missing"),
        "--sections", "bandwidth,environment",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "**bandwidth**" in report and "FAILED: FileNotFoundError" in report
    assert "**environment**" in report and "): ok" in report
    assert "FAILED sections: bandwidth" in done.stdout


def test_an_unknown_section_is_refused_naming_the_choices(tmp_path):
    done, _ = run_check(tmp_path, "--sections", "correctness,gpu")
    assert done.returncode == 2
    assert "unknown section 'gpu'; choose from environment,correctness" in done.stderr


def test_every_runtime_dependency_is_on_the_device_image_or_carried():
    assert gpu_pack.uncovered("3.12") == []
    # Python 3.10 would need tomli too: the markers are read, not ignored
    assert gpu_pack.uncovered("3.10") == ["tomli"]


def test_a_dependency_left_off_the_carried_list_is_reported(monkeypatch):
    monkeypatch.setattr(gpu_pack, "CARRIED", tuple(n for n in gpu_pack.CARRIED if n != "redis"))
    assert gpu_pack.uncovered("3.12") == ["redis"]


def test_the_device_script_refuses_to_run_without_its_wheels(tmp_path):
    done = subprocess.run(
        ["bash", "tools/gpu_device_run.sh"], cwd=REPO, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "WHEELS": str(tmp_path / "none"), "OUT": str(tmp_path)},
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no wheels in" in done.stderr and "gpu_pack.py" in done.stderr


# what the device image has besides the standard library and the carried wheels: its
# torch, numpy, xxhash, uvloop, prometheus-client and pytest (gpu_pack.DEVICE_HAS), and
# what those bring (pluggy, iniconfig, packaging, ... for pytest; sympy, jinja2, ... for
# torch); a test-only package such as cryptography is not there
_NOT_ON_THE_DEVICE = ("cryptography", "yaml", "valkey_glide_sync", "mypy", "ruff")
_BLOCK_IMPORTS = """
import importlib.abc, sys
class NotOnTheDevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the device image)")
        return None
sys.meta_path.insert(0, NotOnTheDevice())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "-k", "cuda", *{files!r}]))
"""


def test_the_cuda_tests_collect_with_only_what_the_device_machine_has():
    """`make gpu-dry-run` found the CUDA tests unable to start on the device image: every
    conftest imported the redis harness, and that the TLS test CA (cryptography). The
    conftests must import nothing the device image lacks (test-only packages are
    imported where they are used)."""
    from benchmarks.gpu.suites import CUDA_TESTS

    code = _BLOCK_IMPORTS.format(blocked=set(_NOT_ON_THE_DEVICE), files=list(CUDA_TESTS))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "4/" in done.stdout and "tests collected" in done.stdout, done.stdout  # 3 CUDA + 1
