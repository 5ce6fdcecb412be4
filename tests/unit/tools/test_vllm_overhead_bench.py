"""The vLLM overhead benchmark's three servers differ in their connector only (issue #21).

Scenario: kvtierd's cost is measured against a do-nothing spec and no connector, so the
three server command lines must be the same but for ``--kv-transfer-config``, and every
server runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the CPU build binds its cores
differently when a kv_transfer_config is given). No vLLM needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.vllm_overhead import parse_args, server_command  # noqa: E402
from benchmarks.vllm_storm import child_env  # noqa: E402

FLAG = "--kv-transfer-config"


def _split(command: list[str]) -> tuple[list[str], dict | None]:
    if FLAG not in command:
        return command, None
    at = command.index(FLAG)
    return command[:at] + command[at + 2 :], json.loads(command[at + 1])


def test_the_configurations_differ_in_their_connector_only() -> None:
    args = parse_args([])
    commands = {
        config: _split(server_command(args, config, "/m", 8000, "unix:///run/k.sock"))
        for config in ("none", "noop", "kvtierd")
    }
    rest = {config: command for config, (command, _) in commands.items()}
    assert rest["none"] == rest["noop"] == rest["kvtierd"]
    assert commands["none"][1] is None
    noop = commands["noop"][1]["kv_connector_extra_config"]
    assert (noop["spec_name"], noop["spec_module_path"]) == (
        "NoopOffloadingSpec",
        "benchmarks.vllm_noop_spec",
    )
    kvtierd = commands["kvtierd"][1]["kv_connector_extra_config"]
    assert kvtierd["spec_name"] == "KvtierdOffloadingSpec"
    assert kvtierd["kvtierd_address"] == "unix:///run/k.sock"
    assert commands["noop"][1]["kv_connector"] == commands["kvtierd"][1]["kv_connector"]


def test_every_server_reserves_the_same_one_core() -> None:
    assert child_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in child_env()
