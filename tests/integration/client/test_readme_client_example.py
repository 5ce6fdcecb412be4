"""The README's "client in ten lines" runs as written (issue #31, item 2).

Scenario: the fenced block after ``<!-- example: client -->`` in README.md is run, byte for
byte, by a fresh Python process whose only link to the daemon is ``$KVTIERD_ADDRESS`` (the
example calls ``Client()``), with torch made unimportable. It must print the block's own
promise (``HIT [7 7 7 7]``), exit 0, and leave no session behind: the daemon logs the
session closed by its client, not expired, and holds no session afterwards. Run twice: a
second run against the same pool (the key is a HIT already) works too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import REPO, DaemonProcess

from kvtierd_client.client import Client

EXAMPLE = re.compile(r"<!-- example: client -->\n```python\n(.*?)```", re.DOTALL)
NO_TORCH = "import sys; sys.modules['torch'] = None  # any import of torch fails\n"


def readme_example() -> str:
    found = EXAMPLE.search((REPO / "README.md").read_text())
    assert found, "README.md has no <!-- example: client --> block"
    return found.group(1)


def run_example(daemon: DaemonProcess, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "example.py"
    script.write_text(NO_TORCH + readme_example())
    env = {**os.environ, "KVTIERD_ADDRESS": daemon.address}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_example_is_ten_lines_of_code_without_torch() -> None:
    code = [line for line in readme_example().splitlines() if line.strip()]
    assert len(code) <= 10, f"{len(code)} lines:\n" + "\n".join(code)
    assert "torch" not in readme_example()
    assert ".numpy()" in readme_example()  # rows written and read as numpy arrays


@pytest.mark.parametrize("run", [1, 2])
def test_the_readme_client_example_runs_and_closes_its_session(
    daemon: DaemonProcess, tmp_path: Path, run: int
) -> None:
    done = run_example(daemon, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "HIT [7 7 7 7]", done.stdout + done.stderr
    log = daemon.log()
    closed = re.findall(r"session (\w+) \('', pool demo\) closed by client", log)
    assert len(closed) >= run, log[-3000:]
    assert not re.search(rf"session {closed[-1]} .*lease expired", log)
    with Client(daemon.address) as client:
        (pool,) = client.get_stats("demo").pools
    assert pool.sessions == 0, pool
