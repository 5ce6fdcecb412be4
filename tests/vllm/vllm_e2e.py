"""Helpers of the vLLM end-to-end tests (engines, daemon stats, vLLM metrics)."""

from __future__ import annotations

from typing import Any

from kvtierd_client.client import Client

SPEC = {"spec_name": "KvtierdOffloadingSpec", "spec_module_path": "kvtierd_client.vllm"}
TOKENS_PER_BLOCK = 128  # vLLM's CPU block size for this model
BLOCK_KV_BYTES = 64 << 10  # 2 layers x K,V x 2 heads x 32 dims x 128 tokens x 2 bytes


def kv_transfer_config(address: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            **SPEC,
            "kvtierd_address": address,
            "cpu_bytes_to_use": 64 << 20,
            "kvtierd_start_timeout": 2,
            **extra,
        },
    )


def shutdown_llm(llm: Any) -> None:
    """Stops an in-process engine (its spec closes its daemon sessions)."""
    llm.llm_engine.engine_core.shutdown()


def generate(llm: Any, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    """Greedy tokens for ``prompt`` and how many prompt tokens were not computed."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def manager_of(llm: Any) -> Any:
    """The engine's ``KvtierdOffloadingManager`` (in-process engines only)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager


def pool_stats(address: str, pool: str) -> Any:
    """The pool's ``PoolStats`` as the daemon reports them."""
    with Client(address) as client:
        (stats,) = client.get_stats(pool).pools
    return stats


def tier(stats: Any, name: str) -> Any:
    return next(
        t for t in stats.tiers if t.tier == name or (name != "primary" and t.tier != "primary")
    )


def vllm_counter(llm: Any, name: str) -> float:
    """The sum of vLLM's Prometheus counter ``name`` over its label sets."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)
