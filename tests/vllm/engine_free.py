"""vLLM's scheduler and connector worker with the plug-in, without a model.

:class:`SchedulerLoop` is vLLM's own ``Scheduler`` (which builds the scheduler
side of vLLM's ``OffloadingConnector``, hence the plug-in's manager, in the
order and with the calls of the installed release) and a worker-side
``OffloadingConnector`` over CPU KV tensors (so the plug-in's worker), stepped as
vLLM's engine core and model runner step them: ``schedule()``, the worker's
connector calls around a forward pass that does not run (one sampled token per
request whose prompt is computed), ``update_from_output``. Everything vLLM does
with the plug-in happens for real, on any supported release, without a vLLM
build that runs models on CPU (0.33 has none): the KV bytes are what the test
writes into the tensors.

The model config is the tiny Llama's (vLLM inspects it); the KV cache is one
full-attention group over its two layers, :data:`NUM_GPU_BLOCKS` blocks of
:data:`TOKENS_PER_BLOCK` tokens (4 KiB per layer and block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from vllm_e2e import SPEC

TOKENS_PER_BLOCK = 16
NUM_GPU_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_SHAPE = (2, TOKENS_PER_BLOCK, 2, 32)  # K/V, tokens, KV heads, head size: per block


def base_config(model: Path) -> Any:
    """The tiny Llama's ``VllmConfig`` without a connector (slow: vLLM inspects the
    model; build it once and :func:`with_connector` it)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    cache = CacheConfig(block_size=TOKENS_PER_BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_GPU_BLOCKS  # what the engine sets after profiling
    model_config = ModelConfig(model=str(model), dtype="bfloat16", max_model_len=2048)
    return VllmConfig(model_config=model_config, cache_config=cache)


def with_connector(config: Any, address: str, **extra: Any) -> Any:
    """``config`` with vLLM's ``OffloadingConnector`` loading the plug-in."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            **SPEC,
            "kvtierd_address": address,
            "cpu_bytes_to_use": 16 << 20,
            "kvtierd_stats_interval": 0,
            **extra,
        },
    )
    return dataclasses.replace(config, kv_transfer_config=transfer)


def kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=TOKENS_PER_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)],
    )


def worker_connector(config: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's ``OffloadingConnector`` in the worker role over random CPU KV tensors
    (registered: the plug-in's worker exists); the tensors, by layer."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    generator = torch.Generator().manual_seed(11)
    tensors = {
        name: torch.randn((NUM_GPU_BLOCKS, *KV_SHAPE), generator=generator).to(torch.bfloat16)
        for name in LAYERS
    }
    connector.register_kv_caches(tensors)
    return connector, tensors


class SchedulerLoop:
    """vLLM's ``Scheduler`` and a worker connector stepped together (module doc)."""

    def __init__(self, config: Any) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(TOKENS_PER_BLOCK, sha256)
        self.worker, self.kv = worker_connector(config)  # first: as the engine does
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config(),
            structured_output_manager=StructuredOutputManager(config),
            block_size=TOKENS_PER_BLOCK,
        )
        self.outputs: list[Any] = []  # every step's SchedulerOutput

    @property
    def manager(self) -> Any:
        """The plug-in's manager, as vLLM's scheduler-side connector holds it."""
        return self.scheduler.connector.connector_scheduler.manager

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, prompt, params, None, block_hasher=self._hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step; returns vLLM's ``SchedulerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        connector_output = self._run_worker(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self._prompt_done(r) else [] for r in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
        self.scheduler.update_from_output(out, runner_output)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 50) -> int:
        """Steps until no request is left, nor work the connector waits for; the
        number of steps."""
        for n in range(1, max_steps + 1):
            self.step()
            if not self.scheduler.has_requests() and not self._connector_busy():
                return n
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def blocks_of(self, request: Any) -> list[int]:
        """The GPU block ids vLLM gave ``request`` (its only KV group)."""
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        return list(ids)

    def kv_of(self, blocks: Iterable[int]) -> dict[str, torch.Tensor]:
        """A copy of the KV bytes of ``blocks``, by layer."""
        index = list(blocks)
        return {name: t[index].clone() for name, t in self.kv.items()}

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def _prompt_done(self, req_id: str) -> bool:
        request = self.scheduler.requests[req_id]
        return bool(request.num_computed_tokens >= request.num_prompt_tokens)

    def _connector_busy(self) -> bool:
        return bool(self.scheduler.connector.has_pending_push_work())

    def _run_worker(self, out: Any) -> Any:
        """The worker side of one step, as vLLM's model runner makes it."""
        from vllm.v1.outputs import KVConnectorOutput

        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        try:
            worker.handle_preemptions(out.kv_connector_metadata)
            worker.start_load_kv(None)  # sync loads (0.33) are waited for in here
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            return KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
        finally:
            worker.clear_connector_metadata()
