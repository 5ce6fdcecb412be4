"""`make bench-routing` end to end on a short replay (`make test-dynamo`: the real indexer).

Scenario: an operator runs the routing benchmark to see what a KV-aware router gains from
kvtierd's events. On the first 80 requests of the shipped trace, with every part real (3
daemons publishing ``[kv_events]``, a 3-master Redis Cluster, Dynamo's standalone indexer,
the client library), the run must write issue #42's JSON shape, find every loaded block's
bytes right, and the indexer's view must match what the engines could load.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime: make install-dynamo")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server not installed (make test-tools)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
POLICIES = {"round_robin", "conversation", "kv_aware"}


def test_short_replay_writes_the_issue_shape_and_a_true_view(tmp_path: Path) -> None:
    out, table = tmp_path / "routing.json", tmp_path / "routing.md"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "routing", "--requests", "80", "--sample-every",
         "1", "--json", str(out), "--out", str(table)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"policies", "view", "indexer", "wrong_bytes"}
    assert set(data["policies"]) == POLICIES
    for name, policy in data["policies"].items():
        assert set(policy) == {"hit_rate", "hit_rate_by_tier", "load_max_over_mean"}, name
        tiers = policy["hit_rate_by_tier"]
        assert set(tiers) == {"gpu", "cpu", "storage"}
        assert policy["hit_rate"] == pytest.approx(sum(tiers.values()), abs=1e-5)
        assert policy["load_max_over_mean"] >= 1.0
    assert data["indexer"].startswith("dynamo.indexer ")
    assert data["wrong_bytes"] == 0
    assert data["view"]["precision"] >= 0.99, table.read_text()
    assert data["view"]["recall"] >= 0.95, table.read_text()
    text = table.read_text()
    assert "daemons' events on" in text
    # the view judged real holdings: requests 49, 58, 61 and 74 reuse earlier prefixes
    judged = re.findall(
        r"all precision [\d.]+ recall [\d.]+ \(([\d,]+) claimed, ([\d,]+) true", text
    )
    assert len(judged) == 3, text
    assert all(int(true.replace(",", "")) > 0 for _claimed, true in judged), text
