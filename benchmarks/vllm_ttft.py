"""Time to first token with the prompt's prefix in kvtierd vs recomputed (vLLM, CPU).

Run with ``make bench-vllm`` (or ``.venv-vllm/bin/python -m benchmarks.vllm_ttft``):
starts a kvtierd on a private socket, runs the tiny local Llama in one in-process
vLLM engine offloading to it, and for each prompt length measures:

* ``recompute``: a prompt nobody has seen (every token computed);
* ``kvtierd``: the same prompt again after ``reset_prefix_cache()`` (the engine
  forgot it; its full blocks load from the daemon's region).

TTFT is the wall time of a one-token generation. Prints a small table (median of
``--repeat`` runs). Not part of ``make bench``: it needs the vLLM venv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The CPU build reserves one more core when a kv_transfer_config is given (docs/guides/vllm.md,
# "Tests and benchmarks"): pin the reservation so runs with and without the connector bind
# cores alike.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,1920", help="prompt lengths (tokens)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    sys.path.insert(0, str(REPO / "tests"))
    from daemon_harness import start_daemon  # the tests' daemon launcher

    from benchmarks.vllm_model import build_tiny_llama

    daemon = start_daemon("--memory-budget", "512MiB")
    try:
        with tempfile.TemporaryDirectory(prefix="tiny-llama-") as model_dir:
            build_tiny_llama(model_dir)
            rows = measure(model_dir, daemon.address, lengths, args.repeat)
    finally:
        daemon.stop()
        daemon.cleanup()
    print("TTFT, tiny Llama on CPU, median of", args.repeat, "runs")
    print(f"{'prompt tokens':>13} {'from kvtierd':>12} {'recompute ms':>12} {'kvtierd ms':>10} "
          f"{'speed-up':>9}")  # fmt: skip
    for length, hit_tokens, cold_ms, warm_ms in rows:
        print(f"{length:>13} {hit_tokens:>12} {cold_ms:>12.1f} {warm_ms:>10.1f} "
              f"{cold_ms / warm_ms:>8.2f}x")  # fmt: skip
    return 0


def measure(
    model_dir: str, address: str, lengths: list[int], repeat: int
) -> list[tuple[int, int, float, float]]:
    """[(prompt tokens, tokens loaded, median recompute ms, median kvtierd ms)]."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from benchmarks.vllm_model import llm_kwargs, random_prompt

    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KvtierdOffloadingSpec",
            "spec_module_path": "kvtierd_client.vllm",
            "kvtierd_address": address,
            "cpu_bytes_to_use": 256 << 20,
        },
    )
    kwargs = llm_kwargs(model_dir, config)
    kwargs["disable_log_stats"] = True
    llm = LLM(**kwargs)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
        return (time.perf_counter() - start) * 1000, int(out.num_cached_tokens or 0)

    ttft(random_prompt(256, seed=10_000))  # warm-up (first-call overheads)
    rows = []
    seed = 0
    for length in lengths:
        cold_ms, warm_ms, loaded = [], [], 0
        for _ in range(repeat):
            seed += 1
            prompt = random_prompt(length, seed=seed)
            ms, _ = ttft(prompt)  # nobody has seen it: computed, then offloaded
            cold_ms.append(ms)
            ttft([prompt[0]])  # one more engine step: the stores complete
            llm.reset_prefix_cache()
            ms, loaded = ttft(prompt)
            warm_ms.append(ms)
            llm.reset_prefix_cache()
        rows.append((length, loaded, statistics.median(cold_ms), statistics.median(warm_ms)))
    llm.llm_engine.engine_core.shutdown()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
