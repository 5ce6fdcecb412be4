"""The repo's vLLM benchmarks pin vLLM's CPU core reservation (issue #16).

Scenario: vLLM's CPU build reserves one more core when any kv_transfer_config is given, so a
run with kvtierd and one without bind their cores differently unless
VLLM_CPU_NUM_OF_RESERVED_CPU is set for both. The benchmarks set it to 1 before vLLM is
imported, and leave a value the user exported alone. No vLLM needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import vllm_managers  # noqa: E402

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def test_vllm_managers_reserves_one_core_unless_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESERVED, raising=False)
    vllm_managers.set_vllm_env()
    assert os.environ[RESERVED] == "1"
    monkeypatch.setenv(RESERVED, "0")
    vllm_managers.set_vllm_env()
    assert os.environ[RESERVED] == "0"


@pytest.mark.parametrize(("exported", "expected"), [(None, "1"), ("0", "0")])
def test_vllm_ttft_reserves_one_core_on_import_unless_exported(
    exported: str | None, expected: str
) -> None:
    """On import, so the value is in place before vLLM reads its environment."""
    env = {k: v for k, v in os.environ.items() if k != RESERVED}
    if exported is not None:
        env[RESERVED] = exported
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    probe = f"import os, benchmarks.vllm_ttft; print(os.environ[{RESERVED!r}])"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == expected
