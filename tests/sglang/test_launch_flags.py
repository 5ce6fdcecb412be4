"""The launch flags the SGLang guide and the GPU end-to-end script give SGLang are flags
SGLang 0.5.23's own parser accepts, with the extra config the backend reads; the
script's verdict logic."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from benchmarks import sglang_env  # noqa: F401  (the import hook, before SGLang)
from benchmarks.sglang_gpu_e2e import Run, check, server_command
from kvtierd_client.sglang.settings import EXTRA_KEYS, StorageSettings

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sglang.md"


def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def _guide_launch() -> list[str]:
    """The guide's quick-start command line, after ``python -m sglang.launch_server``."""
    section = GUIDE.read_text().split("## Quick start", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    command = block[block.index("python -m sglang.launch_server") :].replace("\\\n", " ")
    return shlex.split(command)[3:]


def test_the_guides_launch_flags_parse_with_sglangs_parser():
    args = _sglang_parser().parse_args(_guide_launch())
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert set(extra) <= set(EXTRA_KEYS)
    assert extra["module_path"] == "kvtierd_client.sglang" and extra["interface_v1"] == 1
    settings = StorageSettings.from_extra_config(extra)
    assert settings.interface_v1 and settings.pool_bytes == 16 << 30


def test_gpu_script_flags_parse_with_sglangs_parser():
    ns = argparse.Namespace(
        model="org/model", tp=2, port=30011, page_size=64, layout="page_first_direct",
        pool_bytes=1 << 30, mem_fraction=0.7,
    )  # fmt: skip
    args = _sglang_parser().parse_args(server_command(ns, "unix:///tmp/k.sock")[3:])
    assert args.tp_size == 2 and args.hicache_mem_layout == "page_first_direct"
    assert args.enable_cache_report and args.hicache_storage_prefetch_policy == "wait_complete"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["kvtierd_address"] == "unix:///tmp/k.sock"


def test_gpu_script_verdict():
    run = Run(model="m", pool_rows_used=32)
    run.cold = {"text": "a b", "output_ids": [1, 2], "cached_tokens": 0}
    run.warm = {"text": "a b", "output_ids": [1, 2], "cached_tokens": 2048,
                "cached_tokens_details": {"device": 0, "host": 0, "storage": 2048}}  # fmt: skip
    check(run)
    assert run.passed
    run.warm = {**run.warm, "output_ids": [1, 3]}
    check(run)
    assert not run.passed and not run.checks["tokens equal"]
    run.warm = {"text": "a b", "output_ids": [1, 2], "cached_tokens": 2048,
                "cached_tokens_details": {"device": 2048, "host": 0, "storage": 0}}  # fmt: skip
    check(run)
    assert not run.passed and not run.checks["cached tokens from kvtierd > 0"]
